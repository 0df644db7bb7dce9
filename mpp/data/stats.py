"""Pixel statistics measured on the data (``data.mean`` / ``data.std`` / ``data.value_range``
"auto"): ImageNet's mean and std are wrong for grey scans, satellite bands or microscopy (mae
#179: grey reconstructions come back blue), and 16-bit data has no implicit range.

A seeded sample of ``samples`` training images (the shards in a seeded order, read from the start
until the sample is full), split across the ranks by shard, each image whole (decoded, no crop):
per channel the count, sum, sum of squares, minimum and maximum of the raw values, all-reduced.
The range is the observed minimum and maximum when "auto" (else the stated one, or [0, 255] for
8-bit data); the mean and std are of the values mapped to [0, 1] by it. Cached like the shard
counts (``mpp.data.census``): ``.mpp_stats.json`` beside the shards when that folder can be
written (valid while every shard's size and mtime stay), else ``RUN/pixel_stats.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .census import _stat
from .errors import SkipCounter
from .sources import _local_path, _read_json, _write_json
from .tario import shard_samples
from .transforms import IMAGE_KEYS, PixelFormat, SampleFormatError, raw_array

CACHE_FILE = ".mpp_stats.json"  # beside the shards
RUN_CACHE_FILE = "pixel_stats.json"  # in the run directory
RUN_FILE = "data.json"  # in the run directory, beside config.json: the statistics the run used


@dataclass(frozen=True)
class Pixels:
    """The pixel statistics a run uses: its config's, with what the config says "auto" measured
    (``mpp.train.plan.measure_pixels``). The loaded config keeps "auto"; the run's plan holds
    these, and ``RUN/data.json`` beside its config.json."""

    mean: tuple[float, ...]  # per channel, of [0, 1] values
    std: tuple[float, ...]
    format: PixelFormat  # channels, layout and the value range that maps to [0, 1] (None: 8-bit)

    def save(self, run_dir: Path) -> None:
        vr = self.format.value_range
        record = {"mean": self.mean, "std": self.std, "value_range": vr}
        _write_json(Path(run_dir) / RUN_FILE, {k: list(v) if v else v for k, v in record.items()})


def run_pixels(run_dir: str | Path) -> dict | None:
    """The mean, std and value range a run used: its data.json, else (a run from before data.json)
    its config.json's data section where it states numbers; None when neither does."""
    run_dir = Path(run_dir)
    if (run_dir / RUN_FILE).is_file():
        return json.loads((run_dir / RUN_FILE).read_text())
    if not (run_dir / "config.json").is_file():
        return None
    data = json.loads((run_dir / "config.json").read_text()).get("data") or {}
    if "auto" in (data.get("mean"), data.get("std"), data.get("value_range")):
        return None
    return {k: data.get(k) for k in ("mean", "std", "value_range")}


@dataclass(frozen=True)
class PixelStats:
    mean: tuple[float, ...]  # per channel, of [0, 1] values
    std: tuple[float, ...]
    value_range: tuple[float, float]  # what maps to [0, 1]
    images: int  # how many were measured


def signature(shards: list[str], fmt: PixelFormat, samples: int, seed: int) -> str:
    """What the statistics depend on: the shards (with each local one's size and mtime), the
    format and the sample; a changed shard makes a new one."""
    ident = [[s, _stat(s)] for s in shards]
    key = json.dumps([ident, fmt.channels, fmt.layout, fmt.value_range, samples, seed])
    return hashlib.sha1(key.encode()).hexdigest()[:16]


