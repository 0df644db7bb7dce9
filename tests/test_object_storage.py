"""Shards in object storage (issue 31 §5): a real S3-protocol server (moto's, on localhost) read
through the real s3fs client: a 2-rank pretraining from a glob of uneven shards without
sizes.json (counted from the objects, the counts kept in the run), a shard deleted mid-run
(named, skipped, the run finishes), a bad bucket (one line before anything starts), and
transient errors retried with backoff and counted. Issue 49 §4: an epoch reads each shard's
bytes about once (the member index), counted by a proxy in front of the server."""

from __future__ import annotations

import http.client
import http.server
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
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

from mpp.data import (
    WriterOptions,
    expand_shards,
    from_arrays,
    make_train_loader,
    sources,
    write_shards,
)
from mpp.data.shards import main as shards_main

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


class CountingProxy:
    """A reverse proxy in a thread that counts the body bytes of the GET responses it relays."""

    def __init__(self, port: int):
        self.served = 0
        proxy = self

        class Relay(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # s3fs keeps its connections
            disable_nagle_algorithm = True  # else each small response waits 40 ms for an ACK

            def relay(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                upstream = http.client.HTTPConnection("127.0.0.1", port)
                upstream.request(self.command, self.path, body, dict(self.headers))
                response = upstream.getresponse()
                data = response.read()
                upstream.close()
                proxy.served += len(data) if self.command == "GET" else 0
                self.send_response(response.status, response.reason)
                for k, v in response.getheaders():  # a HEAD's length is the object's
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                    elif k.lower() == "content-length" and self.command == "HEAD":
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data if self.command != "HEAD" else b"")

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = relay

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Relay)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def counted(s3):
    """The bucket through a ``CountingProxy``: s3fs's endpoint is the proxy's for the test."""
    import fsspec

    moto = s3["env"]["FSSPEC_S3_ENDPOINT_URL"]
    proxy = CountingProxy(int(moto.rsplit(":", 1)[1]))

    def endpoint(url: str) -> None:
        os.environ["FSSPEC_S3_ENDPOINT_URL"] = url
        fsspec.config.conf.clear()
        fsspec.config.set_conf_env(fsspec.config.conf)

    endpoint(proxy.url)
    try:
        yield proxy
    finally:
        endpoint(moto)
        proxy.server.shutdown()


def test_an_epoch_from_a_bucket_reads_its_shards_bytes_once(counted, s3, tmp_path, caplog):
    """64 streams (one rank's batch of 64) over 4 x 600-sample shards: without the member index
    each stream reads its first shard from its start (B x S / 2 samples: 8 epochs' worth, and
    s3fs's 50 MB read-ahead took the rest of each shard); with it, each reads its own bytes."""
    caplog.set_level(logging.WARNING, logger="mpp.data")
    pixels = np.random.default_rng(0).integers(0, 256, (2400, 8, 8), dtype=np.uint8)
    options = WriterOptions(max_count=600, progress=False)
    paths = write_shards(from_arrays(pixels), tmp_path / "shards", "train", options=options)
    for path in [*paths, str(tmp_path / "shards" / "sizes.json")]:  # shards from before the index
        s3["fs"].put(path, f"mpp-data/many/{Path(path).name}")
    spec, total = "s3://mpp-data/many/train-{000000..000003}.tar", sum(map(os.path.getsize, paths))

    def epoch() -> tuple[list[str], int]:
        loader = make_train_loader(
            spec, batch_size=64, num_batches=2400 // 64, img_size=8, num_workers=1, with_keys=True
        )
        before = counted.served
        return [k for batch in loader for k in batch["key"]], counted.served - before

    keys, without = epoch()
    warned = [r.message for r in caplog.records if "have no member index" in r.getMessage()]
    assert len(warned) == 1 and "mpp shards --index 's3://mpp-data/many/'" in warned[0]
    shards_main(["--index", "s3://mpp-data/many/"])  # beside them, in the bucket
    assert s3["fs"].exists("mpp-data/many/train-000003.tar.idx")
    caplog.clear()
    again, read = epoch()
    assert again == keys and len(set(keys)) == 2400 // 64 * 64  # the same samples, in order
    assert "member index" not in caplog.text
    print(f"an epoch read {without / total:.2f}x the shards' bytes, {read / total:.2f}x indexed")
    assert read <= 1.05 * total and without > 4 * total


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

    class Flaky:  # a filesystem whose first two opens fail
        size = 7

        def open(self, path, mode, **options):
            calls.append(path)
            if len(calls) < 3:
                raise ConnectionResetError("reset by peer")
            return self

    monkeypatch.setattr(fsspec.core, "url_to_fs", lambda url: (Flaky(), url))
    monkeypatch.setattr(sources.time, "sleep", waits.append)
    stream = sources.open_shard("s3://b/x.tar", on_retry=lambda u, e: heard.append(u))
    assert sources.shard_bytes(stream) == 7
    assert len(calls) == 3 and waits == [0.5, 1.0] and heard == ["s3://b/x.tar"] * 2
    calls.clear()

    class Gone(Flaky):
        def open(self, path, mode, **options):
            calls.append(path)
            raise FileNotFoundError("no such key")

    monkeypatch.setattr(fsspec.core, "url_to_fs", lambda url: (Gone(), url))
    with pytest.raises(FileNotFoundError):  # not transient: no retry
        sources.open_shard("s3://b/y.tar")
    assert len(calls) == 1
