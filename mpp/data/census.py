"""How many samples each training shard holds, counted before training, never assumed; the header
pass also writes each shard's member index (docs/ARCHITECTURE.md §3.2). What the files say is
read by rank 0 alone, so every rank plans with the same numbers."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from mpp.parallel.distributed import from_rank0, rank_world, split_scan

from . import shard_index
from .shard_index import MemberIndex
from .sources import (
    OBJECT_SCHEMES,
    _local_path,
    _read_json,
    _scheme,
    _sizes_url,
    _write_json,
    open_shard,
    shard_bytes,
)
from .tario import tar_samples
from .transforms import IMAGE_KEYS

log = logging.getLogger(__name__)
CACHE_FILE = ".mpp_counts.json"  # beside the shards
RUN_CACHE_FILE = "shard_counts.json"  # in the run directory, when the shards' folder is read-only


@dataclass
class ShardCount:
    samples: int  # samples with an image: the shard's positions in the training order
    source: str  # "sizes.json", "img2dataset stats", "cache" or "tar headers"
    duplicate_keys: int = 0  # samples whose key an earlier sample of the shard has
    without_image: int = 0  # samples with no image member (not trained)
    problem: str | None = None  # why the shard ends early (truncated, corrupt, unreadable)
    # where its samples start (a clean shard's header pass; not in the count caches)
    index: MemberIndex | None = field(default=None, repr=False, compare=False)

    def record(self) -> dict:
        """What the count caches keep of it."""
        return {k: v for k, v in vars(self).items() if k not in ("source", "index")}


@dataclass
class Census:
    shards: list[str]
    counts: list[ShardCount]
    scan_s: float = 0.0  # wall time of the header scan (all ranks in parallel)
    to_run_cache: dict = field(default_factory=dict)  # url -> count, for RUN/shard_counts.json
    index_to_run: dict = field(default_factory=dict)  # url -> MemberIndex, for RUN/shard_index

    @property
    def sizes(self) -> list[int]:
        return [c.samples for c in self.counts]

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def summary(self) -> str:
        """One paragraph: the total, where the counts came from, and every shard that is not clean."""
        sources = Counter(c.source for c in self.counts)
        made = ", ".join(f"{n} from {s}" for s, n in sources.items())
        if self.scan_s:
            made += f" ({self.scan_s:.1f} s)"
        lines = [f"{self.total:,} samples in {len(self.shards)} shards ({made})"]
        pairs = list(zip(self.shards, self.counts, strict=True))
        named = {  # the shards that are not clean, five of each kind shown
            "empty": [s for s, c in pairs if c.samples == 0 and not c.problem],
            "ending early": [f"{s} ({c.problem})" for s, c in pairs if c.problem],
            "keys held twice": [f"{c.duplicate_keys} in {s}" for s, c in pairs if c.duplicate_keys],
            "samples without an image, not trained": [
                f"{c.without_image} in {s}" for s, c in pairs if c.without_image
            ],
        }
        for what, items in named.items():
            if items:
                more = " ..." if len(items) > 5 else ""
                lines.append(f"{what}: {len(items)} ({', '.join(items[:5])}{more})")
        return "; ".join(lines)

    def write_run_cache(self, run_dir: Path) -> None:
        """The counts and indexes no shard folder could keep, into ``RUN/shard_counts.json`` and
        ``RUN/shard_index/`` (rank 0)."""
        for url, index in self.index_to_run.items():
            shard_index.save(url, index, shard_index.run_index_dir(run_dir))
        if self.to_run_cache:
            write_cache(Path(run_dir) / RUN_CACHE_FILE, self.to_run_cache)


def scan_shard(url: str, allow_pipe: bool = False) -> ShardCount:
    """Count one shard's samples from its tar headers alone (a local file is seeked through) and,
    for a clean one, index them: each sample with an image's offset and key."""
    keys: set[str] = set()
    count = ShardCount(0, "tar headers")
    offsets, image_keys, size = [], [], None
    try:
        stream = open_shard(url, allow_pipe=allow_pipe)
    except Exception as exn:
        count.problem = f"cannot open: {exn!r}"
        return count
    try:
        size = shard_bytes(stream)
        for key, sample, offset in tar_samples(stream, headers_only=True, offsets=True):
            if any(ext in sample for ext in IMAGE_KEYS):
                count.samples += 1
                offsets.append(offset)
                image_keys.append(key)
            else:
                count.without_image += 1
            count.duplicate_keys += key in keys
            keys.add(key)
    except Exception as exn:  # the reader stops at the same place and keeps the same samples
        count.problem = str(exn) or repr(exn)
    finally:
        stream.close()
    if count.problem is None and size is not None and shard_index.indexable(url):
        mtime = (_stat(url) or {}).get("mtime_ns")
        count.index = MemberIndex(tuple(offsets), tuple(image_keys), size, mtime)
    return count


