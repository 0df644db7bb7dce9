"""Shard writer, CLI and shard-list helpers (mpp/data/writer.py, shards.py, sources.py, tario.py)."""

import io
import json
import logging
import os
import tarfile

import numpy as np
import pytest
from conftest import listed_samples
from PIL import Image

from mpp.data import (
    DataError,
    ImageEncoding,
    WriterOptions,
    expand_shards,
    from_arrays,
    from_flat_folder,
    from_image_folder,
    read_sizes,
    write_shards,
)
from mpp.data.shards import main as shards_main
from mpp.data.tario import read_tar

QUIET = WriterOptions(progress=False)


def encode(array: np.ndarray, fmt: str = "JPEG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt)
    return buf.getvalue()


def random_image(seed: int, h: int = 20, w: int = 28) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def tar_members(path: str) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_round_trip_keeps_bytes_and_labels(tmp_path):
    images = [encode(random_image(i), "JPEG" if i % 2 else "PNG") for i in range(10)]
    labels = [i % 3 for i in range(10)]
    paths = write_shards(
        zip(images, labels, strict=True),
        tmp_path,
        "train",
        options=WriterOptions(max_count=3, seed=1, progress=False),
        class_names=["a", "b", "c"],
    )
    assert [os.path.basename(p) for p in paths] == [f"train-{i:06d}.tar" for i in range(4)]
    seen = {}
    for path in paths:
        members = tar_members(path)
        for name, data in members.items():
            key, ext = name.split(".")
            if ext in ("jpg", "png"):
                seen[data] = int(members[f"{key}.cls"])
    assert seen == dict(
        zip(images, labels, strict=True)
    )  # every image, byte-identical, with its label
    sizes = json.loads((tmp_path / "sizes.json").read_text())
    assert sizes["shards"] == {
        "train-000000.tar": 3,
        "train-000001.tar": 3,
        "train-000002.tar": 3,
        "train-000003.tar": 1,
    }
    assert sizes["class_names"] == ["a", "b", "c"]
    assert listed_samples(str(tmp_path / "train-{000000..000003}.tar")) == 10
    # our own reader agrees with tarfile on every member
    with open(paths[0], "rb") as f:
        assert dict(read_tar(f)) == tar_members(paths[0])


def test_seed_shuffles_reproducibly(tmp_path):
    samples = [(encode(random_image(i)), i) for i in range(12)]

    def order(seed, sub):
        path = write_shards(
            samples, tmp_path / sub, "x", options=WriterOptions(seed=seed, progress=False)
        )[0]
        members = tar_members(path)
        return [int(members[n]) for n in sorted(members) if n.endswith(".cls")]

    assert order(None, "a") == list(range(12))
    assert order(3, "b") == order(3, "c") != order(4, "d")


def test_max_size_bounds_every_shard(tmp_path):
    samples = [(encode(random_image(i, 32, 32), "PNG"), None) for i in range(12)]
    one = len(samples[0][0])
    max_size = 10240 + 3 * (one + 1024)
    paths = write_shards(
        samples, tmp_path, "s", options=WriterOptions(max_size=max_size, progress=False)
    )
    assert len(paths) >= 4
    assert all(os.path.getsize(p) <= max_size for p in paths)
    assert sum(read_sizes(paths)["shards"].values()) == 12


def test_train_and_val_share_a_folder_and_refuse_silent_overwrite(tmp_path):
    write_shards([(encode(random_image(0)), 0)], tmp_path, "train", options=QUIET)
    write_shards([(encode(random_image(1)), 1)] * 2, tmp_path, "val", options=QUIET)
    assert read_sizes(str(tmp_path / "train-000000.tar"))["shards"] == {
        "train-000000.tar": 1,
        "val-000000.tar": 2,
    }
    with pytest.raises(FileExistsError, match="overwrite"):
        write_shards([(encode(random_image(0)), 0)], tmp_path, "train", options=QUIET)
    write_shards(
        [(encode(random_image(0)), 0)] * 3,
        tmp_path,
        "train",
        options=WriterOptions(overwrite=True, progress=False),
    )
    assert listed_samples(str(tmp_path / "train-000000.tar")) == 3


def test_image_folder_cli_and_flat_folder(tmp_path, capsys, caplog):
    # the level set here: an earlier test in the same process may have raised the root's
    caplog.set_level(logging.WARNING, logger="mpp.data")
    src = tmp_path / "src"
    for label, name in enumerate(["cat", "dog"]):
        (src / name / "sub").mkdir(parents=True)
        for i in range(3 + label):
            (src / name / "sub" / f"{i}.jpg").write_bytes(encode(random_image(10 * label + i)))
    # named, skipped and counted; the rest is written. Each one named, past the loader's
    # rate-limited first 5: the summary says "named above"
    broken = [src / "cat" / "sub" / f"broken{i}.jpg" for i in range(7)]
    for path in broken:
        path.write_bytes(b"not an image")
    samples, class_names = from_image_folder(src)
    assert (
        class_names == ["cat", "dog"]
        and sorted(label for _, label in samples) == [0] * 10 + [1] * 4
    )
    paths = shards_main(
        [str(src), str(tmp_path / "out"), "--prefix", "train", "--max-count", "4", "--no-progress"]
    )
    out = capsys.readouterr().out
    assert len(paths) == 2 and "wrote 7 samples, 2 classes" in out
    assert "train-{000000..000001}.tar; skipped 7 unreadable (named above)" in out
    assert all(f"skipping {path}: not an image" in caplog.text for path in broken)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "sizes.json",
        "train-000000.tar",
        "train-000000.tar.idx",  # the member index (mpp.data.shard_index)
        "train-000001.tar",
        "train-000001.tar.idx",
    ]  # no temporary left
    sizes = read_sizes(paths)
    assert sizes["class_names"] == ["cat", "dog"] and sum(sizes["shards"].values()) == 7
    cls = [int(v) for p in paths for n, v in tar_members(p).items() if n.endswith(".cls")]
    assert sorted(cls) == [0, 0, 0, 1, 1, 1, 1]

    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(3):
        (flat / f"{i}.png").write_bytes(encode(random_image(i), "PNG"))
    (flat / "notes.txt").write_text("not an image")
    assert len(from_flat_folder(flat)) == 3
    paths = shards_main([str(flat), str(tmp_path / "flat_out"), "--no-progress"])
    assert sorted(n.split(".")[1] for n in tar_members(paths[0])) == ["png"] * 3  # no .cls


