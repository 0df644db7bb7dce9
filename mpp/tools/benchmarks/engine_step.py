"""The training step as a run takes it, timed in this process: an objective built from a shipped
config (``configs/{objective}_b16.json`` at a chosen size, one rank), ``deepspeed.initialize``
with that config's own DeepSpeed dict, and one micro-step exactly as ``mpp.train.trainer.Trainer`` takes
it. Shared by the gpu-step suite and ``python -m mpp.tools.doctor``.

What "as a run takes it" means here, and what the old autocast benchmark got wrong:
- bf16 is DeepSpeed's bf16 mode (the module cast to bf16, fp32 master weights in the ZeRO
  optimiser, fp32 gradient reduction: ``RunConfig.deepspeed_config``), not autocast over fp32 weights;
- TF32 stays as training leaves it: nothing in mpp sets ``torch.backends.cuda.matmul.allow_tf32``;
- the loss's finite check (``train.skip_nonfinite``, one host sync) and HPM's EMA step are in the step.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from typing import Any

import torch

from mpp.build import build_objective
from mpp.config import Config, load_config
from mpp.tools.benchmarks.common import interleaved_times, median
from mpp.tools.benchmarks.flops import step_flops
from mpp.tools.planner.hardware import spec_peak  # noqa: F401  (gpu_step and the doctor take it from here)
from mpp.train.optim import build_optimizer
from mpp.train.plan import RunState
from mpp.train.trainer import after_optimizer_step, micro_step, to_device

# validated by the config, never read: the step's images are made on the device
DUMMY_SHARDS = "unused-{000000..000000}.tar"


def step_config(
    objective: str, setting: dict, attn_backend: str = "auto", precision: str = "auto"
) -> Config:
    """``configs/{objective}_b16.json`` at the setting's model, decoder and batch, one rank, micro
    batch = batch (no accumulation), everything else (optimiser, ZeRO stage, precision) as shipped."""
    overrides = {
        "model.name": setting["model"],
        "model.attn_backend": attn_backend,
        **{f"model.{k}": v for k, v in setting["overrides"].items()},
        **(
            {f"objective.{k}": v for k, v in setting["decoder"].items()}
            if objective != "mpp"
            else {}
        ),
        "train.batch_size": setting["batch"],
        "train.max_micro_batch_size": None,
        "train.max_steps": 1,
        "train.precision": precision,
        "data.train_shards": DUMMY_SHARDS,
    }
    return load_config(f"{objective}_b16", [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


class EngineStep:
    """One objective under ``deepspeed.initialize`` (a process group must exist: one rank is
    enough) and ``step()``: one micro-step, the trainer's own ``micro_step`` and ``after_optimizer_step``."""

    def __init__(self, cfg: Config, device: torch.device, compile: bool = False) -> None:
        import deepspeed

        torch.manual_seed(cfg.train.seed)
        objective = build_objective(cfg)
        optimizer = build_optimizer(cfg, objective)
        ds_config = cfg.deepspeed_config(1, device.type)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=objective, optimizer=optimizer, config=ds_config
        )
        if compile:
            self.engine.compile()  # DeepSpeed's own torch.compile of the module it wraps
        self.cfg, self.device, self.model = cfg, device, self.engine.module
        self.precision = "bf16" if ds_config.get("bf16", {}).get("enabled") else "fp32"
        self.zero_stage = ds_config["zero_optimization"].get("stage", 0)
        # half-way through the schedule: HPM's teacher runs (k > 0), as in all but its first steps
        self.model.set_progress(50.0, 100.0)
        img = self.model.encoder.patch_embed.img_size
        gen = torch.Generator().manual_seed(0)
        # the loader's uint8 batch, already on the device: the data path is the launcher run's to measure
        self.images = torch.randint(
            0, 256, (cfg.train.batch_size, 3, *img), dtype=torch.uint8, generator=gen
        ).to(device)
        self.state = RunState()
        self.check_finite = cfg.train.skip_nonfinite
        self.flops_per_image = step_flops(self.model).step

    def step(self) -> None:
        batch = to_device(
            {"image": self.images}, self.device, self.cfg.data.mean, self.cfg.data.std
        )
        if micro_step(self.engine, batch, self.state, self.check_finite) is None:
            return  # the trainer skips the step too (mpp.train.nonfinite.skip_bad_step)
        after_optimizer_step(self.engine)

    def close(self) -> None:
        self.engine.destroy()
        del self.engine, self.optimizer, self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def host_syncs(step: Callable[[], None]) -> int:
    """How many times one step makes the host wait for the GPU (CUDA's sync debug mode counts
    each blocking call: .item(), a device-to-host copy, nonzero(), ...)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def sync_counts(runner: EngineStep) -> dict[str, int]:
    """Host syncs of one step with and without the finite-loss check (what ``train.skip_nonfinite``
    costs: issue 22 item 16). CUDA only."""
    counts = {}
    check = runner.check_finite
    for on in (True, False):
        runner.check_finite = on
        runner.step()  # not the first call: lazy allocations sync once and are no per-step cost
        counts["with_finite_check" if on else "without_finite_check"] = host_syncs(runner.step)
    runner.check_finite = check
    return counts


def measure(
    runner: EngineStep, rounds: int, warmup: int, matmul: tuple | None = None
) -> dict[str, Any]:
    """Median step time (interleaved with ``matmul``, a ``common.matmul_roofline``, when given),
    img/s, model FLOP/s, and on CUDA the peak memory of the steps and the host syncs per step."""
    cuda = runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
    fns = {"step": runner.step} if matmul is None else {"matmul": matmul[0], "step": runner.step}
    times = interleaved_times(fns, rounds, warmup, runner.device)
    t = median(times["step"])
    batch = runner.cfg.train.batch_size
    row: dict[str, Any] = {
        "step_s": t,
        "imgs_per_sec": batch / t,
        "tflops_per_s": runner.flops_per_image * batch / t / 1e12,
        "precision": runner.precision,
        "zero_stage": runner.zero_stage,
        "peak_mem_gib": torch.cuda.max_memory_allocated(runner.device) / 2**30 if cuda else None,
        "host_syncs_per_step": None,
    }
    if matmul is not None:
        row["matmul_tflops_per_s"] = matmul[2] / median(matmul[1][-rounds:]) / 1e12
    if cuda:
        syncs = sync_counts(runner)
        row["host_syncs_per_step"] = syncs[
            "with_finite_check" if runner.check_finite else "without_finite_check"
        ]
        row["host_syncs"] = syncs
    return row
