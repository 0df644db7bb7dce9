"""One fake training step of the real objective: activation peak, FLOPs and per-op bytes, with
no memory allocated. Run in a subprocess (``measure``): a dispatch-mode error inside conv2d kills
the process instead of raising, and each fake step gets its own TORCH_EXTENSIONS_DIR (DeepSpeed's JIT
build cache is shared and locked).

    python -m mpp.tools.planner.fake_step '{"config": "mae_b16", "overrides": [], "micro": [64, 128], "dtype": "bf16"}'
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mpp.tools.planner.cost import OpCosts, flop_counter
from mpp.tools.planner.memory import PeakTracker, materialize

# the weights' dtype of each train.precision (bf16-autocast: fp32 weights, the step under autocast)
DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "bf16-autocast": torch.float32,
}


def build_on_meta(cfg: Any) -> torch.nn.Module:
    """The config's objective (fine-tuning's: the classifier, mixup and all), built on the meta
    device (no init cost, no memory), in training mode at the end of its schedule (HPM: the
    teacher runs at its final hard-patch share); ``model.grad_checkpointing`` is honoured by the
    builder."""
    from mpp.build import build_objective
    from mpp.config import FinetuneConfig

    with torch.device("meta"):
        if isinstance(cfg, FinetuneConfig):
            from mpp.transfer.finetune import build_classifier

            objective = build_classifier(cfg)
        else:
            objective = build_objective(cfg)
    if hasattr(objective, "set_progress"):
        objective.set_progress(1.0, 1.0)
    return objective.train()


def fake_images(objective: torch.nn.Module, micro: int, img_size: int) -> torch.Tensor:
    """The engine's input: the loader's uint8 batch normalised to fp32 on the device."""
    chans = objective.encoder.patch_embed.in_chans
    return torch.empty(micro, chans, img_size, img_size, dtype=torch.uint8).float()


def step(objective: torch.nn.Module, images: torch.Tensor) -> None:
    """Forward and backward as the engine runs them (a classifier takes labels too)."""
    batch = {"image": images, "label": torch.zeros(images.shape[0], dtype=torch.int64)}
    with steady_mixup():
        loss, _metrics = objective(*objective.inputs(batch))
    loss.backward()
    for p in objective.parameters():
        p.grad = None


@contextlib.contextmanager
def steady_mixup() -> Iterator[None]:
    """Fine-tuning's mixup with its coin flips made on the host in Python (mixup, lam 0.5): the
    tensors a mixed step makes, without the host-side draws (``.item()``) a fake tensor cannot
    answer."""
    from mpp.objectives import classifier

    real = classifier.mixup_cutmix

    def mixed(images, targets, mixup, cutmix, *args, **kwargs):
        if mixup <= 0 and cutmix <= 0:
            return images, targets, 1.0
        return images * 0.5 + images.flip(0) * 0.5, targets * 0.5 + targets.flip(0) * 0.5, 0.5

    classifier.mixup_cutmix = mixed
    try:
        yield
    finally:
        classifier.mixup_cutmix = real


def activation_peak(objective: torch.nn.Module, micro: int, img_size: int) -> int:
    """Bytes of activations and temporaries at the peak of one forward + backward (fake mode
    active). Alone under the tracker: with the counting modes stacked inside it, a checkpointed
    step's peak came out 9x too high (ViT-L MAE at 64: 1.94 GiB against 0.21)."""
    tracker = PeakTracker()
    tracker.track_external(objective)
    with tracker:
        step(objective, fake_images(objective, micro, img_size))
    return tracker.peak_activation_bytes()


def op_costs(objective: torch.nn.Module, micro: int, img_size: int) -> dict[str, Any]:
    """FLOPs (FlopCounterMode) and per-op (flops, bytes, count) calls of one step."""
    flops, costs = flop_counter(), OpCosts()
    with flops, costs:
        step(objective, fake_images(objective, micro, img_size))
    return {
        "flops": flops.get_total_flops(),
        "calls": [[f, b, n] for (f, b), n in costs.calls.items()],
    }


@contextlib.contextmanager
def fake_mode() -> Iterator[None]:
    """FakeTensorMode, with mpp.ops' per-device mean/std caches emptied on the way in and out: a
    fake tensor cached for "cpu" must never meet a real step in the same process, nor a real one
    a fake step."""
    from mpp import ops

    caches = (ops._pixel_stats,)
    for cache in caches:
        cache.cache_clear()
    try:
        with FakeTensorMode():
            yield
    finally:
        for cache in caches:
            cache.cache_clear()


def run(config: str, overrides: list[str], micro: list[int], dtype: str) -> dict[str, Any]:
    """In this process: parameter sizes, one fake step per micro-batch size, and the FLOPs and
    bytes of the first."""
    from mpp.train.plan import load_plan_config

    cfg, _ = load_plan_config(config, overrides)
    meta = build_on_meta(cfg)
    sizes = {
        "trainable": [p.numel() for p in meta.parameters() if p.requires_grad],
        "frozen": [p.numel() for p in meta.parameters() if not p.requires_grad],
    }
    img_size = meta.encoder.patch_embed.img_size[0]
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16-autocast")
    with fake_mode(), autocast:
        objective = materialize(meta, DTYPES[dtype])
        steps = [
            {"micro": b, "activation_bytes": activation_peak(objective, b, img_size)} for b in micro
        ]
        steps[0].update(op_costs(objective, micro[0], img_size))
    return {**sizes, "img_size": img_size, "steps": steps}


def measure(
    config: str, overrides: list[str], micro: list[int], dtype: str, timeout: int = 600
) -> dict[str, Any]:
    """``run`` in a subprocess with its own TORCH_EXTENSIONS_DIR; RuntimeError with its last
    lines if it fails."""
    request = json.dumps({"config": config, "overrides": overrides, "micro": micro, "dtype": dtype})
    with tempfile.TemporaryDirectory(prefix="mpp-plan-") as ext:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": ext}
        cmd = [sys.executable, "-m", "mpp.tools.planner.fake_step", request]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"the fake step failed (exit {r.returncode}):\n{tail}")
    return json.loads(r.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    print(json.dumps(run(**args)))
