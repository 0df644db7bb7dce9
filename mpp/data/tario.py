"""Reading tar shards into samples, with exact accounting of truncation; not ``tarfile``, which ends
silently at a cut inside a header (docs/ARCHITECTURE.md §3.2)."""

from __future__ import annotations

import io
from collections.abc import Callable, Collection, Generator, Iterator

from . import shard_index
from .errors import SkipCounter
from .sources import open_shard, shard_bytes
from .transforms import IMAGE_KEYS

BLOCK = 512


class TarError(Exception):
    def __init__(self, message: str, member: str | None = None):
        super().__init__(message)
        self.member = member  # the file being read at the cut, when its header was whole


def _read_exact(stream, n: int) -> bytes:
    data = stream.read(n)
    while 0 < len(data) < n:  # sockets and pipes may return short reads before the end
        more = stream.read(n - len(data))
        if not more:
            break
        data += more
    return data


def _number(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for sizes past 8 GiB
        return int.from_bytes(field[1:], "big")
    return int(field.replace(b"\0", b" ").strip() or b"0", 8)


def _pax_records(data: bytes) -> dict[str, str]:
    records, pos = {}, 0
    while pos < len(data) and data[pos : pos + 1] != b"\0":
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        records[key.decode()] = value.decode("utf-8", "replace")
        pos += length
    return records


def _skip(stream, n: int) -> bool:
    """Move past ``n`` bytes without reading them when the stream can seek; False if it ended."""
    if n and isinstance(stream, io.BufferedReader):  # a local file (not gzip, http or a pipe)
        here = stream.tell()
        stream.seek(0, 2)
        end = stream.seek(min(here + n, stream.tell()))
        return end - here == n
    return len(_read_exact(stream, n)) == n


# what ``read_tar`` does with a member, as a rule (``Rule``) decides from its name
READ, MARK, DROP = "read", "mark", "drop"  # its bytes; (name, None); nothing at all
Rule = Callable[[str], str]


def read_tar(
    stream, rule: Rule | None = None, start: int = 0, end: int | None = None, offsets: bool = False
) -> Iterator[tuple]:
    """(name, bytes) of each regular file in an uncompressed tar stream (ustar, GNU, pax names).
    ``rule(name)``: READ (the default), MARK (the data passed over, a seek when the stream can,
    and (name, None) yielded) or DROP (passed over, nothing yielded): resuming inside a shard or
    reading a subset of its samples reads only the headers of the rest. A ranged read: the
    stream is at byte ``start`` of the tar and ends cleanly at byte ``end``, a member boundary
    (``mpp.data.shard_index``). ``offsets``: (name, bytes, offset), the offset where the member's
    first header block starts (a pax or GNU long-name header before it included)."""
    pax: dict[str, str] = {}
    long_name = None
    position = first = start  # first: the member's first header block
    while end is None or position < end:
        header = _read_exact(stream, BLOCK)
        if len(header) < BLOCK:
            raise TarError(
                "truncated: no end-of-archive block" if not header else "truncated inside a header"
            )
        if header == bytes(BLOCK):
            return
        stored = _number(header[148:156])
        if stored != sum(header[:148]) + 8 * 32 + sum(header[156:]):
            raise TarError("bad header checksum (not a tar file, or corrupt)")
        size = int(pax["size"]) if "size" in pax else _number(header[124:136])
        kind = header[156:157]
        name = header[:100].rstrip(b"\0").decode("utf-8", "replace")
        if header[257:263] == b"ustar\0":  # POSIX only: GNU keeps atime/ctime at 345..369
            prefix = header[345:500].rstrip(b"\0").decode("utf-8", "replace")
            name = f"{prefix}/{name}" if prefix else name
        name = pax.get("path") or long_name or name
        # old tars mark directories by the slash
        regular = kind in (b"0", b"\0", b"7") and not name.endswith("/")
        padding = -size % BLOCK
        position += BLOCK + size + padding
        action = rule(name) if regular and rule is not None else READ
        if action != READ:
            if not _skip(stream, size + padding):
                raise TarError(f"truncated inside {name}", name)
            pax, long_name = {}, None
            if action == MARK:
                yield (name, None, first) if offsets else (name, None)
            first = position
            continue
        # exactly the member: slicing off the padding would copy it
        data = _read_exact(stream, size)
        if len(data) < size or len(_read_exact(stream, padding)) < padding:
            raise TarError(f"truncated inside {name} ({len(data)} of {size} bytes)", name)
        if kind == b"x":
            pax = _pax_records(data)
            continue
        if kind == b"L":
            long_name = data.rstrip(b"\0").decode("utf-8", "replace")
            continue
        if regular:
            yield (name, data, first) if offsets else (name, data)
        pax, long_name = {}, None  # directories, links and global headers carry nothing for us
        first = position


def split_name(name: str) -> tuple[str | None, str | None]:
    """webdataset's rule: the key is the path up to the first dot of the file name; the rest is the extension."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot < 0:
        return None, None
    return name[:dot], name[dot + 1 :].lower()


def _is_meta(key: str | None) -> bool:
    return key is None or key.rsplit("/", 1)[-1].startswith("__")  # no extension, or e.g. __index__


def member_rule(
    skip: int = 0,
    keys: Collection[str] | None = None,
    members: Collection[str] | None = None,
    headers_only: bool = False,
) -> Rule:
    """The ``read_tar`` rule of ``tar_samples``: DROP the members of samples whose key is not in
    ``keys`` (a subset of the shard), then of the first ``skip`` of the remaining samples that
    have an image (the training order counts only those); of the rest, READ the ``members``
    extensions (all when None) and MARK the others (every one with ``headers_only``)."""
    seen = {"key": None, "with_image": False, "done": 0}  # done: image samples before this one

    def rule(name: str) -> str:
        key, ext = split_name(name)
        if _is_meta(key) or (keys is not None and key not in keys):
            return DROP
        if skip:
            if key != seen["key"]:
                seen["done"] += seen["with_image"]
                seen["key"], seen["with_image"] = key, False
            seen["with_image"] |= ext in IMAGE_KEYS
            if seen["done"] < skip:
                return DROP
        if headers_only or (members is not None and ext not in members):
            return MARK
        return READ

    return rule


def tar_samples(
    stream,
    skip: int = 0,
    headers_only: bool = False,
    images_only: bool = False,
    keys: Collection[str] | None = None,
    members: Collection[str] | None = None,
    start: int = 0,
    end: int | None = None,
    offsets: bool = False,
) -> Iterator[tuple]:
    """(key, {ext: bytes}) for each sample of a tar stream, grouped as webdataset groups them:
    consecutive members with the same key. The one grouping rule of the reader, the census
    (``mpp.data.census``) and the label index (``mpp.data.labels``), so a shard's counted
    samples are exactly the ones read. ``keys``: only the samples with these keys (a labelled
    subset); ``skip``: the first ``skip`` samples (of those) passed over unread; ``members``:
    only these extensions' bytes read, the others' values None; ``headers_only``: nothing read
    but headers (values None); ``images_only``: samples without an image member left out;
    ``start``, ``end``: a ranged read (``read_tar``); ``offsets``: (key, sample, offset), the
    offset of the sample's first header block (the member index, ``mpp.data.shard_index``).
    A cut (``TarError``) ends it after the whole samples before it: the sample being read is
    kept only when the cut is known to be in a later sample's member."""
    rule = member_rule(skip, keys, members, headers_only)
    key, sample, at = None, None, None

    def whole(key: str, sample: dict) -> bool:
        return not images_only or any(ext in sample for ext in IMAGE_KEYS)

    def done() -> tuple:
        return (key, sample, at) if offsets else (key, sample)

    try:
        for name, data, offset in read_tar(stream, rule, start, end, offsets=True):
            k, ext = split_name(name)
            if sample is not None and k != key:
                if whole(key, sample):
                    yield done()
                sample = None
            if sample is None:
                key, sample, at = k, {}, offset
            sample.setdefault(ext, data)
    except Exception as exn:  # truncation, corrupt headers, network errors
        cut_key = split_name(exn.member)[0] if isinstance(exn, TarError) and exn.member else None
        if sample is not None and cut_key is not None and cut_key != key and whole(key, sample):
            yield done()
        raise
    if sample is not None and whole(key, sample):
        yield done()


def shard_samples(
    src: Iterator[dict],
    errors: SkipCounter,
    allow_pipe: bool = False,
    images_only: bool = False,
    index_dir: str | None = None,
) -> Iterator[dict]:
    """Pipeline stage: {url[, skip][, count][, keys]} -> samples {"__key__", "__url__", ext:
    bytes}, each shard read by ``tar_samples`` (``skip`` and ``keys`` as there). With the
    shard's member index (``mpp.data.shard_index``, beside it or in ``index_dir``; not for
    ``keys``), samples [skip, skip + count) are read alone, by a seek or a ranged read, and the
    rest of the shard (``count`` None: all of it) only when more are asked for."""
    for item in src:
        url, skip, count = item["url"], item.get("skip", 0), item.get("count")
        errors.shard_opened(url)
        ranged = item.get("keys") is None and (skip or count is not None)
        index = shard_index.load(url, index_dir) if ranged else None
        if index is not None and skip + (count or 0) > len(index):
            shard_index.stale(url, f"{len(index)} samples indexed, the order counts more")
            index = None
        if index is None:
            yield from _samples(url, errors, allow_pipe, images_only, skip, item.get("keys"))
            continue
        stop = len(index) if count is None else skip + count
        for first, last in ((skip, stop), (stop, len(index))):
            if first == last:
                continue
            got = yield from _samples(
                url, errors, allow_pipe, images_only, index=index, span=(first, last)
            )
            if got == "stale":  # nothing of it yielded: the rest as without an index
                yield from _samples(url, errors, allow_pipe, images_only, first)
            if got != "done":
                break


def _samples(
    url: str,
    errors: SkipCounter,
    allow_pipe: bool,
    images_only: bool,
    skip: int = 0,
    keys: Collection[str] | None = None,
    index: shard_index.MemberIndex | None = None,
    span: tuple[int, int] = (0, 0),
) -> Generator[dict, None, str]:
    """One read of a shard: from its start (``skip``, ``keys`` as ``tar_samples``'), or the
    bytes of ``index``'s samples [first, last) (``span``) alone. Returns "done", "failed" (the
    error counted) or "stale" (``index`` does not match the shard; nothing yielded)."""
    start, end = index.span(*span) if index is not None else (0, None)
    try:
        stream = open_shard(
            url, allow_pipe=allow_pipe, on_retry=errors.retried, start=start, end=end
        )
    except Exception as exn:  # any failure to open is bad data
        errors.skip(f"cannot open shard {url}: {exn!r}", url=url)
        return "failed"
    yielded = False
    try:
        if index is not None and shard_bytes(stream) != index.bytes:
            shard_index.stale(url, f"{shard_bytes(stream)} bytes, not the {index.bytes} indexed")
            return "stale"
        samples = tar_samples(
            stream, skip, images_only=images_only, keys=keys, start=start, end=end
        )
        for key, sample in samples:
            expected = index.keys[span[0]] if index is not None else key
            if not yielded and key != expected:
                shard_index.stale(url, f"{key!r} at byte {start}, not {expected!r}")
                return "stale"
            yielded = True
            yield {"__key__": key, "__url__": url, **sample}
    except Exception as exn:  # truncation, corrupt headers, network errors
        if index is not None and not yielded and isinstance(exn, TarError):
            shard_index.stale(url, f"no sample at byte {start} ({exn})")
            return "stale"
        errors.skip(f"skipping the rest of shard {url}: {exn!r}", url=url)
        return "failed"
    finally:
        stream.close()
    return "done"
