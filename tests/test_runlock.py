"""The run directory's lock (mpp/train/runlock.py) against the holders a requeued job meets: a live
job here, a dead one here, a live and a dead one on another host, a half-written lock file."""

import json
import os
import socket
import subprocess
import threading
import time

import psutil
import pytest

from mpp.train import runlock


def lock_of(holder: dict, run, mtime_age: float = 0.0):
    path = run / runlock.LOCK
    path.write_text(json.dumps(holder) + "\n")
    os.utime(path, (time.time() - mtime_age, time.time() - mtime_age))
    return path


def record_of(proc: psutil.Process, host: str | None = None) -> dict:
    return {
        "host": host or socket.gethostname(),
        "pid": proc.pid,
        "started": proc.create_time(),
        "since": "then",
    }


def test_a_live_job_on_this_host_holds_the_directory(tmp_path):
    other = subprocess.Popen(["sleep", "60"])
    try:
        lock_of(record_of(psutil.Process(other.pid)), tmp_path)
        with pytest.raises(
            runlock.RunHeld,
            match=f"held by the job on {socket.gethostname()} pid {other.pid} since then",
        ):
            runlock.hold(tmp_path)
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("case", ["dead pid", "pid reused", "half written"])
def test_a_dead_jobs_lock_on_this_host_is_taken_over(tmp_path, case):
    gone = subprocess.Popen(["true"])
    gone.wait()
    if case == "dead pid":
        lock_of(
            {"host": socket.gethostname(), "pid": gone.pid, "started": 0.0, "since": "then"},
            tmp_path,
        )
    elif case == "pid reused":  # the pid is alive but another process now: its start time differs
        lock_of({**record_of(psutil.Process(os.getppid())), "started": 1.0}, tmp_path)
    else:
        (tmp_path / runlock.LOCK).write_text('{"host": "n')
    runlock.hold(tmp_path)
    held = json.loads((tmp_path / runlock.LOCK).read_text())
    assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
    runlock.hold(tmp_path)  # the holder may take it again
    runlock.release(tmp_path)
    assert not (tmp_path / runlock.LOCK).exists()


def test_another_hosts_lock_blocks_while_its_heartbeat_beats_and_not_after(tmp_path):
    path = lock_of({"host": "node-017", "pid": 4242, "started": 1.0, "since": "then"}, tmp_path)
    beating = threading.Event()

    def beat():
        while not beating.wait(0.1):
            os.utime(path)

    heart = threading.Thread(target=beat, daemon=True)
    heart.start()
    with pytest.raises(runlock.RunHeld, match="held by the job on node-017 pid 4242"):
        runlock.hold(tmp_path, stale_s=1.0)
    beating.set()
    heart.join()
    t0 = time.monotonic()
    runlock.hold(tmp_path, stale_s=1.0)  # stopped beating: a lost node
    assert 0.9 < time.monotonic() - t0 < 10 and json.loads(path.read_text())["pid"] == os.getpid()
    runlock.release(tmp_path)
    lock_of(
        {"host": "node-017", "pid": 4242, "started": 1.0, "since": "then"}, tmp_path, mtime_age=3600
    )
    t0 = time.monotonic()
    runlock.hold(tmp_path)  # silent for an hour: no wait at all
    assert time.monotonic() - t0 < 1
    runlock.release(tmp_path)