def test_a_failed_write_leaves_no_temporary_and_unreadable_input_is_an_error(
    tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.WARNING, logger="mpp.data")
    good = [(encode(random_image(i)), 0) for i in range(3)]
    deep = (np.zeros((4, 4, 5), np.uint16), 0)  # kept as .npy: resizing it is the options' error
    with pytest.raises(ValueError, match="kept as .npy"):
        write_shards(
            [*good, deep],
            tmp_path / "a",
            "a",
            options=WriterOptions(seed=None, progress=False),
            encoding=ImageEncoding(resize=2),
        )
    assert list((tmp_path / "a").iterdir()) == []
    with pytest.raises(DataError, match="none of the 2 images could be read"):
        write_shards([(b"junk", 0), (b"GIF89a, cut", 1)], tmp_path / "b", "b", options=QUIET)
    assert list((tmp_path / "b").iterdir()) == []
    # a Pillow without WebP: the good image's encoding error stops the write, named as it is (it
    # once read as every image unreadable); the broken one before it is still skipped
    monkeypatch.delitem(Image.SAVE, "WEBP")
    with pytest.raises(KeyError, match="WEBP") as e:
        write_shards(
            [(b"junk", 0), (good[0][0], 0)],
            tmp_path / "c",
            "c",
            options=WriterOptions(seed=None, progress=False),
            encoding=ImageEncoding(reencode="webp"),
        )
    assert "sample 1, which decodes: the encoding failed" in e.value.__notes__[0]
    assert "skipping sample 0: not an image PIL can read" in caplog.text
    assert list((tmp_path / "c").iterdir()) == []


