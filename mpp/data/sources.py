"""Shard lists (brace patterns, folders, object-storage globs; local, http(s), s3/gs/az through
fsspec), sizes.json, and opening a shard as a byte stream (docs/ARCHITECTURE.md §3.2)."""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import urlparse

import braceexpand

log = logging.getLogger(__name__)
SIZES_FILE = "sizes.json"
HTTP_TIMEOUT_S = 60.0
# object storage through fsspec (s3fs, gcsfs, adlfs: the optional extras s3, gcs, azure)
OBJECT_SCHEMES = ("s3", "gs", "gcs", "az", "abfs", "abfss")
RETRIES, BACKOFF_S = 3, 0.5  # a transient read error: retried after 0.5, 1, 2 s


def expand_shards(spec: str | Iterable[str]) -> list[str]:
    """`train-{000000..000127}.tar`, comma-separated specs, lists, or a directory of `.tar` files."""
    parts = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    shards: list[str] = []
    for part in parts:
        for piece in _split_top_level_commas(os.fspath(part)):
            if os.path.isdir(piece):
                shards += sorted(
                    os.path.join(piece, f) for f in os.listdir(piece) if f.endswith(".tar")
                )
            elif _scheme(piece) in OBJECT_SCHEMES:
                for url in braceexpand.braceexpand(piece):
                    shards += _list_objects(url)
            else:
                shards += list(braceexpand.braceexpand(piece))
    if not shards:
        raise ValueError(f"no shards in {spec!r}")
    return shards


def _split_top_level_commas(spec: str) -> list[str]:
    # Commas inside braces belong to brace expansion ({a,b}); only the outer ones separate specs.
    pieces, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        depth += (ch == "{") - (ch == "}")
        if ch == "," and depth == 0:
            pieces.append(spec[start:i])
            start = i + 1
    pieces.append(spec[start:])
    return [p.strip() for p in pieces if p.strip()]


def _list_objects(url: str) -> list[str]:
    """An object URL as it is; a glob pattern (``*``, ``?``, ``[``) or a folder (ending in ``/``)
    listed through fsspec: the ``.tar`` objects, sorted, with their scheme."""
    if not url.endswith("/") and not any(ch in url for ch in "*?["):
        return [url]
    import fsspec

    scheme = _scheme(url)
    fs = fsspec.filesystem(scheme)
    pattern = url + "*.tar" if url.endswith("/") else url
    return sorted(f"{scheme}://{path}" for path in fs.glob(pattern) if path.endswith(".tar"))


def _scheme(url: str) -> str:
    scheme = urlparse(url).scheme
    return "" if len(scheme) <= 1 else scheme  # "C:\\x.tar" parses as scheme "c"


def check_shards(shards: list[str], *, allow_pipe: bool = False) -> None:
    """Fail early: refuse `pipe:` (it runs a shell command) unless allowed, name missing local files."""
    missing = []
    for url in shards:
        scheme = _scheme(url)
        if scheme == "pipe":
            if not allow_pipe:
                raise ValueError(
                    f"refusing shard {url!r}: 'pipe:' runs a shell command; pass allow_pipe=True "
                    "if the shard list is trusted"
                )
        elif scheme not in ("", "file", "http", "https", *OBJECT_SCHEMES):
            raise ValueError(
                f"shard {url!r}: unsupported scheme {scheme!r} (local path, file:, http(s):, "
                f"{', '.join(f'{s}:' for s in OBJECT_SCHEMES)}, pipe:)"
            )
        elif scheme in ("", "file") and not os.path.isfile(_local_path(url)):
            missing.append(url)
    if missing:
        shown = ", ".join(missing[:10]) + (
            f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        )
        raise FileNotFoundError(f"{len(missing)} shard file(s) not found: {shown}")


def _local_path(url: str) -> str:
    return urllib.request.url2pathname(urlparse(url).path) if url.startswith("file:") else url


def open_shard(
    url: str,
    *,
    allow_pipe: bool = False,
    on_retry: Callable[[str, Exception], None] | None = None,
    start: int = 0,
    end: int | None = None,
):
    """A readable binary stream for one shard (local file, http(s), object storage or, if
    allowed, a `pipe:`), a ``.tar.gz`` / ``.tgz`` one decompressed; an object's transient open
    error is retried (``on_retry`` hears each). ``start``, ``end``: its bytes [start, end) alone
    (an uncompressed local file, object or URL; ``end`` None: to its end): a seek on a local file,
    a ranged read of an object or URL, nothing before ``start`` read (``mpp.data.shard_index``)."""
    scheme = _scheme(url)
    compressed = url.endswith((".tar.gz", ".tgz"))
    if (start or end is not None) and (scheme == "pipe" or compressed):
        raise ValueError(f"{url}: a pipe or a compressed shard is read whole")
    if scheme in ("", "file"):
        stream = open(_local_path(url), "rb")
        stream.seek(start)
    elif scheme in OBJECT_SCHEMES:
        stream = _open_object(url, on_retry, start, end)
    elif scheme in ("http", "https"):
        stream = _open_http(url, start, end)
    elif scheme == "pipe" and allow_pipe:
        import webdataset as wds

        stream = wds.gopen(url)
    else:
        raise ValueError(f"refusing to open shard {url!r}")
    return gzip.GzipFile(fileobj=stream) if compressed else stream


