"""What a checkpoint is on disk, checked: every file's size and sha256 go into its COMPLETE marker
(hashed by the ranks in parallel, after every rank's files are written) and are verified before
anything loads it; and the room a checkpoint needs on its filesystem, looked at before each save.

A checkpoint damaged after its marker was written (a bad copy between filesystems, a truncated
file) otherwise fails inside DeepSpeed's loader with "PytorchStreamReader failed reading zip
archive", naming no file; a full disk fails inside torch's writer with "basic_ios::clear" or
"unexpected pos", naming no directory.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import shutil
from pathlib import Path

import torch

from mpp.parallel.distributed import from_rank0, rank_world, split_scan

log = logging.getLogger(__name__)
CHUNK = 8 << 20
_warned_room: dict[str, int] = {}  # checkpoint root -> the room last warned about


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be made complete or cannot be read back; the message names the file."""


class DiskFullError(CheckpointError):
    """No room for a checkpoint: the message names the directory, the space left and the size."""


# ---- the manifest: each file's size and sha256 -------------------------------------------------


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def manifest(tag_dir: Path) -> dict[str, dict]:
    """{relative path: {"bytes", "sha256"}} of every file under ``tag_dir``. A collective under a
    process group: rank 0 lists the files, each rank hashes its share, every rank gets the whole."""
    tag_dir = Path(tag_dir)
    names = None
    if rank_world()[0] == 0:
        names = sorted(str(p.relative_to(tag_dir)) for p in tag_dir.rglob("*") if p.is_file())
    names = from_rank0(names)
    return dict(zip(names, split_scan(names, lambda name: _record(tag_dir / name)), strict=True))


def _record(path: Path) -> dict:
    try:
        return {"bytes": path.stat().st_size, "sha256": sha256(path)}
    except OSError as e:  # said by rank 0 with the rest; raising here would strand the gather
        return {"error": str(e)}


def damage(tag_dir: Path, recorded: dict | None) -> str | None:
    """The first way ``tag_dir`` differs from its marker's manifest (None: intact, or a marker from
    before manifests). Sizes first, for every file (cheap), then the checksums."""
    if not recorded:
        return None
    for name, want in recorded.items():
        path = Path(tag_dir) / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, its checkpoint's marker says {want['bytes']}"
    for name, want in recorded.items():
        if sha256(Path(tag_dir) / name) != want["sha256"]:
            return f"{Path(tag_dir) / name} differs from the checksum in its checkpoint's marker"
    return None


# ---- room on the filesystem ---------------------------------------------------------------------


def checkpoint_bytes(recorded: dict | None) -> int:
    return sum(r.get("bytes", 0) for r in (recorded or {}).values())


def estimate_bytes(module: torch.nn.Module) -> int:
    """A checkpoint's size before the first one exists: each parameter in its own dtype, and for a
    trained one its fp32 master and Adam's two moments (12 bytes; an fp32 run's master is the
    parameter itself, so this overstates it by 4 bytes a parameter)."""
    return sum(
        p.numel() * (p.element_size() + (12 if p.requires_grad else 0)) for p in module.parameters()
    )


def free_bytes(path: Path) -> int:
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def no_room(
    ckpt_root: Path, tag: str, size: int, previous: str | None, free: int | None = None
) -> str | None:
    """The one line a save stops with when it cannot fit (``free`` given: it did not fit, measured
    when the write failed), or None."""
    filled, free = free is not None, free_bytes(ckpt_root) if free is None else free
    if free >= size and not filled:
        return None
    kept = (
        f"the newest complete checkpoint, {previous}, is intact"
        if previous
        else "no checkpoint is complete yet"
    )
    what = (
        f"the disk filled up during checkpoint {tag}, its partial files are removed"
        if filled
        else f"no room for checkpoint {tag}"
    )
    return f"{what}: {ckpt_root} has {_mb(free)} free, a checkpoint takes {_mb(size)} ({kept}); free space, then --resume auto"


def warn_room(ckpt_root: Path, size: int, kept_bytes: int, keep_last: int) -> None:
    """Warn (once per change) when the disk holds fewer than ``keep_last + 1`` checkpoints: a save
    writes the new one before the oldest is removed."""
    fit = (free_bytes(ckpt_root) + kept_bytes) // max(size, 1)
    if fit < keep_last + 1 and _warned_room.get(str(ckpt_root)) != fit:
        _warned_room[str(ckpt_root)] = fit
        log.warning(
            "the disk under %s has room for %d checkpoint(s) of %s, train.keep_last=%d needs %d at a save: "
            "free space or lower train.keep_last",
            ckpt_root,
            fit,
            _mb(size),
            keep_last,
            keep_last + 1,
        )


def is_disk_full(error: BaseException, ckpt_root: Path, size: int) -> bool:
    """Whether a failed write ran out of space: ENOSPC/EDQUOT, or torch's writer's own words
    ("basic_ios::clear", "unexpected pos", "file write failed") with less free than a checkpoint."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(error, (OSError, RuntimeError)) and free_bytes(ckpt_root) < size


def filled_up(ckpt_root: Path, tag: str, size: int, previous: str | None) -> str:
    """A save the disk could not hold: the free space measured, its partial files removed, and the
    line it stops with (``no_room``)."""
    free = free_bytes(ckpt_root)
    shutil.rmtree(Path(ckpt_root) / tag, ignore_errors=True)
    return no_room(ckpt_root, tag, size, previous, free)


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
