"""The process group: join the one the launcher (deepspeed, torchrun, slurm) describes, or make a
one-process group for a plain ``python`` run; the device each rank uses (docs/ARCHITECTURE.md
§5.3)."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mpp.parallel.launch import free_port


def world_from_env() -> tuple[int, int]:
    """(rank, world size) as the launcher set them; a plain ``python`` run is rank 0 of 1."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the process group; (0, 1) without one."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def split_scan(items: Sequence[Any], fn: Callable[[Any], Any]) -> list[Any]:
    """``[fn(x) for x in items]``, rank r doing ``items[r::world]``, gathered on every rank in the
    items' order: the census, the label index, the pixel statistics, a checkpoint's checksums. A
    collective under a process group of more than one: every rank passes the same ``items``."""
    rank, world = rank_world()
    mine = [fn(x) for x in items[rank::world]]
    if world == 1:
        return mine
    parts: list = [None] * world
    dist.all_gather_object(parts, mine)
    out: list = [None] * len(items)
    for r, part in enumerate(parts):
        out[r::world] = part
    return out


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class PortInUse(RuntimeError):
    """The process group's port is taken: said in one line, with a free one to use."""


# what init_distributed sets for a plain ``python`` run (one process, no launcher)
ONE_PROCESS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def init_distributed() -> torch.device:
    """Join the process group the launcher (deepspeed, torchrun, slurm) describes, or make a
    one-process group for ``python pretrain/run.py``. gloo on CPU, NCCL on GPU."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    import deepspeed

    skip_shm_comm_op()
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
    return torch.device("cpu")


def skip_shm_comm_op() -> None:
    """Keep DeepSpeed from building its CPU shared-memory all-reduce when it sets up its comm
    backend. Only DeepSpeed-Inference's tensor-parallel ``inference_all_reduce`` calls it;
    training's collectives are the process group's (gloo on CPU). Built, it costs a C++ JIT
    compile on first use (about a minute on both of 2 cores, under a file lock that a killed
    build leaves stale; redone when another ninja shares the cache) and maps a 66 MB /dev/shm
    buffer per rank that DeepSpeed never unlinks (20 GB had piled up here). Marked incompatible in
    DeepSpeed's table of ops (a dict it keeps so that edits persist), it is neither built nor
    mapped. On GPU the op does not exist, and reading the table would probe every op (nvcc
    calls, a warning per op without a CUDA toolkit): nothing is done."""
    if torch.cuda.is_available():
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def leave_process_group() -> None:
    """Destroy the process group, through DeepSpeed where it joined it: DeepSpeed keeps its own
    references to the groups it derived (data parallel, ZeRO), which a later
    ``deepspeed.initialize`` in this process would otherwise broadcast over, destroyed."""
    if not dist.is_initialized():
        return
    comm = sys.modules.get("deepspeed.comm")
    if comm is not None and comm.is_initialized():
        comm.destroy_process_group()
    else:
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group_of_this_call() -> Iterator[None]:
    """Around an in-process job (``mpp.pretrain()`` in a notebook): the process group it creates
    (``init_distributed``) left on the way out, with the variables it set in the environment and
    the hook torch puts in ``sys.excepthook``, which prefixes every later traceback line of the
    session with ``[rank0]:``. A group that was there before the call is the caller's: kept."""
    if dist.is_initialized():
        yield
        return
    env = {key: os.environ.get(key) for key in ONE_PROCESS_VARS}
    hook = sys.excepthook
    try:
        yield
    finally:
        leave_process_group()
        sys.excepthook = hook
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank: what must be decided once (the resume tag, the shard
    list, the epoch length) is decided by rank 0, not by each rank from its own view of shared
    storage (NFS attribute caching can show ranks different listings). A collective."""
    if rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def in_step(batches: Iterable[Any], device: torch.device) -> Iterator[Any | None]:
    """The batches, then None until every rank's are done, so every rank runs the same number of
    forwards: under ZeRO-3 each is a collective, and ranks get unequal shares of held-out shards
    (docs/ARCHITECTURE.md §3.3). Every rank must call it; one small all-reduce per batch."""
    world = rank_world()[1]
    for batch in itertools.chain(batches, itertools.repeat(None)):
        more = batch is not None
        if world > 1:
            flag = torch.tensor([more], dtype=torch.float32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            more = bool(flag.item())
        if not more:
            return
        yield batch
