"""LARS (You et al., 2017, arXiv:1708.03888) as MAE's linear probe uses it (MAE's util/lars.py):
momentum SGD whose update of each matrix is rescaled by the trust ratio eta * ||w|| / ||g||; biases
and other 1-D parameters (BatchNorm's, were it affine) take the plain momentum step."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def trust_ratio(param: Tensor, update: Tensor, eta: float) -> Tensor:
    """eta * ||w|| / ||update||, or 1 when either norm is 0 (a zero-initialised weight, or no
    gradient: MAE's torch.where guards)."""
    param_norm, update_norm = torch.linalg.vector_norm(param), torch.linalg.vector_norm(update)
    one = torch.ones_like(param_norm)
    return torch.where(
        param_norm > 0, torch.where(update_norm > 0, eta * param_norm / update_norm, one), one
    )


class LARS(torch.optim.Optimizer):
    """Per step, for a parameter w with gradient g in a group (lr, weight_decay, momentum, eta):
    d = g + weight_decay * w, scaled by ``trust_ratio(w, d, eta)`` when w.ndim > 1;
    mu = momentum * mu + d; w -= lr * mu. MAE's probe: weight_decay 0, momentum 0.9, eta 0.001."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.0,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        trust_coefficient: float = 0.001,
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, trust_coefficient=trust_coefficient
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None) -> None:  # closure: the Optimizer signature; unused
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad
                # not a bias or a norm's gamma/beta: weight decay and the trust ratio
                if p.ndim > 1:
                    update = update.add(p, alpha=group["weight_decay"])
                    update = update.mul(trust_ratio(p, update, group["trust_coefficient"]))
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                mu.mul_(group["momentum"]).add_(update)
                p.add_(mu, alpha=-group["lr"])
