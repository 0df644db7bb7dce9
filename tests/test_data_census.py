"""Shards that other tools wrote: unequal sizes, no sizes.json, an empty and a truncated shard.
Every sample must be trained exactly once per epoch whatever the shards' sizes (mpp.data.census)."""

import json
import shutil
import subprocess
import tarfile
from collections import Counter
from pathlib import Path

import pytest
import webdataset as wds
from conftest import launcher, read_metrics, run_cli, tiny_config, write_config
from test_data_loader import collect, encode, write_tar

from mpp.data import make_eval_loader
from mpp.data.census import CACHE_FILE, census

BATCH = 12  # 3 ranks x micro batch 2 x accumulation 2; the shards below hold 10 batches


def foreign_shards(root: Path) -> list[str]:
    """120 samples with an image in 7 shards from three writers (none writes sizes.json)."""
    root.mkdir()
    # webdataset's ShardWriter splits by count: 23, 23, 4; the middle one is then cut inside its last member
    with wds.ShardWriter(str(root / "wds-%06d.tar"), maxcount=23, verbose=0) as sink:
        for i in range(50):
            sink.write({"__key__": f"w{i:04d}", "jpg": encode(i), "cls": b"1"})
    cut = root / "wds-000001.tar"
    with tarfile.open(cut) as tar:
        last = tar.getmember("w0045.cls" if "w0045.cls" in tar.getnames() else "w0045.jpg")
    cut.write_bytes(cut.read_bytes()[: last.offset_data + 1])  # w0045 is lost, 22 samples stay
    # GNU tar over a folder of files: 37 png samples and a caption without an image (not a sample to train)
    files = root / "files"
    files.mkdir()
    for i in range(37):
        (files / f"t{i:04d}.png").write_bytes(encode(100 + i, "PNG"))
        (files / f"t{i:04d}.cls").write_bytes(b"2")
    (files / "t9999.txt").write_bytes(b"a caption whose image failed")
    subprocess.run(
        ["tar", "cf", str(root / "gnu.tar"), "--sort=name", "-C", str(files), "."], check=True
    )
    shutil.rmtree(files)
    # img2dataset's layout: NNNNN.tar of jpg/txt/json members + NNNNN_stats.json; an all-failed shard is empty
    write_tar(
        root / "00000.tar",
        [
            (f"{i:09d}.{ext}", encode(200 + i) if ext == "jpg" else b"{}")
            for i in range(34)
            for ext in ("jpg", "txt", "json")
        ],
    )
    (root / "00000_stats.json").write_text(
        json.dumps({"count": 40, "successes": 34, "failed_to_download": 6})
    )
    subprocess.run(["tar", "cf", str(root / "00001.tar"), "-T", "/dev/null"], check=True)
    (root / "00001_stats.json").write_text(json.dumps({"count": 40, "successes": 0}))
    return [str(p) for p in sorted(root.glob("*.tar"))]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    return foreign_shards(tmp_path_factory.mktemp("census") / "shards")


def read_keys(shards: list[str]) -> list[str]:
    keys, _, _ = collect(
        make_eval_loader(
            shards, batch_size=16, img_size=16, num_workers=0, with_keys=True, with_labels=False
        )
    )
    return keys


