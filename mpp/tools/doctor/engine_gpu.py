"""The doctor's GPU-only engine rows: the launcher run's MFU and the in-process step's peak memory
against the planner, host syncs per step, torch.compile on/off (docs/ARCHITECTURE.md §6). Without
the planner the comparisons say "plan unavailable" and the measurements still stand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mpp.config import load_config
from mpp.tools.doctor import FAIL, PASS, WARN, Row
from mpp.tools.doctor.engine_step import EngineStep, measure
from mpp.tools.planner.hardware import spec_peak

SECTION = "engine"
MFU_OF_CEILING_MIN = 0.5  # a run below half the planner's roofline ceiling is worth a look
ROUNDS = {True: (5, 2), False: (20, 3)}  # quick -> (timed steps, warm-up steps)


def gpu_rows(
    config: Path, run: Row, plan: tuple[dict[str, Any] | None, str], quick: bool
) -> list[Row]:
    """After the launcher run (``run``): the same config's step in this process, and the plan."""
    from mpp.parallel.distributed import init_distributed

    # a one-rank group for deepspeed.initialize (the launcher run has ended)
    device = init_distributed()
    cfg = load_config(config)
    rounds, warmup = ROUNDS[quick]
    runner = EngineStep(cfg, device)
    try:
        step = measure(runner, rounds, warmup)
        step["reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        flops_per_image = runner.flops_per_image
    finally:
        runner.close()
    return [
        mfu_row(run, flops_per_image, plan, spec_peak(torch.cuda.get_device_name(device))),
        memory_row(step, plan),
        sync_row(step),
        compile_row(cfg, device, step, rounds, warmup),
    ]


def mfu_row(
    run: Row,
    flops_per_image: int,
    plan: tuple[dict[str, Any] | None, str],
    gpu_peak: tuple[float | None, str],
) -> Row:
    """The launcher run's model FLOP/s ÷ the GPU's spec-sheet ``gpu_peak`` (FLOP/s, source) against
    the plan's MFU ceiling."""
    check = "MFU vs plan"
    if run.verdict == FAIL:
        return Row(SECTION, check, FAIL, "no run to measure (see the launcher run's row)")
    peak, source = gpu_peak
    if peak is None:
        return Row(SECTION, check, WARN, source)
    mfu = flops_per_image * run.values["imgs_per_sec"] / peak
    values = {
        "mfu": mfu,
        "flops_per_image": flops_per_image,
        "peak_flops": peak,
        "peak_source": source,
    }
    reason = f"MFU {mfu:.3f} ({run.values['imgs_per_sec']:.0f} img/s x {flops_per_image / 1e9:.1f} GFLOP ÷ {source})"
    spec, why = plan
    if spec is None:
        return Row(SECTION, check, WARN, f"{reason}; {why}", values)
    ceiling = spec["mfu_ceiling"]
    values.update(mfu_ceiling=ceiling, plan_flops_per_image=spec.get("flops_per_image"))
    reason += f"; the plan's ceiling {ceiling:.3f}"
    if mfu < MFU_OF_CEILING_MIN * ceiling:
        return Row(SECTION, check, WARN, reason + f": below {MFU_OF_CEILING_MIN:.0%} of it", values)
    return Row(SECTION, check, PASS, reason, values)


def memory_row(step: dict[str, Any], plan: tuple[dict[str, Any] | None, str]) -> Row:
    """The step's allocator peak against the plan's: the plan must not be exceeded (it decides
    fits / max micro batch); a plan far above what the allocator reserved is worth a note too."""
    check = "peak memory vs plan"
    allocated, reserved = step["peak_mem_gib"], step["reserved_gib"]
    values = {"allocated_gib": allocated, "reserved_gib": reserved}
    reason = f"step peak {allocated:.1f} GiB allocated, {reserved:.1f} GiB reserved"
    spec, why = plan
    if spec is None:
        return Row(SECTION, check, WARN, f"{reason}; {why}", values)
    predicted = spec["peak_gib"]
    values["plan_peak_gib"] = predicted
    reason += f"; the plan predicts {predicted:.1f} GiB"
    if allocated > predicted:
        return Row(
            SECTION,
            check,
            FAIL,
            reason + ": the plan is too low, its fits / max micro batch cannot be trusted",
            values,
        )
    if predicted > 1.5 * reserved:
        return Row(
            SECTION,
            check,
            WARN,
            reason + ": over 1.5x what the allocator reserved (pessimistic)",
            values,
        )
    return Row(SECTION, check, PASS, reason, values)


def sync_row(step: dict[str, Any]) -> Row:
    """Goal: no host sync of mpp's own but train.skip_nonfinite's one (its all-reduced flag, read
    every micro-step). DeepSpeed's own (its gradient-norm and overflow checks) are named, not judged."""
    syncs = step["host_syncs"]
    on, off = syncs["with_finite_check"], syncs["without_finite_check"]
    reason = (
        f"{on} per step with train.skip_nonfinite's check ({syncs['own']} of them mpp's), "
        f"{off} without"
    )
    others = [f"{site} x{n}" for site, n in syncs["sites"].items() if not site.startswith("mpp/")]
    if others:
        reason += "; the rest at " + ", ".join(others[:4])
    return Row(SECTION, "host syncs per step", PASS if syncs["own"] <= 1 else WARN, reason, syncs)


def compile_row(
    cfg: Any, device: torch.device, eager: dict[str, Any], rounds: int, warmup: int
) -> Row:
    """The same step under DeepSpeed's ``engine.compile()`` (torch.compile of the module)."""
    check = "torch.compile"
    try:
        runner = EngineStep(cfg, device, compile=True)
        try:
            compiled = measure(runner, rounds, warmup)
        finally:
            runner.close()
    except Exception as e:  # a graph break is fine, a failure to compile is the finding
        return Row(
            SECTION,
            check,
            WARN,
            f"compiled step failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
        )
    speedup = eager["step_s"] / compiled["step_s"]
    values = {
        "eager_step_s": eager["step_s"],
        "compiled_step_s": compiled["step_s"],
        "speedup": speedup,
        "compiled_peak_mem_gib": compiled["peak_mem_gib"],
    }
    reason = f"eager {1e3 * eager['step_s']:.1f} ms/step, compiled {1e3 * compiled['step_s']:.1f} ms: x{speedup:.2f}"
    return Row(SECTION, check, PASS if speedup >= 0.95 else WARN, reason, values)
