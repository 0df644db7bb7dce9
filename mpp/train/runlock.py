"""A run directory is held by one job at a time (``RUN/job.lock``: host, pid, start time); a second
job stops before writing anything, and a lock left by a dead job does not block
(docs/pretraining.md, "One job per run directory"; docs/ARCHITECTURE.md §7)."""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
from datetime import datetime
from pathlib import Path

import psutil

from mpp.config import ConfigError

log = logging.getLogger(__name__)

LOCK = "job.lock"
HEARTBEAT_S = 15.0
STALE_S = 60.0  # four missed heartbeats: the holder on another host is gone


class RunHeld(ConfigError):
    """The run directory is held by a live job."""


def hold(run_dir: Path, stale_s: float = STALE_S) -> None:
    """Take ``run_dir``'s lock for this process until it exits (the same process may call it
    again). RunHeld when a live job holds it; a dead job's lock is taken over with a warning."""
    path = Path(run_dir) / LOCK
    for _ in range(3):  # a lock removed or written between our attempts: look again
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            if holder is None:
                continue
            if _is_us(holder):
                return
            if _alive(holder, path, stale_s):
                raise RunHeld(
                    f"{run_dir} is held by the job on {holder.get('host')} pid {holder.get('pid')} since "
                    f"{holder.get('since')} ({path}): stop that job or choose another --output-dir"
                ) from None
            log.warning(
                "%s: taking over the lock of a job that is gone (%s pid %s since %s)",
                run_dir,
                holder.get("host"),
                holder.get("pid"),
                holder.get("since"),
            )
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(_record()) + "\n")
        atexit.register(_release, path)
        threading.Thread(target=_heartbeat, args=(path,), daemon=True, name="mpp-runlock").start()
        return
    raise RunHeld(f"{path}: could not be taken (another job keeps writing it)")


def _record() -> dict:
    me = psutil.Process()
    return {
        "host": socket.gethostname(),
        "pid": me.pid,
        "started": me.create_time(),
        "since": datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def _read(path: Path, patience_s: float = 2.0) -> dict | None:
    """The holder's record; None when the file is gone. A file being written (empty, half a
    line) is read again for up to ``patience_s``; one that stays unreadable is a dead job's."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                return {"host": "?", "pid": "?", "since": "?", "unreadable": True}
            time.sleep(0.1)


def _is_us(holder: dict) -> bool:
    return holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()


def _alive(holder: dict, path: Path, stale_s: float) -> bool:
    if holder.get("unreadable"):
        return False
    if holder.get("host") == socket.gethostname():
        try:
            proc = psutil.Process(int(holder["pid"]))
            return (
                abs(proc.create_time() - holder["started"]) < 1.0
                and proc.status() != psutil.STATUS_ZOMBIE
            )
        except (psutil.Error, KeyError, ValueError, TypeError):
            return False
    # another host: is its heartbeat still beating? (mtimes compared with each other, not with this
    # host's clock, except for a lock so old that no clock skew explains it)
    try:
        beat = path.stat().st_mtime
        if time.time() - beat > 10 * stale_s:
            return False
        log.info(
            "%s: held by %s pid %s; watching its heartbeat for up to %.0f s",
            path,
            holder.get("host"),
            holder.get("pid"),
            stale_s,
        )
        deadline = time.monotonic() + stale_s
        while time.monotonic() < deadline:
            time.sleep(min(1.0, stale_s / 10))
            if path.stat().st_mtime != beat:
                return True
    except FileNotFoundError:
        return False  # released while we watched
    return False


def _heartbeat(path: Path) -> None:
    while True:
        time.sleep(HEARTBEAT_S)
        try:
            os.utime(path)
        except OSError:
            return  # released, or the directory is gone


def release(run_dir: Path) -> None:
    """Give the lock back (at the end of a CLI's run; at exit anyway): a notebook that trained in
    its own process can then hand the directory to a CLI."""
    _release(Path(run_dir) / LOCK)


def _release(path: Path) -> None:
    holder = _read(path, patience_s=0.0)
    if holder is not None and _is_us(holder):
        path.unlink(missing_ok=True)
