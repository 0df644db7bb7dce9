"""An exponential moving average of one set of parameters into another (HPM's teacher) over modules
ZeRO may have partitioned: each rank updates the part it holds, never gathering a whole parameter
(docs/ARCHITECTURE.md §4.4)."""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from mpp.parallel import zero

log = logging.getLogger(__name__)


class EMA:
    """theta_t <- m theta_t + (1 - m) theta_s, one batched lerp over this rank's tensors; ``pairs``:
    (target, source) names in ``module``. In bf16/fp16 the average is kept in fp32 beside the
    parameters (docs/ARCHITECTURE.md §4.4) and copied into them; ``rank_state`` hands it to a
    checkpoint."""

    def __init__(self, module: nn.Module, pairs: list[tuple[str, str]]) -> None:
        self.module, self.pairs = module, pairs
        self.reset()

    def reset(self) -> None:
        """Forget the parameter objects and the fp32 state: call it after a state-dict load,
        which may assign new Parameters and replaces the averaged weights."""
        self._params: list[tuple[nn.Parameter, nn.Parameter]] | None = None
        self.fp32: list[Tensor] | None = None

    def _params_now(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        # looked up at the first use: after the engine has wrapped (and partitioned) the module
        if self._params is None:
            get = self.module.get_parameter
            self._params = [(get(t), get(s)) for t, s in self.pairs]
        return self._params

    def local_tensors(self) -> tuple[list[Tensor], list[Tensor]]:
        """(target, source) tensors this rank holds, paired."""
        targets, sources = [], []
        for t, s in self._params_now():
            targets += zero.local_tensors(t)
            sources += zero.local_tensors(s)
        return targets, sources

    @torch.no_grad()
    def update(self, momentum: float) -> None:
        targets, sources = self.local_tensors()
        weight = 1.0 - momentum
        if all(t.dtype == torch.float32 for t in targets):
            torch._foreach_lerp_(targets, sources, weight)
            return
        if self.fp32 is None or len(self.fp32) != len(targets):
            self.fp32 = [t.float() for t in targets]
        torch._foreach_lerp_(self.fp32, [s.float() for s in sources], weight)
        torch._foreach_copy_(targets, self.fp32)

    def rank_state(self) -> dict[str, Tensor]:
        """The fp32 average (low-precision params only): rounding it to the params' bf16 on
        resume would perturb them once per restart. Under ZeRO-3 each rank's shard; otherwise
        every rank's copy is the same and rank 0 returns it."""
        if self.fp32 is None:
            return {}
        dist = torch.distributed
        partitioned = any(zero.is_partitioned(t) for t, _ in self._params_now())
        if not partitioned and dist.is_initialized() and dist.get_rank() != 0:
            return {}
        return {f"ema_fp32.{i}": t for i, t in enumerate(self.fp32)}

    def load_rank_state(self, state: dict[str, Tensor]) -> None:
        targets, _ = self.local_tensors()
        if not state or all(t.dtype == torch.float32 for t in targets):
            return  # nothing saved, or fp32 params are their own average
        saved = [state.get(f"ema_fp32.{i}") for i in range(len(targets))]
        if len(state) != len(targets) or any(
            s is None or s.shape != t.shape for s, t in zip(saved, targets, strict=True)
        ):
            log.warning(
                "ema: the checkpoint's fp32 average does not match these parameters (another world size "
                "under ZeRO-3?): it restarts from the %s weights",
                targets[0].dtype,
            )
            return
        self.fp32 = [s.to(t.device, torch.float32) for s, t in zip(saved, targets, strict=True)]