def damaged_jpeg(seed: int = 0) -> bytes:
    """A real JPEG's header (its first ~600 bytes, to the scan's start) + garbage + end marker:
    ``Image.open`` reads it, decoding its pixels fails (issue 50, finding 5)."""
    jpeg = encode(random_image(seed, 64, 64))
    garbage = np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes()
    data = jpeg[: jpeg.index(b"\xff\xda") + 14] + garbage + b"\xff\xd9"
    assert Image.open(io.BytesIO(data)).size == (64, 64)
    with pytest.raises(OSError):
        Image.open(io.BytesIO(data)).load()
    return data


def test_a_jpeg_whose_header_opens_but_pixels_do_not_decode_is_named_and_skipped(
    tmp_path, capsys, caplog
):
    """Kept bytes are decoded whole at write time (a real ``load()``): the damaged file is named
    once, left out of the shards and the count, not met by the loader every epoch."""
    caplog.set_level(logging.WARNING, logger="mpp.data")
    src = tmp_path / "src" / "cls"
    src.mkdir(parents=True)
    for i in range(3):
        (src / f"{i}.jpg").write_bytes(encode(random_image(i)))
    (src / "damaged.jpg").write_bytes(damaged_jpeg())
    paths = shards_main([str(tmp_path / "src"), str(tmp_path / "out"), "--no-progress"])
    out = capsys.readouterr().out
    assert "wrote 3 samples, 1 classes" in out and "skipped 1 unreadable (named above)" in out
    named = [r.getMessage() for r in caplog.records if "damaged.jpg" in r.getMessage()]
    assert len(named) == 1 and "cannot read or decode it (OSError(" in named[0], named
    assert sum(n.endswith(".jpg") for n in tar_members(paths[0])) == 3
    assert read_sizes(paths)["shards"] == {"data-000000.tar": 3}
    # through the API too, as bytes: named by its position
    caplog.clear()
    good = [(encode(random_image(i)), 0) for i in range(2)]
    write_shards([*good, (damaged_jpeg(), 0)], tmp_path / "api", options=QUIET)
    assert "skipping sample 2: cannot read or decode it" in caplog.text
    assert listed_samples(str(tmp_path / "api" / "data-000000.tar")) == 2


def test_arrays_resize_and_reencode(tmp_path):
    arrays = np.stack([random_image(i, 8, 8) for i in range(4)])
    path = write_shards(
        from_arrays(arrays, [0, 1, 2, 3]),
        tmp_path / "a",
        "a",
        options=WriterOptions(seed=None, progress=False),
    )[0]
    pngs = [v for n, v in sorted(tar_members(path).items()) if n.endswith(".png")]
    assert all(
        np.array_equal(np.asarray(Image.open(io.BytesIO(b))), a)
        for b, a in zip(pngs, arrays, strict=True)
    )  # lossless

    jpg = encode(random_image(0, 60, 90))
    path = write_shards(
        [(jpg, None)],
        tmp_path / "b",
        "b",
        options=QUIET,
        encoding=ImageEncoding(resize=30, reencode="webp"),
    )[0]
    ((name, data),) = tar_members(path).items()
    assert name.endswith(".webp") and Image.open(io.BytesIO(data)).size == (45, 30)  # short side 30


def test_max_side_shrinks_only_larger_images_and_keeps_the_rest_byte_for_byte(tmp_path):
    """``mpp shards --max-side 256``: a 500 x 375 JPEG is stored at 256 x 192 (a CPU worker
    decodes it about twice as fast, BENCHMARKS "decode"), a 200 x 150 one and a PNG within the
    bound byte-for-byte, each in its own format."""
    src = tmp_path / "src" / "cls"
    src.mkdir(parents=True)
    big, small = encode(random_image(0, 375, 500)), encode(random_image(1, 150, 200))
    png = encode(random_image(2, 100, 80), "PNG")
    for name, data in (("big.jpg", big), ("small.jpg", small), ("p.png", png)):
        (src / name).write_bytes(data)
    shards_main([str(tmp_path / "src"), str(tmp_path / "out"), "--max-side", "256", "--seed", "-1"])
    members = {
        n: v
        for path in sorted((tmp_path / "out").glob("*.tar"))
        for n, v in tar_members(str(path)).items()
    }
    stored = {n.rsplit(".", 1)[1]: v for n, v in members.items() if not n.endswith(".cls")}
    images = [v for n, v in sorted(members.items()) if not n.endswith(".cls")]
    sizes = sorted(Image.open(io.BytesIO(v)).size for v in images)
    assert sizes == [(80, 100), (200, 150), (256, 192)]
    assert small in images and png in images and big not in images
    assert set(stored) == {"jpg", "png"}