def test_the_census_counts_exactly_what_the_reader_reads_and_names_every_odd_shard(
    shards, tmp_path
):
    counted = census(shards)
    read = Counter(k.split("#")[0] for k in read_keys(shards))
    assert dict(zip(shards, counted.sizes, strict=True)) == {s: read.get(s, 0) for s in shards}
    assert counted.total == 120 and counted.sizes == [34, 0, 37, 23, 22, 4]
    by_name = {Path(s).name: c for s, c in zip(shards, counted.counts, strict=True)}
    assert (
        by_name["00000.tar"].source == "img2dataset stats"
        and by_name["gnu.tar"].source == "tar headers"
    )
    assert (
        by_name["gnu.tar"].without_image == 1 and "truncated" in by_name["wds-000001.tar"].problem
    )
    summary = counted.summary()
    for fact in (
        "120 samples in 6 shards",
        "empty: 1 (",
        "00001.tar",
        "ending early: 1",
        "wds-000001.tar",
        "without an image, not trained: 1 (1 in",
        "gnu.tar",
    ):
        assert fact in summary, summary
    # the scan is cached beside the shards: the next census reads no tar, a changed shard is counted again
    cache = json.loads((Path(shards[0]).parent / CACHE_FILE).read_text())["shards"]
    assert cache["gnu.tar"]["samples"] == 37 and "bytes" in cache["gnu.tar"]
    again = census(shards)
    assert again.sizes == counted.sizes and not again.scan_s
    assert {c.source for c in again.counts} == {"img2dataset stats", "cache"}
    duplicate = tmp_path / "dup.tar"
    write_tar(duplicate, [("a.jpg", encode(1)), ("b.jpg", encode(2)), ("a.jpg", encode(3))])
    assert (
        census([str(duplicate)]).counts[0].duplicate_keys == 1
    )  # 'a' twice, not grouped: 3 samples
    assert census([str(duplicate)]).sizes == [3] and len(read_keys([str(duplicate)])) == 3


def trained_keys(run: Path) -> dict[int, list[str]]:
    per_epoch: dict[int, list[str]] = {}
    for log in sorted((run / "keys").glob("rank*.jsonl")):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            per_epoch.setdefault(record["epoch"], []).extend(record["keys"])
    return per_epoch


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 3])
def test_every_sample_of_unequal_shards_once_per_epoch(ranks, shards, digits16, tmp_path):
    """Before the census, the shards were taken as equal (data.num_samples split evenly): some
    samples were trained twice an epoch and others never. On 3 ranks x 3 data workers the 6
    shards (5 with samples) are fewer than the 9 workers: the training stream is resampled (every
    worker draws from every shard), so the run needs no shard per worker and runs, every rank in
    step (this held test_scale's former 4-rank run on seven shards)."""
    expected = set(read_keys(shards))
    workers = 3 if ranks == 3 else 1
    if ranks > 1:
        assert ranks * workers > len(shards)
    cfg = tiny_config(
        digits16,
        data={
            "train_shards": shards,
            "num_samples": 120,
            "log_keys": True,
            "num_workers": workers,
        },
        train={
            "batch_size": BATCH,
            "micro_batch_size": 2 if ranks == 3 else 12,
            "epochs": 2,
            "max_steps": None,
            "ckpt_every": 100,
            "log_every": 5,
        },
    )
    path = write_config(tmp_path / "c.json", cfg)
    head = launcher(ranks) if ranks > 1 else ["python"]
    r = run_cli(
        [*head, "pretrain/run.py", "--config", str(path), "--output-dir", str(tmp_path / "run")]
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    per_epoch = trained_keys(tmp_path / "run")
    assert sorted(per_epoch) == [0, 1]
    for keys in per_epoch.values():
        assert len(keys) == len(set(keys)) == 120 and set(keys) == expected
    last = read_metrics(tmp_path / "run")[-1]
    assert last["step"] == 20 and last["samples"] == 2 * 120  # 10 steps an epoch, 2 epochs
    if (
        ranks == 1
    ):  # data.num_samples is a cross-check now: a wrong one stops the run before it starts
        wrong = run_cli(
            [
                "python",
                "pretrain/run.py",
                "--config",
                str(path),
                "--set",
                "data.num_samples=121",
                "--output-dir",
                str(tmp_path / "wrong"),
            ]
        )
        errors = [line for line in wrong.stderr.splitlines() if line.startswith("error:")]
        assert wrong.returncode == 2 and len(errors) == 1, wrong.stderr[-2000:]
        assert "data.num_samples: 121, but the shards hold 120 samples" in errors[0]
        assert not (tmp_path / "wrong").exists()
