"""Training and evaluation loaders: one pipeline of generators per DataLoader worker, batched in the worker.

Training: the epoch's global order (``mpp.data.order``): every rank yields the same number of
micro-batches, and what a step trains on depends on (seed, epoch, step) only:
    stream c: its range of the shards -> image/label -> shuffle window -> skip -> decode+augment
    worker: one sample of each of its streams per micro-batch part -> the main process joins parts
Evaluation: the shard list split by rank then by worker, one exact pass.
"""

from __future__ import annotations

import atexit
import itertools
import json
import math
import random
import signal
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset

from .census import census
from .errors import SkipCounter, SkipLog
from .order import EpochShards, done_before, epoch_order, schedule, split, stream_samples
from .sources import check_shards, expand_shards
from .tario import shard_samples
from .transforms import (
    IMAGE_KEYS,
    RGB,
    Augmentation,
    DeferredBatch,
    PixelFormat,
    SampleFormatError,
    collate,
    eval_transform,
    train_transform,
)

# ---- pipeline stages: each takes an iterator and yields -------------------------------------


def select_image(
    src: Iterator[dict], errors: SkipCounter, with_labels: bool, num_classes: int | None
) -> Iterator[tuple[bytes, int | None, str]]:
    """webdataset sample -> (encoded image, label, "url#key"); samples without an image/label are skipped."""
    for sample in src:
        url = sample["__url__"]
        key = f"{url}#{sample['__key__']}"
        image = next((sample[k] for k in IMAGE_KEYS if k in sample), None)
        if image is None:
            errors.skip(
                f"skipping sample {key}: no image member (has {sorted(sample)})", url, name=key
            )
            continue
        label = None
        if with_labels:
            try:
                label = int(sample["cls"])
                if num_classes is not None and not 0 <= label < num_classes:
                    raise ValueError(f"label {label} outside [0, {num_classes})")
            except (KeyError, ValueError) as exn:
                errors.skip(f"skipping sample {key}: bad or missing .cls ({exn!r})", url, name=key)
                continue
        errors.sample_read()
        yield image, label, key


def decode(
    src: Iterator, transform: Callable, rng_key: str, errors: SkipCounter, skip: int = 0
) -> Iterator[tuple]:
    """(bytes, label, key) -> (HWC uint8, label, key); the augmentation RNG is per sample position
    in the stream, and the first ``skip`` samples are dropped BEFORE decoding (cheap resume)."""
    for index, (data, label, key) in itertools.islice(enumerate(src), skip, None):
        rng = random.Random(f"aug/{rng_key}/{index}")
        try:
            image = transform(data, rng=rng)
        except SampleFormatError as exn:  # another channel count, dtype or layout
            errors.skip(f"skipping sample {key}: it {exn}", decode=True, name=key)
            continue
        except Exception as exn:  # PIL raises many types for corrupt data
            errors.skip(f"skipping sample {key}: cannot decode ({exn!r})", decode=True, name=key)
            continue
        errors.sample_decoded()
        yield image, label, key


# ---- per-worker datasets --------------------------------------------------------------------