def measure(
    shards: list[str], fmt: PixelFormat, samples: int, seed: int = 0, allow_pipe: bool = False
) -> PixelStats:
    """The statistics of a seeded sample of ``samples`` images; a collective under a process
    group (each rank reads its share of the shards, the sums all-reduced)."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    order = list(shards)
    random.Random(f"stats/{seed}").shuffle(order)
    mine, quota = order[rank::world], samples // world + (rank < samples % world)
    c = fmt.channels
    sums = np.zeros((3, c))  # count, sum, sum of squares
    lo, hi = np.full(c, np.inf), np.full(c, -np.inf)
    errors = SkipCounter()
    read, eight_bit = 0, 1.0
    for sample in shard_samples(({"url": u} for u in mine), errors, allow_pipe, images_only=True):
        if read >= quota:
            break
        data = next(sample[k] for k in IMAGE_KEYS if k in sample)
        try:
            native = raw_array(data, fmt)
        except Exception:  # noqa: BLE001  corrupt data raises many types; training skips it too
            continue
        eight_bit = min(eight_bit, float(native.dtype == np.uint8))
        a = native.reshape(-1, c).astype(np.float64)
        sums += [np.full(c, len(a)), a.sum(0), np.square(a).sum(0)]
        lo, hi = np.minimum(lo, a.min(0)), np.maximum(hi, a.max(0))
        read += 1
    total = torch.tensor(np.concatenate([sums.ravel(), [read]]), dtype=torch.float64)
    lows, highs = torch.tensor(np.append(lo, -eight_bit)), torch.tensor(hi)
    if distributed:
        dist.all_reduce(total)
        dist.all_reduce(lows, op=dist.ReduceOp.MIN)
        dist.all_reduce(highs, op=dist.ReduceOp.MAX)
    sums, images = total[:-1].numpy().reshape(3, c), int(total[-1])
    if images == 0:
        raise ValueError(f"no image of {c} channel(s) could be read from {len(shards)} shard(s)")
    if fmt.value_range is not None:
        span = tuple(float(v) for v in fmt.value_range)
    elif lows[-1] == -1.0:  # every image 8-bit: 0..255, as the stream maps it
        span = (0.0, 255.0)
    else:
        span = (float(lows[:-1].min()), float(highs.max()))
    n, s1, s2 = sums
    mean_raw, var_raw = s1 / n, np.maximum(s2 / n - (s1 / n) ** 2, 0.0)
    width = span[1] - span[0] or 1.0
    mean = tuple(float(v) for v in (mean_raw - span[0]) / width)
    std = tuple(float(max(v, 1e-12)) for v in np.sqrt(var_raw) / width)
    return PixelStats(mean, std, span, images)


def first_dtype(
    shards: list[str], fmt: PixelFormat, allow_pipe: bool = False, tries: int = 8
) -> np.dtype | None:
    """The array type of the first image that decodes and fits ``fmt``'s channels and layout
    among the first ``tries`` of the first shard (None when none decodes: the census and the
    stream report those). When none of those that decode fits, the first one's SampleFormatError
    (the stream would skip them all), whatever its dtype: a stray misfit among fitting images is
    one skipped sample, not a refused run."""
    errors = SkipCounter()
    samples = shard_samples(({"url": u} for u in shards[:1]), errors, allow_pipe, images_only=True)
    misfit: SampleFormatError | None = None
    for i, sample in enumerate(samples):
        if i >= tries:
            break
        try:
            return raw_array(next(sample[k] for k in IMAGE_KEYS if k in sample), fmt).dtype
        except SampleFormatError as e:
            if e.key is not None:  # data.channels / data.layout: the next may fit
                misfit = misfit or e
        except Exception:  # noqa: BLE001  a corrupt one: the next
            continue
    if misfit is not None:
        raise misfit
    return None


def pixel_stats(
    shards: list[str],
    fmt: PixelFormat,
    samples: int,
    run_dir: Path | None = None,
    allow_pipe: bool = False,
) -> tuple[PixelStats, str]:
    """The statistics from the cache, else measured (a collective) and cached by rank 0: (the
    statistics, where they came from)."""
    sig = signature(shards, fmt, samples, 0)
    folder = os.path.dirname(_local_path(shards[0])) if _stat(shards[0]) else None
    places = [Path(folder) / CACHE_FILE] if folder else []
    places += [Path(run_dir) / RUN_CACHE_FILE] if run_dir else []
    for path in places:
        hit = (_read_json(str(path)) or {}).get(sig)
        if hit:
            stats = PixelStats(
                **{k: tuple(v) if isinstance(v, list) else v for k, v in hit.items()}
            )
            return stats, f"cached in {path}"
    stats = measure(shards, fmt, samples, allow_pipe=allow_pipe)
    if not dist.is_initialized() or dist.get_rank() == 0:
        _save(places, sig, stats)
    return stats, f"measured on {stats.images} images"


def _save(places: list[Path], sig: str, stats: PixelStats) -> None:
    record = {sig: {k: list(v) if isinstance(v, tuple) else v for k, v in vars(stats).items()}}
    for path in places:
        try:
            if not os.access(path.parent, os.W_OK):
                continue
            _write_json(path, {**(_read_json(str(path)) or {}), **record})
            return
        except OSError:  # a full or read-only filesystem: the next place
            continue
