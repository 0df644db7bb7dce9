"""Pixel statistics measured on the data (``data.mean`` / ``data.std`` / ``data.value_range``
"auto"), from a seeded sample of whole images split across the ranks, cached like the shard
counts (docs/ARCHITECTURE.md §4.8). The range is the observed minimum and maximum when "auto"
(else the stated one, or [0, 255] for 8-bit data); the mean and std are of the values mapped to
[0, 1] by it."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpp.parallel.distributed import rank_world, split_scan

from .census import _stat, cache_places, read_cache, write_cache
from .errors import SkipCounter
from .sources import _write_json
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
    group (each rank reads its share of the shards and of the sample, the sums gathered)."""
    order = list(shards)
    random.Random(f"stats/{seed}").shuffle(order)
    world = rank_world()[1]
    shares = [(order[r::world], samples // world + (r < samples % world)) for r in range(world)]
    parts = split_scan(shares, lambda share: _tally(*share, fmt, allow_pipe))
    sums, read = sum(p[0] for p in parts), sum(p[3] for p in parts)
    if read == 0:
        c, n = fmt.channels, len(shards)
        raise ValueError(f"no image of {c} channel(s) could be read from {n} shard(s)")
    if fmt.value_range is not None:
        span = tuple(float(v) for v in fmt.value_range)
    elif all(p[4] for p in parts):  # every image 8-bit: 0..255, as the stream maps it
        span = (0.0, 255.0)
    else:
        span = (float(min(p[1].min() for p in parts)), float(max(p[2].max() for p in parts)))
    n, s1, s2 = sums
    mean_raw, var_raw = s1 / n, np.maximum(s2 / n - (s1 / n) ** 2, 0.0)
    width = span[1] - span[0] or 1.0
    mean = tuple(float(v) for v in (mean_raw - span[0]) / width)
    std = tuple(float(max(v, 1e-12)) for v in np.sqrt(var_raw) / width)
    return PixelStats(mean, std, span, read)


def _tally(mine: list[str], quota: int, fmt: PixelFormat, allow_pipe: bool) -> tuple:
    """One rank's share of ``measure``: per channel (count, sum, sum of squares), minimum and
    maximum over the first ``quota`` images of its shards; how many; whether all were 8-bit."""
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
    return sums, lo, hi, read, eight_bit == 1.0


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
    places = cache_places(shards[0], CACHE_FILE, run_dir, RUN_CACHE_FILE)
    for path in places:
        if hit := read_cache(path).get(sig):
            stats = PixelStats(
                **{k: tuple(v) if isinstance(v, list) else v for k, v in hit.items()}
            )
            return stats, f"cached in {path}"
    stats = measure(shards, fmt, samples, allow_pipe=allow_pipe)
    if rank_world()[0] == 0:  # into the first place that takes it
        record = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(stats).items()}
        any(write_cache(path, {sig: record}) for path in places)
    return stats, f"measured on {stats.images} images"
