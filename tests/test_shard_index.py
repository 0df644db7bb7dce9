"""The member index (mpp/data/shard_index.py): a stream reads only its own samples' bytes, from
any sample of a shard, and gets the samples a read from the shard's start gets; an index that
does not match its shard (rewritten since) is not used. Over a bucket: test_object_storage."""

import functools
import http.server
import io
import itertools
import logging
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest

from mpp.data import WriterOptions, from_arrays, shard_index, tario, write_shards
from mpp.data.census import census
from mpp.data.errors import SkipCounter
from mpp.data.shards import main as shards_main
from mpp.data.tario import shard_samples


def write_shard(path: Path, fmt: int, prefix: str = "s") -> str:
    """Every member layout the index must group as the reader does: pax (or GNU) long names,
    a meta member, a sample without an image, a label before its image, unequal sizes."""
    long = "d" * 120  # past ustar's 100 characters: a pax 'x' or a GNU 'L' header first
    members = [("__meta__.json", b"{}")]
    for i in range(12):
        key = f"{long}/{prefix}{i:03d}" if i % 3 == 0 else f"{prefix}{i:03d}"
        image = (f"{key}.jpg", bytes([i]) * (300 + 700 * i))
        label = (f"{key}.cls", str(i).encode())
        members += (
            [label, image]
            if i == 5
            else [(f"{key}.txt", b"no image")]
            if i == 7
            else [image, label]
        )
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def keys(samples) -> list[str]:
    return [s["__key__"] for s in samples]


@pytest.fixture
def opened(monkeypatch) -> list[tuple[int, int | None]]:
    """The byte ranges the reader opens shards at."""
    ranges, real = [], tario.open_shard

    def open_shard(url, *, start=0, end=None, **kw):
        ranges.append((start, end))
        return real(url, start=start, end=end, **kw)

    monkeypatch.setattr(tario, "open_shard", open_shard)
    return ranges


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_any_range_of_a_shard_is_read_from_its_own_bytes(tmp_path, fmt, opened):
    url = write_shard(tmp_path / "x.tar", fmt)
    whole = keys(shard_samples([{"url": url}], SkipCounter(), images_only=True))
    assert len(whole) == 11 and shard_index.load(url) is None  # sample 7 has no image
    census([url])  # its header pass indexes it, beside it
    index = shard_index.load(url)
    assert index.keys == tuple(whole) and Path(url + ".idx").is_file()
    with tarfile.open(url) as tar:  # where tarfile says each sample's first header is
        first = {}
        for m in tar.getmembers():
            first.setdefault(m.name.split(".")[0], m.offset)
    assert index.offsets == tuple(first[k] for k in whole)
    for skip in range(len(whole)):
        for count in sorted({1, min(3, len(whole) - skip), len(whole) - skip}):
            opened.clear()
            samples = shard_samples(
                [{"url": url, "skip": skip, "count": count}], SkipCounter(), images_only=True
            )
            assert keys(itertools.islice(samples, count)) == whole[skip : skip + count]
            assert opened == [index.span(skip, skip + count)]  # its samples' bytes alone
            # more asked for (bad data): the rest of the shard, opened only then
            assert keys(samples) == whole[skip + count :]


def test_a_rewritten_shard_is_read_without_its_old_index(tmp_path, caplog, opened):
    caplog.set_level(logging.WARNING, logger="mpp.data")
    url = write_shard(tmp_path / "x.tar", tarfile.PAX_FORMAT)
    census([url])
    write_shard(tmp_path / "x.tar", tarfile.USTAR_FORMAT, prefix="t")  # other keys and offsets
    assert shard_index.load(url) is None and "changed since it was indexed" in caplog.text
    got = shard_samples([{"url": url, "skip": 2, "count": 3}], SkipCounter(), images_only=True)
    assert [k[-4:] for k in keys(got)][:3] == ["t002", "t003", "t004"] and opened == [(0, None)]


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """One byte range a request, as object stores and CDNs serve them (206), each one noted."""

    def send_head(self):
        spec = self.headers.get("Range")
        path = Path(self.translate_path(self.path))
        if spec is None or not path.is_file():
            return super().send_head()
        data = path.read_bytes()
        start, _, last = spec.removeprefix("bytes=").partition("-")
        start, end = int(start), int(last) + 1 if last else len(data)
        self.server.ranges.append((path.name, start, end))
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        return io.BytesIO(data[start:end])

    def log_message(self, *args):
        pass


@pytest.fixture
def served(tmp_path):
    """(the URL of a folder served over HTTP with byte ranges, the folder, the ranges served)."""
    folder = tmp_path / "www"
    folder.mkdir()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(RangeHandler, directory=str(folder))
    )
    server.ranges = []
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", folder, server.ranges
    server.shutdown()


def test_an_http_shard_is_read_by_ranges_with_an_index_in_the_run(served, tmp_path, capsys):
    base, folder, ranges = served
    write_shard(folder / "x.tar", tarfile.PAX_FORMAT)
    url, run = f"{base}/x.tar", tmp_path / "run"
    with pytest.raises(SystemExit):  # nothing can be written beside an http(s) shard
        shards_main(["--index", url])
    assert "pass --run-dir RUN" in capsys.readouterr().err
    assert shards_main(["--index", url, "--run-dir", str(run)]) == [url]
    (saved,) = (run / shard_index.RUN_DIR).iterdir()
    assert saved.name.startswith("x.tar.") and shard_index.load(url) is None  # not beside it
    index = shard_index.load(url, str(run / shard_index.RUN_DIR))
    ranges.clear()
    got = shard_samples(
        [{"url": url, "skip": 4, "count": 2}],
        SkipCounter(),
        images_only=True,
        index_dir=str(run / shard_index.RUN_DIR),
    )
    assert keys(itertools.islice(got, 2)) == ["s004", "s005"]
    assert ranges == [("x.tar", *index.span(4, 6))]


def test_a_remote_index_whose_key_is_not_at_its_offset_is_not_used(served, tmp_path, caplog):
    """Same layout, other keys (the shard rewritten in place): the sample at the offset is not the
    indexed one, so the shard is read from its start, with one warning."""
    caplog.set_level(logging.WARNING, logger="mpp.data")
    base, folder, ranges = served
    write_shard(folder / "x.tar", tarfile.PAX_FORMAT, prefix="a")
    census([str(folder / "x.tar")])  # indexed beside it: served with it
    (folder / "x.tar").unlink()
    write_shard(folder / "x.tar", tarfile.PAX_FORMAT, prefix="b")
    url = f"{base}/x.tar"
    assert shard_index.load(url) is not None  # the size is the same: only the keys differ
    for _ in range(2):
        got = shard_samples([{"url": url, "skip": 4, "count": 2}], SkipCounter(), images_only=True)
        assert keys(itertools.islice(got, 2)) == ["b004", "b005"]
    assert len(ranges) == 1 and caplog.text.count("does not match it") == 1
    assert "'b004' at byte" in caplog.text


def test_the_writer_indexes_its_shards(tmp_path):
    paths = write_shards(
        from_arrays(np.arange(7 * 16, dtype=np.uint8).reshape(7, 4, 4)),
        tmp_path,
        "w",
        options=WriterOptions(max_count=4, seed=None, progress=False),
    )
    for path in paths:
        index = shard_index.load(path)
        assert index is not None and index.bytes == Path(path).stat().st_size
    assert [len(shard_index.load(p)) for p in paths] == [4, 3]