def census(
    shards: list[str], allow_pipe: bool = False, run_dir: Path | None = None, index: bool = False
) -> Census:
    """Every shard's count (docs/ARCHITECTURE.md §3.2). A collective when a process group is up:
    every rank calls it with the same ``shards``, rank 0's list and files decide. ``index``: every
    shard indexed that can be (``mpp shards --index``), the ones counted from the files too."""
    rank = rank_world()[0]
    known, indexed = None, None
    if rank == 0:  # the remote shards' indexes (their absence costs)
        known = known_counts(shards, run_dir)
        wanted = [s for s in shards if shard_index.indexable(s) and shard_index.remote(s)]
        indexed = shard_index.present(wanted, shard_index.run_index_dir(run_dir))
    shards, known, indexed = from_rank0((shards, known, indexed))
    # asked to index: every local shard again (a seek pass), the remote ones without an index
    todo = [
        s
        for s in shards
        if s not in known
        or (index and shard_index.indexable(s) and not (shard_index.remote(s) and s in indexed))
    ]
    t0 = time.perf_counter()
    if todo and rank == 0:
        log.info(
            "counting the samples of %d shard(s) from their tar headers (once: the counts are cached)",
            len(todo),
        )
    scanned = dict(zip(todo, split_scan(todo, lambda s: scan_shard(s, allow_pipe)), strict=True))
    result = Census(
        shards,
        [known.get(s) or scanned[s] for s in shards],
        time.perf_counter() - t0 if todo else 0.0,
    )
    if rank == 0 and scanned:
        result.to_run_cache = _save_beside_shards(scanned)
        result.index_to_run = _save_indexes(scanned, into_buckets=index)
    if rank == 0 and not index:  # asked to index, the caller says what it could not
        kept = set(indexed) | {s for s, c in scanned.items() if c.index is not None}
        if run_dir is None:  # nowhere for the run directory's share
            kept -= set(result.index_to_run)
        unindexed = [s for s in shards if shard_index.remote(s) and s not in kept]
        if unindexed:
            log.warning("data: %s", _unindexed(unindexed, result))
    return result


def _unindexed(shards: list[str], counted: Census) -> str:
    """The one line that says what remote shards without a member index cost, and the remedy."""
    sizes = dict(zip(counted.shards, counted.sizes, strict=True))
    per_shard = round(sum(sizes[s] for s in shards) / len(shards))
    folder = shards[0].rsplit("/", 1)[0] + "/"
    spec = f"'{folder}'" if _scheme(folder) in OBJECT_SCHEMES else "SHARDS"
    shown = ", ".join(shards[:3]) + (" ..." if len(shards) > 3 else "")
    return (
        f"{len(shards)} of {len(counted.shards)} shards have no member index ({shown}): each of "
        f"the B streams of a global batch that starts inside one reads it from its start, about "
        f"B x {per_shard // 2} samples ({per_shard}-sample shards: B/2 shards' bytes) more an "
        f"epoch; index them once with `mpp shards --index {spec}` (with --run-dir RUN where "
        "their folder cannot be written)"
    )


def known_counts(shards: list[str], run_dir: Path | None = None) -> dict[str, ShardCount]:
    """The counts the files already hold: sizes.json, img2dataset's stats, the count caches
    (docs/ARCHITECTURE.md §3.2)."""
    known: dict[str, ShardCount] = {}
    listed = {
        url: (_read_json(url) or {}).get("shards", {})
        for url in dict.fromkeys(map(_sizes_url, shards))
    }
    caches: dict[Path, dict] = {}
    for url in shards:
        name = url.rsplit("/", 1)[-1]
        if (n := listed[_sizes_url(url)].get(name)) is not None:
            known[url] = ShardCount(int(n), "sizes.json")
        elif (stats := _stats(url)) is not None:
            known[url] = ShardCount(stats, "img2dataset stats")
        elif (hit := _cached(url, run_dir, caches)) is not None:
            known[url] = ShardCount(**hit, source="cache")
    return known


