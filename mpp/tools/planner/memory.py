"""Memory per GPU: one micro-batch's activations measured on fake tensors, and the model states
and buffers DeepSpeed 0.19.8 holds per ZeRO stage, as ``mpp.parallel.ds_config`` configures it.

Activations come from the real objective's forward + backward under ``FakeTensorMode`` on device
cpu (no memory is allocated) with ``MemTracker``, in the dtype DeepSpeed's bf16 mode casts the
module to. The meta device would be wrong: the CPU flash kernel's fake saves a (B, H, L)
log-sum-exp, where meta's math path keeps the (B, H, L, L) attention scores.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

# CUDA context (~0.5 GiB with torch's kernels loaded), NCCL's channel buffers and cuBLAS
# workspaces: a stated allowance, not a measurement (this project has no GPU)
FIXED_MARGIN_BYTES = 2 * 2**30
FRAGMENTATION = 0.05  # share of the rest lost to the caching allocator's fragmentation

# DeepSpeed 0.19.8's defaults where the config leaves them unset (deepspeed/runtime/zero/config.py)
DS_DEFAULTS = {
    "reduce_bucket_size": int(5e8),
    "prefetch_bucket_size": int(5e7),
    "param_persistence_threshold": int(1e5),
    "overlap_comm": False,
}


class PeakTracker(MemTracker):
    """``MemTracker`` for a whole training step, with two changes. It hooks the gradient of
    every parameter a module owns, and registering a hook on a frozen one raises (HPM's teacher):
    frozen parameters get none. Its per-module peaks deep-copy a snapshot for every active module
    at every op (10 s for one ViT-H step): only the global peak is kept."""

    def _track_module_params_and_buffers(
        self, module: nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for p in module.parameters():
                if p.requires_grad and p not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[p] = (
                        p.register_hook(self._grad_hook),
                        p.register_post_accumulate_grad_hook(lambda q: self._grad_hook(q.grad)),
                    )
        return sizes

    def _grad_hook(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    def _update_peak_stats(self, peak_state: Any) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)

    def peak_activation_bytes(self) -> int:
        """At the step's peak: everything but parameters, buffers and gradients (the model
        states, which DeepSpeed holds in its own buffers and are counted by ``model_states``)."""
        snap = next(iter(self.get_tracker_snapshot("peak").values()), {})
        held = sum(
            snap.get(k, 0) for k in (_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.GRAD)
        )
        return snap.get("Total", 0) - held


def materialize(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A module built on the meta device given parameters and floating buffers of ``dtype`` on
    cpu, in the active mode (fake: nothing allocated), as ``module.to(dtype)`` would (``.to``
    itself cannot swap fake tensors in). Shared parameters stay shared."""
    made: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                if id(p) not in made:
                    data = torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype)
                    made[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
                m._parameters[name] = made[id(p)]
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = torch.zeros(
                    b.shape, dtype=dtype if b.is_floating_point() else b.dtype
                )
    return module


def zero_settings(ds_config: dict[str, Any]) -> dict[str, Any]:
    """The ZeRO keys the memory terms depend on, DeepSpeed's defaults filled in."""
    zero = ds_config.get("zero_optimization") or {}
    settings = {k: zero.get(k, v) for k, v in DS_DEFAULTS.items()}
    settings["param_persistence_threshold"] = zero.get(
        "stage3_param_persistence_threshold", settings["param_persistence_threshold"]
    )
    settings["prefetch_bucket_size"] = zero.get(
        "stage3_prefetch_bucket_size", settings["prefetch_bucket_size"]
    )
    settings["stage"] = zero.get("stage", 0)
    settings["overlap_comm"] = zero.get("overlap_comm", settings["stage"] == 3)
    return settings


def weight_bytes(precision: str) -> int:
    """Bytes of a weight (and its gradient) in the module: 4 where the weights stay fp32 (fp32, and
    bf16-autocast, which casts them per op), 2 in DeepSpeed's bf16 and fp16 modes."""
    return 4 if precision in ("fp32", "bf16-autocast") else 2


def model_states(
    trainable: list[int],
    frozen: list[int],
    ranks: int,
    ds_config: dict[str, Any],
    precision: str,
    ema: bool = False,
) -> dict[str, float]:
    """Bytes per rank, itemised, of the parameters, gradients, optimiser states (torch Adam/AdamW)
    and DeepSpeed's buffers, for parameter sizes ``trainable`` and ``frozen`` (fixed position
    embeddings; HPM's teacher, with an ``ema``).

    bf16/fp16 (a low-precision copy of w = 2 bytes beside fp32 masters), per trainable parameter,
    as measured on a real engine under a fake process group (tests/test_plan_gpu.py):
      stage 0: w params + w grads + 4 fp32 master + 4 fp32 grads + 8 Adam moments (DeepSpeed's
               unfused optimiser; nothing partitioned);
      stages 1, 2: w params + 16/N (fp32 master, fp32 gradient partition, moments); the w
               gradients pass through the reduce buckets (a parameter larger than a bucket would
               hold its own: none in a ViT at the 5e7 buckets ``mpp.parallel.ds_config`` sets);
      stage 3: (w + 16)/N (also the fp32 accumulation partition) + either the optimiser's fp32
               gradient partition (4/N, at the step) or the gathered parameters (one prefetch
               bucket, in forward and backward), whichever is larger, + the small persistent ones.
    fp32 and bf16-autocast (fp32 weights): the same without the master copy and with 4-byte
    gradients.
    Buffers: two reduce buckets of w bytes per element at stages 1/2 with overlap_comm (one
    without); one fp32 bucket at stage 3. Frozen parameters: their w copy (partitioned at stage
    3); with ``ema`` also the fp32 average beside a low-precision teacher (``mpp.parallel.ema``)."""
    z, n = zero_settings(ds_config), ranks
    w = weight_bytes(precision)
    P, F = sum(trainable), sum(frozen)
    opt = 16 if w == 2 else 12  # fp32 master (mixed precision only), fp32 gradient, moments
    stage = z["stage"]
    out = {"params": w * P, "grads": 0.0, "optimizer": float(opt * P), "buffers": 0.0}
    if stage == 0:
        out["grads"] = float(w * P) if w == 2 else 0.0
    elif stage in (1, 2):
        out["optimizer"] = opt * P / n
    else:
        small = sum(s for s in trainable if s < z["param_persistence_threshold"])
        gathered = min(P - small, z["prefetch_bucket_size"])
        out.update(params=w * P / n + w * small, optimizer=opt * P / n)
        out["grads"] = max(4 * P / n, float(w * gathered))
    if stage in (1, 2):
        out["buffers"] = float((2 if z["overlap_comm"] else 1) * z["reduce_bucket_size"] * w)
    elif stage == 3:
        out["buffers"] = float(z["reduce_bucket_size"] * 4)
    out["frozen"] = (w * F + (4 * F if ema and w < 4 else 0)) / (n if stage == 3 else 1)
    out["total"] = sum(out.values())
    return out


def peak_bytes(activations: float, states: dict[str, float]) -> dict[str, float]:
    """Activations + model states + the stated margin (CUDA context, NCCL, fragmentation)."""
    body = activations + states["total"]
    margin = FIXED_MARGIN_BYTES + FRAGMENTATION * body
    return {
        "activations": activations,
        "model_states": states["total"],
        "margin": margin,
        "peak": body + margin,
    }
