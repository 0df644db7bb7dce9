"""The training step as a run takes it, timed in this process: an objective built from a config, the
engine from that config's own DeepSpeed dict (bf16 is DeepSpeed's bf16 mode, not autocast; TF32
as training leaves it), one micro-step as ``mpp.train.trainer.Trainer`` takes it, the finite
check and HPM's EMA included (docs/ARCHITECTURE.md §5.1, §6.1). Shared by the doctor and the
clone's suites."""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import torch

import mpp
from mpp.build import build_objective, pixel_stats
from mpp.checkpoint.state import RunState
from mpp.config import Config
from mpp.parallel import zero
from mpp.tools.flops import step_flops
from mpp.tools.measure import interleaved_times
from mpp.train.trainer import after_optimizer_step, micro_step, start_engine, to_device


class EngineStep:
    """One objective under ``deepspeed.initialize`` (a process group must exist: one rank is
    enough; on more, ``train.batch_size`` is split between them) and ``step()``: one micro-step, the trainer's own ``micro_step`` and ``after_optimizer_step``."""

    def __init__(self, cfg: Config, device: torch.device, compile: bool = False) -> None:
        torch.manual_seed(cfg.train.seed)
        objective = build_objective(cfg)
        world = torch.distributed.get_world_size()
        ds_config = cfg.deepspeed_config(world, device.type)
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"compile": compile})})
        self.engine, self.optimizer = start_engine(cfg, objective, ds_config)
        self.cfg, self.device, self.model = cfg, device, self.engine.module
        self.gathers = zero.gather_stream(self.optimizer)  # ZeRO-3's, on CUDA
        self.precision = cfg.resolved_precision(device.type)
        self.zero_stage = ds_config["zero_optimization"].get("stage", 0)
        # half-way through the schedule: HPM's teacher runs (k > 0), as in all but its first steps
        self.model.set_progress(50.0, 100.0)
        img = self.model.encoder.patch_embed.img_size
        gen = torch.Generator().manual_seed(0)
        # the loader's uint8 batch, already on the device: the data path is the launcher run's to measure
        micro, _ = cfg.micro_batch(world)
        self.images = torch.randint(0, 256, (micro, 3, *img), dtype=torch.uint8, generator=gen).to(
            device
        )
        self.state = RunState()
        self.pixels = pixel_stats(cfg)  # the config's, or stand-ins for "auto" (a timing)
        self.check_finite = cfg.train.skip_nonfinite
        self.flops_per_image = step_flops(self.model).step

    def step(self) -> None:
        batch = to_device({"image": self.images}, self.device, *self.pixels)
        if micro_step(self.engine, batch, self.state, self.check_finite) is None:
            return  # the trainer skips the step too (mpp.train.nonfinite.skip_bad_step)
        after_optimizer_step(self.engine, self.gathers)

    def close(self) -> None:
        from deepspeed.runtime import torch_autocast

        self.engine.destroy()
        del self.engine, self.optimizer, self.model
        # a torch_autocast engine leaves this set for the process, and every later ZeRO engine
        # then reduces in each parameter's own dtype: the next row is measured as a run runs
        torch_autocast.TORCH_AUTOCAST_INITIALIZED = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def host_syncs(step: Callable[[], None]) -> tuple[int, dict[str, int]]:
    """How many times one step makes the host wait for the GPU (CUDA's sync debug mode counts
    each blocking call: .item(), a device-to-host copy, nonzero(), ...), and where: the Python
    line that made each one (``file:line``, the frame the warning names), most frequent first."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = Counter(
        f"{_short_path(w.filename)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    )
    return sum(sites.values()), dict(sites.most_common())


def _short_path(filename: str) -> str:
    """A frame's file as its import path spells it (``deepspeed/runtime/utils.py``,
    ``mpp/train/step.py``): the longest ``sys.path`` entry above it cut off."""
    path = Path(filename).resolve()
    # mpp's own root too: an editable install imports it through a hook, not sys.path
    roots = [Path(p or ".").resolve() for p in sys.path] + [Path(mpp.__file__).resolve().parents[1]]
    under = [r for r in roots if path.is_relative_to(r)]
    return str(path.relative_to(max(under, key=lambda r: len(r.parts)))) if under else filename


def sync_counts(runner: EngineStep) -> dict[str, Any]:
    """Host syncs of one step with and without the finite-loss check (what ``train.skip_nonfinite``
    costs: issue 22 item 16); where the step as configured makes them, and how many of those are
    mpp's own (the rest are DeepSpeed's or torch's). CUDA only."""
    counts: dict[str, Any] = {}
    check = runner.check_finite
    for on in (False, True):
        runner.check_finite = on
        runner.step()  # not the first call: lazy allocations sync once and are no per-step cost
        n, sites = host_syncs(runner.step)
        counts["with_finite_check" if on else "without_finite_check"] = n
        if on == check:
            counts["sites"] = sites
            counts["own"] = sum(k for site, k in sites.items() if site.startswith("mpp/"))
    runner.check_finite = check
    return counts


def measure(
    runner: EngineStep, rounds: int, warmup: int, beside: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """Median step time (interleaved with ``beside`` when given: the gpu-step suite's matmul),
    img/s, model FLOP/s, and on CUDA the peak memory of the steps and the host syncs per step."""
    cuda = runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
    fns = {"step": runner.step} if beside is None else {"beside": beside, "step": runner.step}
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
    if cuda:
        syncs = sync_counts(runner)
        row["host_syncs_per_step"] = syncs[
            "with_finite_check" if runner.check_finite else "without_finite_check"
        ]
        row["host_syncs"] = syncs
    return row
