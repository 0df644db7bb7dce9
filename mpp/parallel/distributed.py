"""The process group: join the one the launcher (deepspeed, torchrun, slurm) describes, or
make a one-process group for a plain ``python`` run; the device each rank uses; and the
workaround for DeepSpeed's leaked CPU shared memory."""

from __future__ import annotations

import atexit
import contextlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mpp.parallel.launch import free_port


def world_from_env() -> tuple[int, int]:
    """(rank, world size) as the launcher set them; a plain ``python`` run is rank 0 of 1."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class PortInUse(RuntimeError):
    """The process group's port is taken: said in one line, with a free one to use."""


def init_distributed() -> torch.device:
    """Join the process group the launcher (deepspeed, torchrun, slurm) describes, or make a
    one-process group for ``python pretrain/run.py``. gloo on CPU, NCCL on GPU."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    import deepspeed

    try:
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    except RuntimeError as e:  # torch's DistNetworkError is one
        if "EADDRINUSE" not in str(e):
            raise
        port = os.environ.get("MASTER_PORT")
        raise PortInUse(
            f"the launcher's port {port} is in use (another job on this machine?): give the "
            f"launcher another, e.g. deepspeed --master_port {free_port()} ..."
        ) from None
    # left on the way out, whatever the way: a rank that exits with the group alive can abort in
    # gloo's teardown while its peer closes the sockets ("terminate called without an active
    # exception", exit 250 from the launcher; 1 in 4 two-rank runs that stopped on a config error)
    atexit.register(leave_process_group)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    unlink_shm_buffer()
    return torch.device("cpu")


def leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank: what must be decided once (the resume tag, the shard
    list, the epoch length) is decided by rank 0, not by each rank from its own view of shared
    storage (NFS attribute caching can show ranks different listings). A collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def unlink_shm_buffer() -> None:
    """DeepSpeed's CPU all-reduce (its shm comm op) creates one 66 MB /dev/shm buffer per rank
    and never unlinks it: every CPU run leaked 66 MB per rank until the machine ran out of
    memory (20 GB after a day of tests here). By the time init returns, every rank has mapped
    every peer's buffer; after a barrier each rank unlinks its own name. The memory stays
    mapped while the job runs and is freed when it ends, even on SIGKILL."""
    dist.barrier()
    env = os.environ
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR')}_{env.get('MASTER_PORT')}_{dist.get_rank()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(Path("/dev/shm") / name)
