"""ZeRO stage 0 (plain data parallelism) with fp32 weights, its gradient all-reduce and clipping in
a handful of multi-tensor ops (docs/ARCHITECTURE.md §6.3). The engine still decides when; only
its ``allreduce_gradients`` and ``clip_fp32_gradients`` are replaced."""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def use_multi_tensor_path(engine: Any) -> bool:
    """Replace the engine's gradient all-reduce and clipping where its stage-0 fp32-weight path
    runs them (no ZeRO, no DeepSpeed bf16/fp16 optimiser, no MoE, no pipeline or sequence
    parallelism; dense gradients, as every mpp model has); True when it did."""
    if (
        engine.zero_optimization()
        or engine.bfloat16_enabled()
        or engine.fp16_enabled()
        or engine.has_moe_layers
        or engine.pipeline_parallelism
        or getattr(engine, "sequence_parallel_size", 1) != 1
    ):
        return False
    engine.allreduce_gradients = types.MethodType(allreduce_gradients, engine)
    engine.clip_fp32_gradients = types.MethodType(clip_fp32_gradients, engine)
    return True


def trainable(engine: Any) -> list[torch.nn.Parameter]:
    return [p for p in engine.module.parameters() if p.requires_grad and p.numel()]


def allreduce_gradients(engine: Any, bucket_size: int | None = None) -> None:
    """The mean of every rank's gradients, at the accumulation boundary: one flat buffer per
    dtype, all-reduced once in the engine's communication dtype (fp32 here), copied back with
    one multi-tensor copy."""
    if not engine.is_gradient_accumulation_boundary():
        return
    world = dist.get_world_size(engine.data_parallel_group)
    if world == 1:
        return
    params = trainable(engine)
    for p in params:
        if p.grad is None:  # every rank reduces the same layout (DeepSpeed does the same)
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        comm = flat.to(engine.communication_data_type)
        if engine.gradient_average:
            comm.div_(world)
        dist.all_reduce(comm, group=engine.data_parallel_group)
        torch._foreach_copy_(grads, _unflatten_dense_tensors(comm, grads))


def clip_fp32_gradients(engine: Any) -> None:
    """The global gradient norm clipped to ``gradient_clipping``, in foreach ops (no host sync)."""
    torch.nn.utils.clip_grad_norm_(trainable(engine), engine.gradient_clipping(), foreach=True)