@dataclass(frozen=True)
class StreamConfig:
    """Everything a stream's workers need, in one place (the loaders' keyword arguments)."""

    batch_size: int
    img_size: int
    rank: int = 0
    world_size: int = 1
    with_labels: bool = False
    num_classes: int | None = None
    with_keys: bool = False
    allow_pipe: bool = False
    max_consecutive_errors: int = 100
    # training only
    num_batches: int = 0
    start_batch: int = 0
    seed: int = 0
    epoch: int = 0
    crop_scale: tuple[float, float] = (0.2, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    randaug: tuple[int, int] | None = None
    shuffle_buffer: int = 16  # samples shuffled together in each stream (mpp.data.order)
    # the streams of a step: batch_size x world_size x accumulation (0: no accumulation)
    global_batch: int = 0
    # samples per shard (mpp.data.census); None: counted by the loader
    shard_sizes: tuple[int, ...] | None = None
    # per shard, the only sample keys read (a labelled subset, mpp.data.labels); None: all of them
    shard_keys: tuple[frozenset[str], ...] | None = None
    # the shards' member indexes no shard folder could keep (RUN/shard_index, mpp.data.shard_index)
    index_dir: str | None = None
    # what every sample holds: channels, layout, value range (mpp.data.transforms)
    pixels: PixelFormat = RGB
    # training only: JPEGs left for the device to decode (data.decode=gpu, mpp.data.device_decode)
    defer_jpeg: bool = False

    @classmethod
    def from_data(cls, data, epoch=None, **settings) -> StreamConfig:
        """A training stream from a config's data section (its crop, flip, shuffle and pipes) over
        an ``epoch``'s samples (a ``Census``, a labelled subset's keys), ``settings`` the rest."""
        keys = ("crop_scale", "crop_ratio", "hflip", "shuffle_buffer", "allow_pipe")
        own = {k: getattr(data, k) for k in keys}
        if epoch is not None:
            own |= {"shard_sizes": tuple(epoch.sizes), "shard_keys": getattr(epoch, "keys", None)}
        return cls(**{**own, **settings})


class _Stream(IterableDataset):
    """Shards + settings; each DataLoader worker iterates its own part (``batches``), each batch
    sent with the worker's bad-data count and what it skipped since its last batch, for the
    ``Loader`` to name (once per run: a worker does not know what the others named)."""

    def __init__(self, shards: list[str], cfg: StreamConfig):
        self.shards, self.cfg = shards, cfg

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        errors = SkipCounter(self.cfg.max_consecutive_errors, log_here=False)
        self.ahead = 0
        for batch in self.batches(worker, num_workers, errors):
            yield {**batch, **self._skips(worker, errors)}
        # a last message so errors after the final batch (or in a worker with none) still count
        yield {**self._skips(worker, errors), "_end": True}

    def _skips(self, worker: int, errors: SkipCounter) -> dict:
        # ahead: skips in batches not made yet (the next epoch's, primed), counted with them
        skipped = errors.skipped - self.ahead
        return {"_worker": worker, "_skipped": skipped, "_skips": errors.take_reports()}


class _TrainStream(_Stream):
    """The training stream from a position on. (epoch, start_batch, epochs) live in shared memory:
    persistent workers keep their copy of this object and read the position the main process set
    (``Loader.set_epoch``) when the next pass starts. ``epochs`` 0: epoch after epoch until the
    pass is dropped, so the workers open the next epoch's streams while the training process
    still consumes the last batches of this one (no stall at an epoch's start)."""

    def __init__(self, shards: list[str], cfg: StreamConfig):
        super().__init__(shards, cfg)
        self.position = torch.tensor(
            [cfg.epoch, cfg.start_batch, 1], dtype=torch.int64
        ).share_memory_()

    def batches(self, worker: int, num_workers: int, errors: SkipCounter) -> Iterator[dict]:
        epoch, start_batch, epochs = self.position.tolist()
        c = replace(self.cfg, epoch=epoch, start_batch=start_batch)
        streams = self._streams(c, worker, num_workers, errors)
        while True:
            accum = _accumulation(c)
            todo = list(schedule(c.num_batches // accum, accum, c.start_batch))
            following = epochs == 0 or c.epoch + 1 < epoch + epochs
            upcoming = replace(c, epoch=c.epoch + 1, start_batch=0)
            primed = None
            for n, (_, group) in enumerate(todo):
                part = [next(s) for s in streams[group]]
                yield collate(part, with_keys=c.with_keys, img_size=c.img_size) if part else {}
                left = len(todo) - n - 1
                if following and left < PRIME_BATCHES:  # the next epoch's streams, a share a batch
                    if primed is None:
                        primed = _Primed(self._streams(upcoming, worker, num_workers, errors))
                    before = errors.skipped
                    primed.prime(1 / (left + 1))
                    # the next epoch's bad samples count in its batches: a resume there meets them
                    self.ahead += errors.skipped - before
            if not following:
                return
            c, self.ahead = upcoming, 0
            streams = primed.streams if primed else self._streams(c, worker, num_workers, errors)

    def _streams(
        self, c: StreamConfig, worker: int, num_workers: int, errors: SkipCounter
    ) -> list[list[Iterator]]:
        """This worker's sample streams of epoch ``c.epoch`` from ``c.start_batch``, by
        micro-batch group (lazy: nothing is opened until a stream is first read)."""
        accum = _accumulation(c)
        steps = c.num_batches // accum
        epoch_shards = EpochShards(
            self.shards,
            list(c.shard_sizes),
            epoch_order(len(self.shards), c.seed, c.epoch),
            c.allow_pipe,
            c.shard_keys,
            c.index_dir,
        )
        select = partial(
            select_image, errors=errors, with_labels=c.with_labels, num_classes=c.num_classes
        )
        aug = Augmentation(c.crop_scale, c.crop_ratio, c.hflip, c.randaug)
        augment = partial(
            train_transform, img_size=c.img_size, aug=aug, fmt=c.pixels, defer_jpeg=c.defer_jpeg
        )
        first = c.rank * c.batch_size * accum  # the rank's first stream

        def stream(group: int, s: int) -> Iterator:
            key = f"{c.seed}/{c.epoch}/{s}"
            rng = random.Random(f"samples/{key}")
            samples = stream_samples(epoch_shards, s, steps, c.shuffle_buffer, rng, select, errors)
            skip = done_before(group, c.start_batch, accum)
            return decode(samples, augment, key, errors, skip)

        # this worker's part of every micro-batch group
        mine = split(c.batch_size, num_workers, worker)
        return [
            [stream(group, first + group * c.batch_size + i) for i in mine]
            for group in range(accum)
        ]


# an epoch's start: every stream opens its shard, reaches its position and fills its shuffle
# window before its first sample. In an ``onwards`` pass the next epoch's streams do that during
# the last PRIME_BATCHES micro-batches of this one, a share after each, so no batch waits for all.
PRIME_BATCHES = 16


class _Primed:
    """Streams whose first samples are drawn ahead of time (the same samples, in the same order)."""

    def __init__(self, streams: list[list[Iterator]]):
        self.streams = streams
        self.todo = [(g, i) for g, group in enumerate(streams) for i in range(len(group))]

    def prime(self, share: float) -> None:
        """Draw the first sample of ``share`` of the streams not yet primed (all of them at 1)."""
        count = math.ceil(len(self.todo) * share)
        for g, i in self.todo[:count]:
            stream = self.streams[g][i]
            self.streams[g][i] = itertools.chain([next(stream)], stream)
        self.todo = self.todo[count:]


def _accumulation(c: StreamConfig) -> int:
    per_rank = c.batch_size * c.world_size
    per_step = c.global_batch or per_rank
    accum, rest = divmod(per_step, per_rank)
    if rest or c.num_batches % accum:
        raise ValueError(
            f"global_batch {per_step} is not batch_size {c.batch_size} x world_size {c.world_size} x "
            f"an accumulation that divides num_batches {c.num_batches}"
        )
    return accum


class _EvalStream(_Stream):
    def batches(self, worker: int, num_workers: int, errors: SkipCounter) -> Iterator[dict]:
        c = self.cfg
        # split by node, then by worker: every shard read exactly once
        mine = list(range(len(self.shards)))[c.rank :: c.world_size][worker::num_workers]
        # a labelled subset: only its samples are read (keys None: all of them)
        keys = [None] * len(self.shards) if c.shard_keys is None else c.shard_keys
        items = [{"url": self.shards[i], "keys": keys[i]} for i in mine]
        samples = shard_samples(items, errors, c.allow_pipe)
        selected = select_image(samples, errors, c.with_labels, c.num_classes)
        resize_crop = partial(eval_transform, img_size=c.img_size, fmt=c.pixels)
        images = decode(selected, resize_crop, "eval", errors)
        # islice takes a batch's samples and no more (wds.batched would decode one image ahead)
        while part := list(itertools.islice(images, c.batch_size)):
            yield collate(part, with_keys=c.with_keys)


_WORKERS: weakref.WeakSet = weakref.WeakSet()  # the worker processes our loaders started


def _kill_workers_at_exit() -> None:
    # multiprocessing's exit hook SIGTERMs daemon children and waits: our workers ignore SIGTERM,
    # so a loader still alive at exit (kept by a traceback) would hang the process. This hook is
    # registered later, so it runs first. Only our workers: another library's daemons are its own.
    # DataLoader's SIGCHLD handler would report each kill as a worker failure: at exit, nobody asks
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for worker in list(_WORKERS):
        if worker.is_alive():
            worker.kill()


atexit.register(_kill_workers_at_exit)


def _ignore_stop_signals(worker_id: int) -> None:
    # SIGTERM / SIGUSR1 reach every process of a job (SLURM, the launcher's process-tree kill):
    # the rank finishes its step and checkpoints (mpp.train.preemption), so its workers must keep
    # serving it; they exit with the rank (the DataLoader's shutdown, or its parent watchdog)
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)


class Loader:
    """Iterable of batch dicts; `skipped` sums the bad-data counts reported by every worker in
    this pass, each batch's ``skipped`` the count up to it. The workers' bad data is named here,
    each item once for the loader's life (a training run: every epoch, ``set_epoch(onwards=True)``
    or pass by pass), with this loader's running count of skips.

    ``persistent``: one DataLoader, its workers kept across passes (a training run's epochs:
    ``set_epoch`` before each), instead of new worker processes every epoch."""

    def __init__(
        self,
        dataset: IterableDataset,
        num_workers: int,
        num_batches: int | None,
        persistent: bool = False,
        key_log: Path | None = None,
    ):
        self.dataset, self.num_workers, self.num_batches = dataset, num_workers, num_batches
        # a training stream's sample keys, a line per micro-batch (data.log_keys)
        self.key_log = key_log
        self.persistent = persistent and num_workers > 0
        # a training micro-batch arrives in one part per worker, in worker order
        self.parts = max(1, num_workers) if isinstance(dataset, _TrainStream) else 1
        self._loader: DataLoader | None = None
        self._skipped: dict[int, int] = {}  # this pass's count, by worker
        self.met, self.skip_log = 0, SkipLog()  # bad data met in every pass, as it was reported

    def set_epoch(self, epoch: int, start_batch: int = 0, onwards: bool = False) -> None:
        """The next pass is ``epoch`` from its batch ``start_batch`` (a training stream);
        ``onwards``: and every epoch after it, without end (the pass's batches are the epochs'
        micro-batches end to end; ``num_batches`` per epoch)."""
        total = self.dataset.cfg.num_batches
        if not 0 <= start_batch <= total:
            raise ValueError(f"start_batch {start_batch} outside [0, num_batches={total}]")
        self.dataset.position.copy_(torch.tensor([epoch, start_batch, 0 if onwards else 1]))
        self.num_batches = None if onwards else total - start_batch

    def close(self) -> None:
        """Stop persistent workers now, through the DataLoader's own shutdown (they finish and
        exit). Not left to garbage collection: an exception's traceback can keep the loader alive
        until interpreter exit, where multiprocessing would SIGTERM workers that ignore it."""
        loader, self._loader = self._loader, None
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    @property
    def skipped(self) -> int:
        return sum(self._skipped.values())

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("an evaluation loader's length depends on the shards; iterate it")
        return self.num_batches

    def __iter__(self) -> Iterator[dict]:
        loader = self._loader
        if loader is None:
            loader = DataLoader(
                self.dataset,
                batch_size=None,  # batches are built inside the workers
                num_workers=self.num_workers,
                # parts: pinned once joined
                pin_memory=torch.cuda.is_available() and self.parts == 1,
                persistent_workers=self.persistent,
                # its own generator: DataLoader otherwise draws worker seeds from the global torch
                # RNG, and re-creating a loader on resume would shift every later mask draw
                generator=torch.Generator().manual_seed(0),
                worker_init_fn=_ignore_stop_signals,
            )
        if self.persistent:
            self._loader = loader
        self._skipped = {}
        count, parts = 0, []
        items = iter(loader)
        # DataLoader's worker processes (none in-process)
        _WORKERS.update(getattr(items, "_workers", ()))
        try:
            for item in items:
                self._skipped[item.pop("_worker")] = item.pop("_skipped")
                self._name_skips(item.pop("_skips"))
                if item.pop("_end", False):
                    continue
                parts.append(item)
                if len(parts) < self.parts:
                    continue
                batch, parts = _join(parts), []
                batch["skipped"] = self.skipped
                if self.key_log is not None and self.num_batches is not None:
                    epoch, start, _ = self.dataset.position.tolist()
                    self.log_keys(batch["key"], epoch, start + count)
                count += 1
                yield batch
        # a worker's error (bad data): its workers stop now, not at interpreter exit
        except Exception:
            if hasattr(items, "_shutdown_workers"):
                items._shutdown_workers()
            self._loader = None
            raise
        if self.num_batches is not None and count != self.num_batches:
            # unequal batch counts across ranks deadlock the next collective: fail loudly instead
            raise RuntimeError(f"training loader gave {count} batches, expected {self.num_batches}")

    def _name_skips(self, reports: list[tuple[str, str]]) -> None:
        """A worker's skips since its last batch, counted and named (the first time each is met)
        with the running count."""
        for name, message in reports:
            self.met += 1
            self.skip_log.warn(name, message, self.met)

    def log_keys(self, keys: list[str], epoch: int, batch: int) -> None:
        """One line of the key log (``data.log_keys``): an ``onwards`` pass runs ahead of the
        training, so its consumer logs each batch as it trains on it."""
        self.key_log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.key_log, "a") as f:
            f.write(json.dumps({"epoch": epoch, "batch": batch, "keys": keys}) + "\n")


def _join(parts: list[dict]) -> dict:
    """One batch from the workers' parts of it (a training micro-batch; an eval batch is one part):
    the images in one pinned tensor, the JPEGs left to the device in one ``DeferredBatch``."""
    if len(parts) == 1:
        return parts[0]
    parts = [p for p in parts if p]  # workers without a stream in this micro-batch
    sizes = [p["deferred"].size if "deferred" in p else len(p["image"]) for p in parts]
    batch = {}
    images = [p.get("image") for p in parts]
    decoded = [x for x in images if x is not None]
    if decoded:  # with every sample deferred, no image on the host at all
        dtype = torch.float32 if any(x.is_floating_point() for x in decoded) else torch.uint8
        shape = (sum(sizes), *decoded[0].shape[1:])
        out = torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())
        for x, start, n in zip(images, itertools.accumulate([0, *sizes]), sizes, strict=False):
            if x is not None:  # 8-bit parts beside float ones: [0, 1] as collate makes them
                scale = 255.0 if dtype != x.dtype else 1.0
                out[start : start + n] = x / scale if scale != 1.0 else x
        batch["image"] = out
    deferred = DeferredBatch.join([p.get("deferred") for p in parts], sizes)
    if deferred is not None:
        batch["deferred"] = deferred
    if "label" in parts[0]:
        batch["label"] = torch.cat([p["label"] for p in parts])
    if "key" in parts[0]:
        batch["key"] = [k for p in parts for k in p["key"]]
    return batch