def _open_http(url: str, start: int = 0, end: int | None = None):
    """A URL's bytes from ``start`` (to ``end``): a ``Range`` request, the bytes before ``start``
    read through where the server sends the whole file instead."""
    # urllib, not webdataset's curl pipe: curl retries an unreachable host for a minute and
    # reports nothing useful; urlopen fails at once with the reason.
    ranged = start > 0 or end is not None
    last = "" if end is None else end - 1
    headers = {"Range": f"bytes={start}-{last}"} if ranged else {}
    stream = urllib.request.urlopen(
        urllib.request.Request(url, headers=headers), timeout=HTTP_TIMEOUT_S
    )
    if ranged and stream.status != 206:  # no range support: read through, as without an index
        while start > 0 and (n := len(stream.read(min(start, CHUNK)))):
            start -= n
    return stream


def shard_bytes(stream) -> int | None:
    """The size of the whole shard behind an open stream (``open_shard``'s, any range of it);
    None where the stream cannot say (a pipe, a compressed shard)."""
    if isinstance(stream, ObjectRange):
        return stream.size
    if isinstance(stream, io.BufferedReader):
        return os.fstat(stream.fileno()).st_size
    headers = getattr(stream, "headers", None)  # http: "bytes a-b/size", or the whole length
    if headers is not None and (whole := headers.get("Content-Range", "").rpartition("/")[2]):
        return int(whole) if whole.isdigit() else None
    length = headers.get("Content-Length") if headers is not None else None
    return int(length) if length and getattr(stream, "status", 200) == 200 else None


# An object is read in ranged requests of CHUNK bytes, none past the range's end: fsspec's own
# files read ahead in blocks (s3fs: 50 MB), so a stream that stops inside a shard had read the
# rest of it, and often the whole of a smaller one. 4 MB is ~36 ImageNet JPEGs a request.
CHUNK = 4 << 20


class ObjectRange:
    """The bytes [start, end) of an open fsspec file that fetches exactly what is read (no
    cache), CHUNK bytes a request (more for a larger read), nothing past ``end``."""

    def __init__(self, file, start: int = 0, end: int | None = None):
        self.file, self.size = file, file.size
        self.position, self.end = start, self.size if end is None else min(end, self.size)
        self.buffer = memoryview(b"")

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = len(self.buffer) + self.end - self.position
        parts = []
        while n > 0:
            if not self.buffer:
                want = min(max(n, CHUNK), self.end - self.position)
                if want <= 0:
                    break
                self.file.seek(self.position)
                self.buffer = memoryview(self.file.read(want))
                self.position += len(self.buffer)
                if not self.buffer:
                    break
            part = self.buffer[:n]
            parts.append(part)
            self.buffer, n = self.buffer[len(part) :], n - len(part)
        return b"".join(parts)

    def close(self) -> None:
        self.buffer = memoryview(b"")
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open_object(
    url: str,
    on_retry: Callable[[str, Exception], None] | None = None,
    start: int = 0,
    end: int | None = None,
) -> ObjectRange:
    """An object through fsspec (``ObjectRange``), retried RETRIES times with doubling backoff on
    an error that may pass; a missing object or a refusal (FileNotFoundError, PermissionError)
    is raised at once."""
    import fsspec

    for attempt in range(RETRIES + 1):
        try:
            fs, path = fsspec.core.url_to_fs(url)
            return ObjectRange(fs.open(path, "rb", cache_type="none"), start, end)
        except (FileNotFoundError, PermissionError, ImportError):
            raise
        except Exception as exn:  # noqa: BLE001  connection resets, throttling, timeouts
            if attempt == RETRIES:
                raise
            if on_retry is not None:
                on_retry(url, exn)
            log.warning("retrying %s in %.1f s after %r", url, BACKOFF_S * 2**attempt, exn)
            time.sleep(BACKOFF_S * 2**attempt)
    raise AssertionError("unreachable")


def object_exists(url: str) -> bool:
    """Whether an object is there; a bad bucket, credential or network raises (one line)."""
    import fsspec

    return fsspec.filesystem(_scheme(url)).exists(url)


def _read_json(url: str) -> dict | None:
    """A JSON file beside the shards (local, http(s) or an object), opened as a shard is; None
    when it is not there or not JSON."""
    remote = _scheme(url) in (*OBJECT_SCHEMES, "http", "https")
    try:  # any other path is a local one, even with a colon in it (runs/exp:1/...)
        with open_shard(url) if remote else open(_local_path(url), "rb") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_text(path: Path, text: str) -> None:
    """Through a temporary beside ``path`` and a rename: a reader never sees half a file (the
    process id in the temporary's name: ranks of other jobs may write at once)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_json(path: Path, obj: dict) -> None:
    _write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def _sizes_url(shard: str) -> str:
    return shard.rsplit("/", 1)[0] + "/" + SIZES_FILE if "/" in shard else SIZES_FILE


def read_sizes(shards: str | list[str]) -> dict | None:
    """Merge the sizes.json files beside `shards`: {"shards": {name: count}, "class_names": [...]}.

    None when no shard has a sizes.json beside it (shards written by other tools).
    """
    shards = expand_shards(shards)
    merged: dict = {"shards": {}, "class_names": None}
    found = False
    for url in dict.fromkeys(_sizes_url(s) for s in shards):
        sizes = _read_json(url)
        if sizes is None:
            continue
        found = True
        merged["shards"].update(sizes.get("shards", {}))
        merged["class_names"] = merged["class_names"] or sizes.get("class_names")
    return merged if found else None
