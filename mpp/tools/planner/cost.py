"""Time per step on a GPU, bounded from below: FLOPs and bytes of every op of one training step
(counted on fake tensors), the spec sheet's peaks (``mpp.tools.planner.hardware``), and the bytes ZeRO
moves between ranks.

FLOPs follow ``torch.utils.flop_counter`` (matmuls, convolutions, attention; 2 per
multiply-add), the convention of ``mpp.tools.flops.step_flops``. Its registry has no entry
for the CPU flash-attention kernel that SDPA dispatches to on fake cpu tensors: it is mapped to
the SDPA counts here.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

from mpp.tools.planner.hardware import GPU, ring_bytes_per_s
from mpp.tools.planner.memory import weight_bytes

aten = torch.ops.aten


def _cpu_flash(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}
FLOP_FORMULAS = {**flop_registry, **{op: shape_wrapper(f) for op, f in CPU_ATTENTION.items()}}
# ops that move no data: views, aliases and allocations whose bytes the next op writes
NO_TRAFFIC = {
    aten.detach,
    aten.alias,
    aten.empty,
    aten.empty_like,
    aten.empty_strided,
    aten.lift_fresh,
}


def flop_counter() -> FlopCounterMode:
    """``FlopCounterMode`` that also counts the CPU flash-attention kernel (fake cpu tensors)."""
    return FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION)


def _nbytes(tree: Any) -> int:
    leaves, _ = tree_flatten(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class OpCosts(TorchDispatchMode):
    """Per op call: (FLOPs, bytes read + written), counted as a multiset. Bytes are every tensor
    argument and result once (no cache reuse: a lower bound on time needs no better)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[tuple[int, int]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet, written = func.overloadpacket, _nbytes(out)
        # not written: metadata (prim.device)
        if func.is_view or packet in NO_TRAFFIC or not written:
            return out
        flops = (
            FLOP_FORMULAS[packet](*args, **kwargs, out_val=out) if packet in FLOP_FORMULAS else 0
        )
        self.calls[(int(flops), _nbytes(args) + _nbytes(kwargs) + written)] += 1
        return out


def roofline(calls: list[tuple[int, int, int]], images: int, spec: GPU) -> dict[str, float]:
    """Seconds per image on ``spec`` from op calls (flops, bytes, count) measured on ``images``
    images: all FLOPs at the peak, all bytes at the HBM bandwidth, and per op the slower of the
    two, summed (a kernel cannot beat either roof)."""
    flops = sum(f * n for f, _, n in calls)
    traffic = sum(b * n for _, b, n in calls)
    per_op = sum(n * max(f / spec.bf16_flops, b / spec.hbm_bytes_per_s) for f, b, n in calls)
    return {
        "compute_s": flops / spec.bf16_flops / images,
        "memory_s": traffic / spec.hbm_bytes_per_s / images,
        "roofline_s": per_op / images,
        "bytes": traffic / images,
    }


def comm_bytes(
    trainable: int, frozen: int, ranks: int, stage: int, accum: int, precision: str
) -> dict[str, Any]:
    """Bytes each rank sends per optimiser step, by collective, with ring formulas: all-reduce
    2(N-1)/N of the buffer, reduce-scatter and all-gather (N-1)/N. Gradients are reduced in fp32
    (``mpp.parallel.ds_config`` sets communication_data_type), parameters gathered in the model's dtype.
    The collectives are DeepSpeed 0.19.8's as its comms_logger records them (tests/test_plan_gpu.py):
    ZeRO-0 and ZeRO-1 all-reduce the gradients once per step, at the accumulation boundary; ZeRO-2
    all-reduces them in the backward of every micro-batch; ZeRO-3 reduce-scatters them every
    micro-batch; ZeRO-1/2 all-gather the updated parameters after the step; ZeRO-3 gathers them
    in every forward and backward (HPM's teacher: its forward)."""
    n, w = ranks, weight_bytes(precision)
    share = (n - 1) / n
    grads, params = 4 * trainable, w * trainable
    if n == 1:
        ops: dict[str, float] = {}
    elif stage == 0:
        ops = {"all_reduce grads": 2 * share * grads}
    elif stage in (1, 2):
        reductions = 1 if stage == 1 else accum
        ops = {
            "all_reduce grads": reductions * 2 * share * grads,
            "all_gather params": share * params,
        }
    else:
        ops = {
            "reduce_scatter grads": accum * share * grads,
            "all_gather params (fwd + bwd)": accum * 2 * share * params,
            "all_gather teacher (fwd)": accum * share * w * frozen,
        }
    return {"ops": ops, "total": sum(ops.values())}


def comm_seconds(total_bytes: float, ranks: int, spec: GPU) -> float:
    """The ring's time at its slowest link's bandwidth (NVLink in a node, the NIC across nodes)."""
    return total_bytes / ring_bytes_per_s(spec, ranks)