def test_expand_shards_forms(tmp_path):
    assert expand_shards("a-{000..002}.tar") == ["a-000.tar", "a-001.tar", "a-002.tar"]
    assert expand_shards("a-{0..1}.tar,b-{x,y}.tar") == ["a-0.tar", "a-1.tar", "b-x.tar", "b-y.tar"]
    assert expand_shards(["u.tar", "v-{1..2}.tar"]) == ["u.tar", "v-1.tar", "v-2.tar"]
    for name in ("b.tar", "a.tar", "sizes.json"):
        (tmp_path / name).write_bytes(b"")
    assert expand_shards(str(tmp_path)) == [str(tmp_path / "a.tar"), str(tmp_path / "b.tar")]
    with pytest.raises(ValueError):
        expand_shards([])


def test_read_sizes_without_sizes_json_is_none(tmp_path):
    (tmp_path / "x-0.tar").write_bytes(b"")
    assert read_sizes(str(tmp_path / "x-0.tar")) is None  # the census counts such shards


def test_the_json_caches_read_a_relative_path_with_a_colon(tmp_path, monkeypatch):
    """sizes.json, the census's and the statistics' caches: ``runs/exp:1`` is a local folder,
    not a URL scheme; their writer leaves no temporary behind."""
    from mpp.data.sources import _read_json, _write_json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "exp:1").mkdir()
    _write_json(tmp_path / "exp:1" / "c.json", {"n": 3})
    assert _read_json("exp:1/c.json") == {"n": 3} and _read_json("exp:1/none.json") is None
    assert [p.name for p in (tmp_path / "exp:1").iterdir()] == ["c.json"]


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_tar_reader_agrees_with_tarfile(tmp_path, fmt):
    long_dir = "d" * 120 if fmt != tarfile.USTAR_FORMAT else "d" * 60
    path = tmp_path / "x.tar"
    with tarfile.open(path, "w", format=fmt) as tar:
        folder = tarfile.TarInfo("folder")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)  # a directory: not a member for us
        for i, size in enumerate([0, 1, 511, 512, 513, 5000]):
            info = tarfile.TarInfo(f"{long_dir}/{i:03d}.bin")
            info.size = size
            tar.addfile(info, io.BytesIO(bytes([i]) * size))
    with open(path, "rb") as f:
        ours = list(read_tar(f))
    assert ours == [(n, d) for n, d in tar_members(path).items() if n.endswith(".bin")]
    assert len(ours) == 6


def test_one_shard_is_printed_by_its_name(tmp_path, capsys):
    """``mpp shards`` printed ``val-{000000..000000}.tar`` for one shard, where README shows
    ``val-000000.tar`` (issue 50, finding 9); the spec it prints reads back as what it wrote."""
    from mpp.data import shard_spec

    assert shard_spec("d", "val", 1) == "d/val-000000.tar"
    assert shard_spec("d", "train", 2) == "d/train-{000000..000001}.tar"
    src = tmp_path / "photos"
    for i in range(3):
        (src / "cat").mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(src / "cat" / f"{i}.png")
    paths = shards_main([str(src), str(tmp_path / "out"), "--prefix", "val", "--no-progress"])
    spec = capsys.readouterr().out.strip().split(" to ")[-1]
    assert spec == f"{tmp_path / 'out'}/val-000000.tar" and expand_shards(spec) == paths
