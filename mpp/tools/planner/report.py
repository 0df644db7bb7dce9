"""The GPU plan of one config on N GPUs: memory, time, communication and the recipe (the batch
split, the lr after scaling, steps per epoch, and what the data side needs per node to keep up
with the predicted step rate), as one JSON-ready dict (``plan_gpus``) and a table (``render``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from mpp.config import Config, ConfigError
from mpp.tools.planner.cost import comm_bytes, comm_seconds, roofline
from mpp.tools.planner.hardware import GPU
from mpp.tools.planner.memory import FIXED_MARGIN_BYTES, FRAGMENTATION, model_states, peak_bytes
from mpp.train.optim import peak_lr

# one DataLoader worker's images/s (decode, RandomResizedCrop, flip) on one core:
# ``python -m benchmarks data``, 2026-11-23 (BENCHMARKS.md "data"): 282.7 img/s
PER_WORKER_IPS = 282.7
# docs/data.md, "Data order and memory per node": ImageNet's JPEGs average ~110 kB encoded
ENCODED_IMAGE_BYTES = 110e3
GIB = 2**30
# (overrides, micro sizes) -> fake_step.run's dict
FakeStep = Callable[[list[str], list[int]], dict[str, Any]]


def batch_split(cfg: Config, ranks: int) -> tuple[int, int]:
    """(micro batch, accumulation) at ``ranks``; ConfigError naming the key that cannot split."""
    try:
        return cfg.micro_batch(ranks)
    except ValueError as e:
        key = (
            "train.micro_batch_size"
            if cfg.train.micro_batch_size is not None
            else "train.batch_size"
        )
        raise ConfigError(
            f"{getattr(cfg, '_source', '<config>')}: {key}: {e} (at {ranks} GPUs)"
        ) from None


def activation_fit(steps: list[dict[str, Any]]) -> tuple[float, float]:
    """(bytes per image, fixed bytes) through the measured micro-batch sizes: activations grow
    linearly with the batch (every tensor of a ViT step has the batch as its first dimension)."""
    (b1, a1), (b2, a2) = [(s["micro"], s["activation_bytes"]) for s in steps[:2]]
    slope = (a2 - a1) / (b2 - b1)
    return slope, a1 - slope * b1


def largest_micro(per_image: float, fixed: float, states: float, spec: GPU) -> int:
    """The largest micro-batch whose peak (activations + states + margin) fits ``spec``."""
    room = (spec.memory_bytes - FIXED_MARGIN_BYTES) / (1 + FRAGMENTATION) - states - fixed
    return max(0, math.floor(room / per_image)) if per_image > 0 else 0


def memory_plan(
    cfg: Config, measured: dict, ranks: int, ds: dict, spec: GPU, micro: int
) -> dict[str, Any]:
    precision = cfg.resolved_precision("cuda")
    states = model_states(
        measured["trainable"],
        measured["frozen"],
        ranks,
        ds,
        precision,
        ema=getattr(getattr(cfg, "objective", None), "name", None) == "hpm",
    )
    per_image, fixed = activation_fit(measured["steps"])
    peak = peak_bytes(fixed + per_image * micro, states)
    return {
        "precision": precision,
        "peak_bytes": peak,
        "states": states,
        "fits": peak["peak"] <= spec.memory_bytes,
        "max_micro_batch": largest_micro(per_image, fixed, states["total"], spec),
        "activation_bytes_per_image": per_image,
    }


def time_plan(
    measured: dict, images: int, ranks: int, stage: int, accum: int, spec: GPU, precision: str
) -> dict:
    step = measured["steps"][0]
    per_image = roofline(step["calls"], step["micro"], spec)
    comm = comm_bytes(
        sum(measured["trainable"]), sum(measured["frozen"]), ranks, stage, accum, precision
    )
    out = {k: v * images for k, v in per_image.items() if k.endswith("_s")}
    out["comm_s"] = comm_seconds(comm["total"], ranks, spec)
    # communication overlaps compute at best: the step takes at least the slower of the two
    out["lower_bound_s"] = max(out["roofline_s"], out["comm_s"])
    return {
        "seconds": out,
        "comm": comm,
        "flops_per_image": step["flops"] / step["micro"],
        "bytes_per_image": per_image["bytes"],
    }


def recipe(
    cfg: Config,
    ranks: int,
    micro: int,
    accum: int,
    img_size: int,
    step_s: float,
    gpus_per_node: int,
) -> dict[str, Any]:
    """The batch split and the data side's needs at a step of ``step_s`` seconds (a lower
    bound: the workers it asks for are the fewest that can keep up)."""
    t, d = cfg.train, cfg.data
    per_node = min(ranks, gpus_per_node)
    rank_ips = micro * accum / step_s
    workers = workers_needed(rank_ips, PER_WORKER_IPS)
    samples = d.num_samples
    # CHW as the loader ships it: uint8, or float32 for data that is not 8-bit (value_range)
    decoded = d.channels * img_size * img_size * (4 if d.value_range is not None else 1)
    return {
        "global_batch": t.batch_size,
        "micro_batch": micro,
        "grad_accum": accum,
        "ranks": ranks,
        "split": f"{micro} x {accum} x {ranks} = {micro * accum * ranks}",
        "lr": peak_lr(cfg),
        "lr_rule": "optim.lr"
        if cfg.optim.lr is not None
        else f"blr {cfg.optim.blr} x {t.batch_size} / 256",
        "steps_per_epoch": samples // t.batch_size if samples else None,
        "images_per_s_per_gpu": rank_ips,
        "data_workers_needed_per_gpu": workers,
        "data_workers_configured": d.num_workers,
        "data_workers_ok": d.num_workers >= workers,
        # each rank's streams hold B / N x window encoded images (mpp.data.order)
        "shuffle_window_gib_per_node": t.batch_size
        / ranks
        * d.shuffle_buffer
        * ENCODED_IMAGE_BYTES
        * per_node
        / 2**30,
        # 2 prefetched micro-batches of decoded images per rank (DataLoader's prefetch_factor 2)
        "prefetch_gib_per_node": 2 * micro * decoded * per_node / 2**30,
        "cores_per_node_for_data": workers * per_node,
        "gpus_per_node": per_node,
        "nodes": math.ceil(ranks / per_node),
    }


def workers_needed(step_ips: float, per_worker_ips: float) -> int:
    """DataLoader workers (one core each) to feed ``step_ips`` images/s."""
    return math.ceil(step_ips / per_worker_ips)


def plan_gpus(
    cfg: Config, data_known: bool, ranks: int, spec: GPU, fake_step: FakeStep
) -> dict[str, Any]:
    """The plan; ConfigError when the config cannot run at ``ranks`` GPUs."""
    micro, accum = batch_split(cfg, ranks)
    ds = cfg.deepspeed_config(ranks, "cuda")
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    measured = fake_step([], [micro, 2 * micro])
    mem = memory_plan(cfg, measured, ranks, ds, spec, micro)
    checkpointed = None
    if (
        not mem["fits"]
        and hasattr(cfg.model, "grad_checkpointing")
        and not cfg.model.grad_checkpointing
    ):
        with_ckpt = fake_step(["model.grad_checkpointing=true"], [micro, 2 * micro])
        checkpointed = memory_plan(cfg, with_ckpt, ranks, ds, spec, micro)
    t = time_plan(measured, micro * accum, ranks, stage, accum, spec, mem["precision"])
    sec = t["seconds"]
    rec = recipe(
        cfg, ranks, micro, accum, measured["img_size"], sec["lower_bound_s"], spec.gpus_per_node
    )
    if not data_known:
        rec["steps_per_epoch"] = None
    peak = mem["peak_bytes"]
    return {
        "config": getattr(cfg, "_source", "<config>"),
        "gpus": ranks,
        "gpu": spec.name,
        "gpu_source": spec.source,
        "zero_stage": stage,
        "peak_gib": peak["peak"] / GIB,
        "activations_gib": peak["activations"] / GIB,
        "model_states_gib": peak["model_states"] / GIB,
        "margin_gib": peak["margin"] / GIB,
        "gpu_memory_gib": spec.memory_bytes / GIB,
        "fits": mem["fits"],
        "max_micro_batch": mem["max_micro_batch"],
        "needs_grad_checkpointing": bool(checkpointed and checkpointed["fits"]),
        "grad_checkpointing": None
        if checkpointed is None
        else {
            "peak_gib": checkpointed["peak_bytes"]["peak"] / GIB,
            "activations_gib": checkpointed["peak_bytes"]["activations"] / GIB,
            "fits": checkpointed["fits"],
            "max_micro_batch": checkpointed["max_micro_batch"],
        },
        "model_states": {k: v / GIB for k, v in mem["states"].items()},
        "flops_per_image": t["flops_per_image"],
        "bytes_per_image": t["bytes_per_image"],
        "step_time_lower_bound_s": sec["lower_bound_s"],
        "step_time_s": sec,
        "mfu_ceiling": sec["compute_s"] / sec["lower_bound_s"],
        "comm_bytes_per_step": t["comm"]["total"],
        "comm_ops": t["comm"]["ops"],
        "recipe": rec,
        "host_syncs_per_step": accum
        if cfg.train.skip_nonfinite
        else 0,  # mpp.train.trainer.all_finite's
        "parameters": {
            "trainable": sum(measured["trainable"]),
            "frozen": sum(measured["frozen"]),
        },
    }


def render(plan: dict[str, Any]) -> str:
    """The plan as a few aligned lines: memory, time, communication, recipe."""
    s, r, st = plan["step_time_s"], plan["recipe"], plan["model_states"]
    fit = "fits" if plan["fits"] else "does NOT fit"
    lines = [
        f"{plan['config']} on {plan['gpus']} x {plan['gpu']}, ZeRO-{plan['zero_stage']} "
        f"(spec sheet: {plan['gpu_source']})",
        f"memory per GPU   {plan['peak_gib']:.1f} GiB of {plan['gpu_memory_gib']:.1f}: {fit}"
        f" | activations {plan['activations_gib']:.1f} (micro-batch {r['micro_batch']})"
        f" + model states {plan['model_states_gib']:.1f} + margin {plan['margin_gib']:.1f}",
        "  model states   "
        + ", ".join(f"{k} {v:.2f}" for k, v in st.items() if k != "total")
        + " GiB",
        f"  largest micro-batch that fits: {plan['max_micro_batch']}; activation checkpointing "
        + ("needed" if plan["needs_grad_checkpointing"] else "not needed"),
    ]
    if not plan["fits"] and plan["max_micro_batch"] > 0:
        lines.append(
            f"  or accumulate more: train.max_micro_batch_size={plan['max_micro_batch']} (or below)"
        )
    if plan["grad_checkpointing"]:
        g = plan["grad_checkpointing"]
        lines.append(
            f"  with model.grad_checkpointing: {g['peak_gib']:.1f} GiB, largest micro-batch {g['max_micro_batch']}"
        )
    lines += [
        f"FLOPs per image  {plan['flops_per_image'] / 1e9:.1f} GFLOP (fwd + bwd), "
        f"{plan['bytes_per_image'] / 1e9:.2f} GB of HBM traffic",
        f"step time >=     {plan['step_time_lower_bound_s'] * 1e3:.1f} ms: compute {s['compute_s'] * 1e3:.1f},"
        f" HBM {s['memory_s'] * 1e3:.1f}, per-op roofline {s['roofline_s'] * 1e3:.1f}, comm {s['comm_s'] * 1e3:.1f}"
        f" | MFU ceiling {plan['mfu_ceiling']:.2f}",
        f"comm per step    {plan['comm_bytes_per_step'] / 1e9:.2f} GB per GPU: "
        + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in plan["comm_ops"].items()),
        f"host syncs       {plan['host_syncs_per_step']} per step"
        + (
            " (train.skip_nonfinite: one flag all-reduced and read per micro-batch; mpp doctor times it)"
            if plan["host_syncs_per_step"]
            else ""
        ),
        f"recipe           {r['split']} (global {r['global_batch']}), lr {r['lr']:.3g} ({r['lr_rule']}), "
        f"steps/epoch {r['steps_per_epoch'] if r['steps_per_epoch'] is not None else 'unknown (no data)'}",
        f"data per node    {r['images_per_s_per_gpu']:.0f} img/s per GPU at the bound: "
        f"{r['data_workers_needed_per_gpu']} workers per GPU (configured {r['data_workers_configured']}"
        f"{'' if r['data_workers_ok'] else ': too few'}), {r['cores_per_node_for_data']} cores per node; "
        f"shuffle windows {r['shuffle_window_gib_per_node']:.2f} GiB, prefetch {r['prefetch_gib_per_node']:.2f} GiB",
    ]
    return "\n".join(lines)
