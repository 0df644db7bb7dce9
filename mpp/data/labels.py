"""Few labels: a labelled subset of the training shards, chosen from their label index by the shards
and the seed alone, or named by a key file (docs/ARCHITECTURE.md §3.7, §4.7)."""

from __future__ import annotations

import logging
import random
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from mpp.parallel.distributed import split_scan

from .sources import _write_text, open_shard
from .tario import split_name, tar_samples

log = logging.getLogger(__name__)
KEY_FILE = "label_keys.txt"  # in the run directory


@dataclass(frozen=True)
class LabelIndex:
    """Every labelled sample with an image, per shard: (key, label) in the shard's order."""

    shards: list[str]
    samples: list[list[tuple[str, int]]]

    @property
    def total(self) -> int:
        return sum(len(s) for s in self.samples)

    def classes(self) -> dict[int, list[tuple[int, str]]]:
        """label -> [(shard index, key)], sorted: the same on every rank."""
        by_class: dict[int, list[tuple[int, str]]] = defaultdict(list)
        for i, samples in enumerate(self.samples):
            for key, label in samples:
                by_class[label].append((i, key))
        return {
            c: sorted(v, key=lambda ik: (self.shards[ik[0]], ik[1])) for c, v in by_class.items()
        }


def shard_labels(url: str, allow_pipe: bool = False) -> list[tuple[str, int]]:
    """(key, label) of each sample of one shard that has an image and a readable integer ``.cls``;
    image bytes are passed over (seeks on a local file). An unreadable shard gives what it held
    before the cut (the reader keeps the same samples)."""
    out: list[tuple[str, int]] = []
    try:
        stream = open_shard(url, allow_pipe=allow_pipe)
    except Exception as exn:
        log.warning("label index: cannot open %s: %r", url, exn)
        return out
    try:
        for key, sample in tar_samples(stream, images_only=True, members={"cls"}):
            try:
                out.append((key, int(sample["cls"])))
            except (KeyError, TypeError, ValueError):
                continue  # no label: not in a labelled subset (the stream would skip it too)
    except Exception as exn:  # truncation: the whole samples before the cut are kept
        log.warning("label index: %s ends early: %r", url, exn)
    finally:
        stream.close()
    return out


def label_index(shards: list[str], allow_pipe: bool = False) -> LabelIndex:
    """Every shard's labelled samples; a collective under a process group (the shards read split
    across the ranks, the result gathered on every rank)."""
    shards = list(shards)
    return LabelIndex(shards, split_scan(shards, lambda s: shard_labels(s, allow_pipe)))


@dataclass(frozen=True)
class LabelledSubset:
    """The chosen samples: the shards that hold any, and per shard their keys."""

    shards: list[str]
    keys: tuple[frozenset[str], ...]
    per_class: dict[int, int]
    source: str  # how it was chosen, for the log and results.json
    ambiguous: frozenset[str] = frozenset()  # keys that more than one training shard holds

    @property
    def sizes(self) -> list[int]:
        return [len(k) for k in self.keys]

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def lines(self) -> list[str]:
        """The key file's lines: each key, with its shard's file name where another training
        shard holds the same key."""
        return [
            f"{_name(shard)}#{key}" if key in self.ambiguous else key
            for shard, keys in zip(self.shards, self.keys, strict=True)
            for key in sorted(keys)
        ]

    def write(self, path: Path) -> None:
        _write_text(path, "".join(f"{line}\n" for line in self.lines()))

    def summary(self) -> str:
        counts = sorted(self.per_class.values())
        spread = f"{counts[0]}" if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}"
        return (
            f"{self.total:,} labelled samples ({spread} per class, {len(self.per_class)} classes) "
            f"in {len(self.shards)} shards: {self.source}"
        )


def _name(url: str) -> str:
    return url.rsplit("/", 1)[-1]


def _subset(index: LabelIndex, chosen: Iterable[tuple[int, str]], source: str) -> LabelledSubset:
    by_shard: dict[int, set[str]] = defaultdict(set)
    for i, key in chosen:
        by_shard[i].add(key)
    labels = {(i, k): c for i, samples in enumerate(index.samples) for k, c in samples}
    per_class = Counter(labels[i, key] for i, keys in by_shard.items() for key in keys)
    order = sorted(by_shard)
    seen = Counter(key for samples in index.samples for key in {k for k, _ in samples})
    return LabelledSubset(
        [index.shards[i] for i in order],
        tuple(frozenset(by_shard[i]) for i in order),
        dict(sorted(per_class.items())),
        source,
        frozenset(k for k, n in seen.items() if n > 1),
    )


def choose(
    index: LabelIndex,
    per_class: int | None = None,
    fraction: float | None = None,
    seed: int = 0,
    key: str | None = None,
) -> tuple[LabelledSubset, list[str]]:
    """K samples of every class (``per_class``, or K = round(``fraction`` N / C), at least 1),
    seeded; (the subset, a warning for each class with fewer than K, naming it). ``key``: the
    setting's name in the subset's description (default ``labels_per_class`` / ``label_fraction``)."""
    classes = index.classes()
    if not classes:
        raise ValueError("the shards hold no labelled sample (no .cls member)")
    if per_class is None:
        per_class = max(1, round(fraction * index.total / len(classes)))
        source = f"{key or 'label_fraction'}={fraction} -> {per_class} per class (seed {seed})"
    else:
        source = f"{key or 'labels_per_class'}={per_class} (seed {seed})"
    chosen, short = [], []
    for label, members in sorted(classes.items()):
        members = list(members)
        random.Random(f"labels/{seed}/{label}").shuffle(members)
        chosen += members[:per_class]
        if len(members) < per_class:
            short.append(
                f"class {label} has {len(members)} labelled samples, fewer than {per_class}"
            )
    return _subset(index, chosen, source), short


def from_key_file(index: LabelIndex, path: str | Path) -> LabelledSubset:
    """The samples a key file names; KeyError naming the first key that no shard holds, and the file."""
    where: dict[str, list[int]] = defaultdict(list)
    for i, samples in enumerate(index.samples):
        for key, _ in samples:
            where[key].append(i)
    by_name = {_name(s): i for i, s in enumerate(index.shards)}
    chosen = []
    for n, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        shard, _, key = line.rpartition("#")
        if key not in where and split_name(key)[0] in where:  # "n01440764_10026.JPEG"
            key = split_name(key)[0]
        hits = [i for i in where.get(key, []) if not shard or by_name.get(shard) == i]
        if not hits:
            raise KeyError(
                f"{path}:{n}: key {line!r} is not a labelled sample of the training shards"
            )
        chosen += [(i, key) for i in hits]
    if not chosen:
        raise KeyError(f"{path}: no keys")
    return _subset(index, chosen, f"label_keys={path}")
