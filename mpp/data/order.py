"""The training data's global order: what each step of an epoch trains on is fixed by (seed, epoch,
step) alone, whatever the world size, micro batch or workers (docs/ARCHITECTURE.md §3.3)."""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import webdataset as wds

from .errors import SkipCounter
from .tario import shard_samples
from .transforms import IMAGE_KEYS


def epoch_order(num_shards: int, seed: int, epoch: int) -> list[int]:
    """The epoch's shard order (indices), the same on every rank."""
    order = list(range(num_shards))
    random.Random(f"order/{seed}/{epoch}").shuffle(order)
    return order


@dataclass(frozen=True)
class EpochShards:
    """One epoch's concatenation: ``shards`` (``sizes`` samples each, counted before training)
    read end to end in the epoch's ``order``; ``allow_pipe`` lets ``pipe:`` URLs run. ``keys``:
    per shard, the only samples read (a labelled subset, ``mpp.data.labels``; ``sizes`` count them).
    ``index_dir``: the member indexes no shard folder could keep (``mpp.data.shard_index``)."""

    shards: list[str]
    sizes: list[int]
    order: list[int]
    allow_pipe: bool
    keys: Sequence[frozenset[str]] | None = None
    index_dir: str | None = None

    def read_from(
        self, start: int, errors: SkipCounter, count: int | None = None
    ) -> Iterator[dict]:
        """Raw tar samples from position ``start`` of the concatenation, wrapping around forever.
        ``count``: the positions the reader wants (a stream's range): a shard is read only as far
        as they reach (with its member index) unless more are asked for."""
        sizes, order = self.sizes, self.order
        offset = start % max(1, sum(sizes))
        first = 0
        while offset and offset >= sizes[order[first]]:
            offset -= sizes[order[first]]
            first += 1
        for n in itertools.count():
            index = order[(first + n) % len(order)]
            item = {"url": self.shards[index], "skip": offset if n == 0 else 0}
            if count:  # the range's samples in this shard; the ones after it read when asked for
                item["count"] = min(count, sizes[index] - item["skip"])
                count -= item["count"]
            if self.keys is not None:
                item["keys"] = self.keys[index]
                if len(item["keys"]) <= SUBSET_KEPT:
                    yield from _kept_subset(item, errors, self.allow_pipe)
                    continue
            yield from shard_samples([item], errors, self.allow_pipe, True, self.index_dir)


# A few-label subset's samples, kept per process across epochs: with 30 labelled images an epoch
# is a step or two, and every stream reopening its shard and passing over the other members' tar
# headers each epoch kept the demo's few-label steps waiting for data a third of the time
# (data_wait_frac 0.32). A shard's subset of up to SUBSET_KEPT samples is read once, whole and
# without error, and served from memory after (the same samples in the same order).
SUBSET_KEPT = 64
KEPT_BYTES = 64 << 20  # per process: beyond it (ImageNet's 1 %: 1.4 GB) shards are read as before
_KEPT: dict[tuple, list[dict]] = {}
_kept_bytes = [0]


def _kept_subset(item: dict, errors: SkipCounter, allow_pipe: bool) -> Iterator[dict]:
    """``shard_samples([item], images_only=True)`` for a keyed item, from memory after the first
    clean read (``skip`` counts the subset's samples in tar order, as the tar reader does)."""
    url = item["url"]
    # a local file rewritten since (same path, another run in this process) is read again
    stat = os.stat(url) if os.path.isfile(url) else None
    kept = (url, item["keys"], stat and (stat.st_mtime_ns, stat.st_size))
    samples = _KEPT.get(kept)
    if samples is None:
        before = errors.skipped
        samples = list(shard_samples([{**item, "skip": 0}], errors, allow_pipe))
        size = sum(len(v) for s in samples for v in s.values() if isinstance(v, bytes))
        # a bad shard is read as it is every epoch (its errors counted each time, as before)
        if errors.skipped == before and _kept_bytes[0] + size <= KEPT_BYTES:
            _KEPT[kept] = samples
            _kept_bytes[0] += size
    for sample in samples[item["skip"] :]:
        if any(ext in sample for ext in IMAGE_KEYS):
            yield dict(sample)


def stream_samples(
    epoch: EpochShards,
    stream: int,
    steps: int,
    window: int,
    rng: random.Random,
    select,
    errors: SkipCounter,
) -> Iterator:
    """Stream ``stream``'s samples: its ``steps`` positions of ``epoch`` through a shuffle window,
    then (only when bad data left it short) the samples after its range. ``select``: raw sample
    -> (bytes, label, key)."""
    mine = itertools.islice(epoch.read_from(stream * steps, errors, steps), steps)
    shuffled = (
        wds.shuffle(window, initial=window, rng=rng)(select(mine)) if window > 1 else select(mine)
    )
    after = select(epoch.read_from((stream + 1) * steps, errors))
    return itertools.chain(shuffled, after)


def split(n: int, parts: int, part: int) -> range:
    """Items of ``range(n)`` in contiguous part ``part`` of ``parts`` (sizes differ by at most one)."""
    return range(n * part // parts, n * (part + 1) // parts)


def schedule(steps: int, accum: int, start_batch: int) -> Iterator[tuple[int, int]]:
    """(step in epoch, micro-batch in step) from micro-batch ``start_batch`` of the rank's epoch."""
    for index in range(start_batch, steps * accum):
        yield divmod(index, accum)


def done_before(stream_group: int, start_batch: int, accum: int) -> int:
    """Samples a stream of micro-batch group ``stream_group`` gave before micro-batch ``start_batch``."""
    step, micro = divmod(start_batch, accum)
    return step + (stream_group < micro)