def _stats(url: str) -> int | None:
    base = url[: -len(".tar")] if url.endswith(".tar") else None
    stats = _read_json(f"{base}_stats.json") if base else None
    successes = (stats or {}).get("successes")
    return int(successes) if isinstance(successes, int) else None


def _stat(url: str) -> dict | None:
    """A local shard's identity for the cache (size and mtime); None for remote shards."""
    if _scheme(url) not in ("", "file"):
        return None
    try:
        st = os.stat(_local_path(url))
    except OSError:
        return None
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def _cached(url: str, run_dir: Path | None, caches: dict[Path, dict]) -> dict | None:
    """The first valid count of ``url`` in its count caches (keyed by name beside the shard, by
    URL in the run directory); ``caches``: the files read so far."""
    for path in cache_places(url, CACHE_FILE, run_dir, RUN_CACHE_FILE):
        if path not in caches:
            caches[path] = read_cache(path)
        key = os.path.basename(url) if path.name == CACHE_FILE else url
        if (hit := _valid(caches[path].get(key), url)) is not None:
            return hit
    return None


def _valid(hit: dict | None, url: str) -> dict | None:
    """A cached record's counts, unless the shard changed since it was counted (size, mtime)."""
    if not hit or ("bytes" in hit and any(hit.get(k) != v for k, v in (_stat(url) or {}).items())):
        return None
    fields = ShardCount.__dataclass_fields__
    return {k: v for k, v in hit.items() if k in fields and k not in ("source", "index")}


def _save_beside_shards(scanned: dict[str, ShardCount]) -> dict:
    """Cache the scanned counts in each shard folder that can be written; the rest are returned
    (url -> record) for the run directory's cache."""
    by_file: dict[Path, dict[str, dict]] = {}
    rest = {}
    for url, count in scanned.items():
        record = {**count.record(), **(_stat(url) or {})}
        beside = cache_places(url, CACHE_FILE)
        (by_file.setdefault(beside[0], {}) if beside else rest)[url] = record
    for path, records in by_file.items():
        if not write_cache(path, {os.path.basename(u): r for u, r in records.items()}):
            rest.update(records)  # a read-only or full folder: the run directory keeps them
    return rest


def cache_places(
    url: str, name: str, run_dir: Path | None = None, run_name: str = ""
) -> list[Path]:
    """Where a cache of facts about the shard ``url`` lives, in the order read and written:
    ``name`` in its folder (a local shard), then ``run_name`` in the run directory. The shard
    counts' and the pixel statistics' (``mpp.data.stats``)."""
    beside = [Path(os.path.dirname(_local_path(url)) or ".") / name] if _stat(url) else []
    return beside + ([Path(run_dir) / run_name] if run_dir else [])


def read_cache(path: Path) -> dict:
    """A cache's entries ({} when it is not there or not JSON; a statistics cache written before
    the entries were nested under "shards": its top level)."""
    data = _read_json(str(path)) or {}
    return data.get("shards", data)


def write_cache(path: Path, entries: dict) -> bool:
    """``entries`` merged into the cache ``path``; False where its folder cannot take them."""
    try:
        _write_json(path, {"shards": {**read_cache(path), **entries}})
    except OSError:  # a full or read-only filesystem
        return False
    return True


def _save_indexes(scanned: dict[str, ShardCount], into_buckets: bool = False) -> dict:
    """Write each scanned shard's index beside it where its folder can be written (a bucket only
    ``into_buckets``); the rest are returned (url -> index) for ``RUN/shard_index``."""
    rest = {}
    for url, count in scanned.items():
        if count.index is None:
            continue
        local = _stat(url) is not None
        try:
            if not (local or (into_buckets and _scheme(url) in OBJECT_SCHEMES)):
                raise PermissionError("the census writes into a bucket only when asked")
            shard_index.save(url, count.index)
        except OSError:  # a read-only folder or bucket: the run directory keeps it
            rest[url] = count.index
    return rest
