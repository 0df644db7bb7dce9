"""Shards in object storage (issue 31 §5): a real S3-protocol server (moto's, on localhost) read
through the real s3fs client: a 2-rank pretraining from a glob of uneven shards without
sizes.json (counted from the objects, the counts kept in the run), a shard deleted mid-run
(named, skipped, the run finishes), a bad bucket (one line before anything starts), and
transient errors retried with backoff and counted."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    free_port,
    launcher,
    listed_samples,
    read_metrics,
    run_cli,
    tiny_config,
    write_config,
)

from mpp.data import expand_shards, sources

pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on a free port, the environment s3fs reads it from, a bucket."""
    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec

    fsspec.config.conf.clear()
    fsspec.config.set_conf_env(fsspec.config.conf)  # the endpoint from the environment
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir("mpp-data")
    try:
        yield {"env": env, "fs": fs}
    finally:
        server.kill()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def upload(s3, digits16, tmp_path) -> dict:
    """Five uneven training shards (the fifth cut to 40 samples) and the val shards, no sizes.json."""
    fs = s3["fs"]
    train = expand_shards(digits16["train"])[:5]
    short = tmp_path / "train-short.tar"
    _first_samples(train[4], short, 40)
    for i, path in enumerate([*train[:4], str(short)]):
        fs.put(path, f"mpp-data/train/part-{i}.tar")
    for i, path in enumerate(expand_shards(digits16["val"])):
        fs.put(path, f"mpp-data/val/part-{i}.tar")
    return {"train": "s3://mpp-data/train/part-*.tar", "val": "s3://mpp-data/val/"}


def _first_samples(src: str, dst: Path, n: int) -> None:
    import tarfile

    with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
        keys = []
        for member in tin.getmembers():
            key = member.name.split(".")[0]
            if key not in keys:
                keys.append(key)
            if len(keys) > n:
                break
            tout.addfile(member, tin.extractfile(member))


def test_a_two_rank_run_from_a_bucket_survives_a_deleted_shard(s3, digits16, tmp_path):
    spec = upload(s3, digits16, tmp_path)
    assert len(expand_shards(spec["train"])) == 5 and len(expand_shards(spec["val"])) == 4
    cfg = tiny_config(
        digits16,
        train={"max_steps": 60, "ckpt_every": 100, "log_every": 1, "monitor_every": 60},
        data={"train_shards": spec["train"], "val_shards": spec["val"]},
    )
    cfg["monitor"] = {"bank_per_class": 2}
    path = write_config(tmp_path / "c.json", cfg)
    out = tmp_path / "run"
    head = launcher(2)
    cmd = [*head, "pretrain/run.py", "--config", str(path), "--output-dir", str(out)]
    log = open(tmp_path / "log", "w")
    job = subprocess.Popen(
        cmd,
        cwd=Path(__file__).parent.parent,
        env={**os.environ, **s3["env"]},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and job.poll() is None:  # one shard goes in epoch 0
        if (out / "metrics.jsonl").is_file() and any(
            m.get("step", 0) >= 3 for m in read_metrics(out)
        ):
            s3["fs"].rm("mpp-data/train/part-1.tar")
            break
        time.sleep(0.2)
    assert job.wait(timeout=240) == 0, (tmp_path / "log").read_text()[-3000:]
    text = (tmp_path / "log").read_text()
    # counted from the objects' tar headers (no sizes.json), the counts kept in the run

    local = listed_samples(expand_shards(digits16["train"])[:4])
    counts = json.loads((out / "shard_counts.json").read_text())["shards"]
    assert sorted(counts) == [f"s3://mpp-data/train/part-{i}.tar" for i in range(5)]
    assert sum(c["samples"] for c in counts.values()) == local + 40
    records = [m for m in read_metrics(out) if "loss" in m]
    assert records[-1]["step"] == 60 and records[-1]["epoch"] > 1  # into the second epoch
    assert "cannot open shard s3://mpp-data/train/part-1.tar" in text
    assert records[-1]["skipped"] > 0
    monitored = [m for m in read_metrics(out) if "monitor/knn_top1" in m]
    assert [m["step"] for m in monitored] == [0, 60]  # the held-out images from the bucket too


def test_a_bad_bucket_is_one_line_before_anything_starts(s3, digits16, tmp_path):
    cfg = tiny_config(digits16, data={"train_shards": "s3://no-such-bucket/x-{0..3}.tar"})
    path = write_config(tmp_path / "c.json", cfg)
    r = run_cli(
        ["python", "pretrain/run.py", "--config", str(path), "--output-dir", str(tmp_path / "x")],
        env=s3["env"],
    )
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "data.train_shards" in lines[0] and "no-such-bucket" in lines[0]
    assert not (tmp_path / "x").exists()


def test_a_transient_error_is_retried_with_backoff_and_counted(monkeypatch):
    import fsspec

    calls, waits, heard = [], [], []

    class Flaky:
        def __init__(self, url, mode):
            calls.append(url)

        def open(self):
            if len(calls) < 3:
                raise ConnectionResetError("reset by peer")
            return "stream"

    monkeypatch.setattr(fsspec, "open", Flaky)
    monkeypatch.setattr(sources.time, "sleep", waits.append)
    assert sources.open_shard("s3://b/x.tar", on_retry=lambda u, e: heard.append(u)) == "stream"
    assert len(calls) == 3 and waits == [0.5, 1.0] and heard == ["s3://b/x.tar"] * 2
    calls.clear()

    class Gone(Flaky):
        def open(self):
            raise FileNotFoundError("no such key")

    monkeypatch.setattr(fsspec, "open", Gone)
    with pytest.raises(FileNotFoundError):  # not transient: no retry
        sources.open_shard("s3://b/y.tar")
    assert len(calls) == 1
