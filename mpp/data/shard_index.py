"""The member index ``NAME.tar.idx``: where each sample of a shard starts, so that a stream reads
only its own samples' bytes (docs/ARCHITECTURE.md §3.2; docs/data.md, "Starting anywhere in a
shard"). Per sample with an image: the offset of its first header block (a pax or GNU long-name
header before it included) and its key; then the shard's size and a local shard's mtime."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .sources import OBJECT_SCHEMES, _local_path, _read_json, _scheme, _write_text

log = logging.getLogger(__name__)
SUFFIX = ".idx"  # NAME.tar.idx beside NAME.tar
RUN_DIR = "shard_index"  # in the run directory: the indexes no shard folder could keep


def run_index_dir(run_dir: str | os.PathLike | None) -> str | None:
    """A run's folder of the member indexes no shard folder could keep (the streams' ``index_dir``)."""
    return None if run_dir is None else str(Path(run_dir) / RUN_DIR)


@dataclass(frozen=True)
class MemberIndex:
    offsets: tuple[int, ...]  # per sample with an image: where its first header block starts
    keys: tuple[str, ...]  # its key (a remote shard's check that an offset is still that sample)
    bytes: int  # the shard's size: where the last sample's bytes end
    mtime_ns: int | None = None  # a local shard's, when indexed

    def __len__(self) -> int:
        return len(self.offsets)

    def span(self, first: int, stop: int) -> tuple[int, int]:
        """The bytes [start, end) of samples [first, stop): to the next sample's first header."""
        return self.offsets[first], self.offsets[stop] if stop < len(self) else self.bytes

    def to_json(self) -> str:
        record = {"bytes": self.bytes, "mtime_ns": self.mtime_ns, "offsets": self.offsets}
        return json.dumps({**record, "keys": self.keys}, separators=(",", ":"))

    @classmethod
    def from_json(cls, record: dict) -> MemberIndex:
        offsets, keys = tuple(record["offsets"]), tuple(record["keys"])
        if len(offsets) != len(keys):
            raise ValueError(f"{len(offsets)} offsets for {len(keys)} keys")
        return cls(offsets, keys, int(record["bytes"]), record.get("mtime_ns"))


def indexable(url: str) -> bool:
    """A shard whose bytes can be read from anywhere: an uncompressed tar, local or remote."""
    scheme = _scheme(url)
    supported = scheme in ("", "file", "http", "https", *OBJECT_SCHEMES)
    return supported and not url.endswith((".tar.gz", ".tgz"))


def remote(url: str) -> bool:
    return _scheme(url) in ("http", "https", *OBJECT_SCHEMES)


def index_url(url: str, index_dir: str | os.PathLike | None = None) -> str:
    """Where a shard's index is: beside it, or in ``index_dir`` (``RUN/shard_index``) named by the
    shard's name and its URL's hash (two folders may hold a ``train-000000.tar`` each)."""
    if index_dir is None:
        return url + SUFFIX
    tag = hashlib.sha1(url.encode()).hexdigest()[:12]
    return str(Path(index_dir) / f"{url.rsplit('/', 1)[-1]}.{tag}{SUFFIX}")


def save(url: str, index: MemberIndex, index_dir: str | os.PathLike | None = None) -> None:
    """Write a shard's index beside it (a local folder or a bucket) or into ``index_dir``;
    OSError (PermissionError, ...) when that place cannot be written."""
    target = index_url(url, index_dir)
    _read.cache_clear()  # this process may have found none before
    if index_dir is None and _scheme(url) in OBJECT_SCHEMES:
        import fsspec

        fs, path = fsspec.core.url_to_fs(target)
        fs.pipe_file(path, index.to_json().encode())
    elif index_dir is None and remote(url):
        raise PermissionError(f"cannot write beside {url}")
    else:
        path = Path(_local_path(target))
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_text(path, index.to_json())


def load(url: str, index_dir: str | None = None) -> MemberIndex | None:
    """A shard's index (from ``index_dir``, else beside it), None when there is none or a local
    shard's size or mtime changed since it was indexed."""
    if not indexable(url) or url in _stale:
        return None
    index = _read(url, index_dir)
    if index is not None and not remote(url):
        try:
            st = os.stat(_local_path(url))
        except OSError:
            return None
        if (st.st_size, st.st_mtime_ns) != (index.bytes, index.mtime_ns):
            # one line a process: a copy that lost its mtimes would name every shard
            _warn_once(
                "local", f"{url} (and any other) changed since it was indexed (its size or mtime)"
            )
            return None
    return index


# a worker reads the indexes of the shards its streams open: each once (the few its streams start
# in each epoch are kept; ImageNet's whole set would be ~2.5 M Python objects per worker)
@functools.lru_cache(maxsize=256)
def _read(url: str, index_dir: str | None) -> MemberIndex | None:
    for where in ([index_dir] if index_dir else []) + [None]:
        record = _read_json(index_url(url, where))
        if record is not None:
            try:
                return MemberIndex.from_json(record)
            except (KeyError, TypeError, ValueError) as exn:
                _warn_once(url, f"{url}: {index_url(url, where)} is not an index ({exn!r})")
    return None


_warned: set[str] = set()  # per process: a shard's index problem is one line, not one a stream
_stale: set[str] = set()


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning(
            "%s: read without its member index, as it was before one (`mpp shards --index` "
            "writes it again)",
            message,
        )


def stale(url: str, why: str) -> None:
    """An index that does not match its shard (``shard_samples``' checks): not used again."""
    _warn_once(url, f"{url}: its index does not match it ({why}: rewritten since it was indexed?)")
    _stale.add(url)


def present(shards: Iterable[str], index_dir: str | os.PathLike | None = None) -> set[str]:
    """The shards that have an index file, beside them or in ``index_dir`` (an object folder
    listed once; for an http(s) folder its first shard's index is asked for, the rest taken to
    be alike)."""
    found, listed, asked = set(), {}, {}
    for url in shards:
        if index_dir is not None and os.path.isfile(index_url(url, index_dir)):
            found.add(url)
            continue
        folder = url.rsplit("/", 1)[0]
        if _scheme(url) in OBJECT_SCHEMES:
            if folder not in listed:
                listed[folder] = _object_names(folder)
            has = url.rsplit("/", 1)[-1] + SUFFIX in listed[folder]
        elif remote(url):
            if folder not in asked:
                asked[folder] = _read_json(index_url(url)) is not None
            has = asked[folder]
        else:
            has = os.path.isfile(_local_path(index_url(url)))
        if has:
            found.add(url)
    return found


def _object_names(folder: str) -> set[str]:
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(folder)
        return {p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
    except OSError:
        return set()
