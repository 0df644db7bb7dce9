"""What the library needs to know about ZeRO-3's partitioned parameters: which tensors a rank holds
of a parameter, and gathering whole ones for a moment (docs/ARCHITECTURE.md §2.3). Nothing
outside this file (and the engine's checkpoint code) names a DeepSpeed parameter attribute."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from torch import Tensor, nn


def is_partitioned(p: nn.Parameter) -> bool:
    """True for a parameter ZeRO-3 has split across ranks (it carries a ``ds_tensor`` shard)."""
    return hasattr(p, "ds_tensor")


def local_tensors(p: nn.Parameter) -> list[Tensor]:
    """The tensors of ``p`` this rank holds and updates in place: the full data, or under ZeRO-3
    its flat shard, never gathered. ZeRO-3 keeps small ("persistent") parameters whole on every
    rank as well, and the forward reads that copy; it is refreshed from the shard only after the
    *next* optimiser step, so it is returned too (measured: without it an EMA lags a step).
    Two parameters of the same shape get the same partitioning, so their lists pair up. On one
    rank the shard may be the full data itself: returned once (an EMA would otherwise apply twice).
    An unpartitioned parameter is returned itself (write to it under ``torch.no_grad``): ``.data``
    would dispatch an op per parameter per step, and ZeRO-1/2 re-point it after every step."""
    if not is_partitioned(p):
        return [p]
    whole = p.data.numel() == p.ds_numel and p.data.data_ptr() != p.ds_tensor.data_ptr()
    return [p.ds_tensor, p.data] if whole else [p.ds_tensor]


@contextlib.contextmanager
def gathered(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """Inside, every parameter is whole on every rank (a collective under ZeRO-3: every rank
    must enter); nothing is done when none of them is partitioned."""
    params = list(params)
    if not any(is_partitioned(p) for p in params):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params):
        yield


def gather_stream(optimizer: object) -> object | None:
    """The CUDA stream ZeRO-3 gathers parameters on (with ``overlap_comm``), which does not wait
    for the default stream: a shard written outside DeepSpeed's step (HPM's EMA teacher) must be
    ordered before the next gather (``stream.wait_stream``: no host sync). None off CUDA, below
    stage 3, or with no such stream; looked up once (DeepSpeed keeps one coordinator)."""
    import torch

    offload = getattr(optimizer, "parameter_offload", None)
    if offload is None or not torch.cuda.is_available():
        return None
    return getattr(
        offload.get_param_coordinator(), "_PartitionedParameterCoordinator__allgather_stream", None
    )
