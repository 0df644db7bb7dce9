"""The recipe at N GPUs: the batch split, the lr after scaling, steps per epoch, and what the
data side needs per node to keep up with the predicted step rate."""

from __future__ import annotations

import math
from typing import Any

from mpp.config import Config
from mpp.train.optim import peak_lr

# one DataLoader worker's images/s (decode, RandomResizedCrop, flip) on one core:
# ``python -m benchmarks data``, 2026-11-23 (BENCHMARKS.md "data"): 282.7 img/s
PER_WORKER_IPS = 282.7
# docs/data.md, "Data order and memory per node": ImageNet's JPEGs average ~110 kB encoded
ENCODED_IMAGE_BYTES = 110e3


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