def _validate(shards, allow_pipe: bool, rank: int, world_size: int) -> list[str]:
    shards = expand_shards(shards)
    check_shards(shards, allow_pipe=allow_pipe)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, world_size={world_size})")
    return shards


def make_train_loader(
    shards: str | list[str],
    stream: StreamConfig | None = None,
    *,
    num_workers: int = 2,
    persistent: bool = False,
    key_log: Path | None = None,
    **settings,
) -> Loader:
    """Exactly ``num_batches - start_batch`` uint8 batches for this rank of this epoch.

    ``stream``'s settings (or a fresh ``StreamConfig``) with ``settings`` replacing fields of it:
    ``make_train_loader(shards, batch_size=64, num_batches=100, img_size=224)``, or
    ``make_train_loader(shards, plan.stream, epoch=e, rank=r)``. ``persistent``: as ``Loader``'s.
    ``key_log``: a file that gets {"epoch", "batch", "keys"} for every batch (turns ``with_keys`` on).
    Batches are {"image": (B,3,H,W) uint8, "label": (B,) int64 if with_labels, "skipped": int}.
    Order and augmentation depend only on (seed, epoch, global batch, shards) and the rank's
    place in the global batch, not on the workers: with clean data, start_batch=k gives exactly
    the batches after the first k of a straight run, on any world size (``mpp.data.order``).
    ``shard_sizes`` unset: counted here (``mpp.data.census``: sizes.json, stats, cache or tar headers).
    """
    cfg = replace(stream, **settings) if stream is not None else StreamConfig(**settings)
    shards = _validate(shards, cfg.allow_pipe, cfg.rank, cfg.world_size)
    if cfg.shard_sizes is None and cfg.shard_keys is not None:  # a labelled subset's own counts
        cfg = replace(cfg, shard_sizes=tuple(len(keys) for keys in cfg.shard_keys))
    if cfg.shard_sizes is None:
        cfg = replace(cfg, shard_sizes=tuple(census(shards, cfg.allow_pipe).sizes))
    if len(cfg.shard_sizes) != len(shards):
        raise ValueError(f"{len(cfg.shard_sizes)} shard sizes for {len(shards)} shards")
    _accumulation(cfg)  # the global batch splits into this rank's micro-batches
    if key_log is not None:
        cfg = replace(cfg, with_keys=True)
    if cfg.batch_size < 1 or not 0 <= cfg.start_batch <= cfg.num_batches:
        raise ValueError(
            f"need batch_size >= 1 and 0 <= start_batch <= num_batches (batch_size={cfg.batch_size}, "
            f"start_batch={cfg.start_batch}, num_batches={cfg.num_batches})"
        )
    return Loader(
        _TrainStream(shards, cfg),
        num_workers,
        cfg.num_batches - cfg.start_batch,
        persistent,
        key_log,
    )


def make_eval_loader(
    shards: str | list[str], *, num_workers: int = 2, with_labels: bool = True, **settings
) -> Loader:
    """One exact pass over this rank's shards (split by rank, then by worker); the last batch may
    be short. ``settings``: the ``StreamConfig`` fields that apply (batch_size, img_size, rank,
    world_size, num_classes, with_keys, allow_pipe, max_consecutive_errors).

    Ranks may get different batch counts: reduce metrics after the loop, not per batch.
    """
    cfg = StreamConfig(with_labels=with_labels, **settings)
    if cfg.batch_size < 1:
        raise ValueError(f"need batch_size >= 1 (batch_size={cfg.batch_size})")
    shards = _validate(shards, cfg.allow_pipe, cfg.rank, cfg.world_size)
    return Loader(_EvalStream(shards, cfg), num_workers, None)
