"""Multi-head self-attention with switchable kernels (``attn_backend``: auto, xformers, sdpa, math),
the tensors kept in (B, N, H, hd) (docs/ARCHITECTURE.md §4.1)."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

ATTN_BACKENDS = ("auto", "xformers", "sdpa", "math")


@functools.lru_cache(maxsize=1)
def _xformers_ops():
    """Import xformers.ops once, lazily: on CPU-only machines its import warns about missing
    CUDA extensions, so only pay for it when a CUDA tensor asks. Returns (ops or None, reason)."""
    try:
        import xformers.ops as xops
    except Exception as e:  # ImportError, or a broken build raising anything at import
        return None, f"{type(e).__name__}: {e}"
    return xops, ""


@functools.cache
def _log_once(requested: str, resolved: str, device_type: str, why: str = "") -> None:
    msg = f"attention backend: {resolved} (requested {requested}, device {device_type})"
    if why:
        log.warning(msg + f"; {why}")
    else:  # a training run's summary says it (mpp.train.summary); a fallback is warned
        log.debug(msg)


def resolve_backend(requested: str, device: torch.device) -> str:
    """The kernel a forward on ``device`` runs for ``requested``; logged once per combination."""
    if requested not in ATTN_BACKENDS:
        raise ValueError(f"unknown attn_backend {requested!r}; allowed: {ATTN_BACKENDS}")
    dev = device.type
    resolved, why = ("sdpa" if requested == "auto" else requested), ""
    if requested == "xformers":
        if dev != "cuda":
            raise RuntimeError(
                f"attn_backend='xformers' needs CUDA tensors (got {dev}): xformers has no CPU kernels; "
                "use 'auto' or 'sdpa'"
            )
        ops, err = _xformers_ops()
        if ops is None:
            raise RuntimeError(f"attn_backend='xformers' but xformers cannot be imported ({err})")
    elif requested == "auto" and dev == "cuda":
        ops, err = _xformers_ops()
        if ops is not None:
            resolved = "xformers"
        else:
            why = f"xformers unavailable ({err}), falling back to sdpa"
    # a logger call would break torch.compile's graph at every block
    if not torch.compiler.is_compiling():
        _log_once(requested, resolved, dev, why)
    return resolved


def xformers_refusal(dtype: torch.dtype, head_dim: int, device: torch.device) -> str:
    """Why xformers cannot run attention on ``device`` for ``dtype`` and ``head_dim`` (one tiny
    forward, as its dispatcher decides: a wheel built for another torch imports yet has no
    kernel), or "" where it can."""
    if device.type != "cuda":
        return f"no CPU kernels (device {device.type})"
    ops, why = _xformers_ops()
    if ops is None:
        return f"cannot be imported ({why})"
    q = torch.zeros(1, 8, 1, head_dim, dtype=dtype, device=device)
    try:
        ops.memory_efficient_attention(q, q, q)
    except NotImplementedError as e:
        return f"no kernel for ({dtype}, head_dim {head_dim}): {str(e)[:300]}"
    return ""


_XFORMERS_REFUSED: set[tuple] = set()  # (dtype, head_dim, device) xformers found no kernel for


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    backend: str = "sdpa",
    dropout_p: float = 0.0,
    fallback: bool = False,
) -> Tensor:
    """softmax(q k^T / sqrt(d)) v for (B, N, H, hd) inputs -> (B, N, H, hd), on a resolved backend.
    ``fallback`` (``auto``): inputs xformers has no kernel for run on SDPA, with one warning."""
    if backend == "xformers":
        key = (q.dtype, q.shape[-1], q.device)
        if key not in _XFORMERS_REFUSED:
            xops, _ = _xformers_ops()
            try:
                return xops.memory_efficient_attention(q, k, v, p=dropout_p)
            except NotImplementedError as e:  # its dispatcher: "No operator found for ..."
                if not fallback:
                    raise
                _XFORMERS_REFUSED.add(key)
                _log_once(
                    "auto",
                    "sdpa",
                    q.device.type,
                    f"xformers has no kernel for {key[:2]}: {str(e)[:200]}",
                )
        backend = "sdpa"
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, N, hd)
    if backend == "sdpa":
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    elif backend == "math":
        attn = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (B, H, N, N)
        attn = attn.softmax(dim=-1)
        if dropout_p > 0.0:
            attn = F.dropout(attn, p=dropout_p)
        out = attn @ v
    else:
        raise ValueError(f"attention() needs a resolved backend, got {backend!r}")
    return out.transpose(1, 2)


class Attention(nn.Module):
    """timm-named self-attention: ``qkv`` then ``proj``."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        attn_backend: str = "auto",
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed dim {dim} is not divisible by num_heads {num_heads}")
        if attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"unknown attn_backend {attn_backend!r}; allowed: {ATTN_BACKENDS}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_backend = attn_backend
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        # (B, N, H, hd)
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).unbind(2)
        backend = resolve_backend(self.attn_backend, x.device)
        x = attention(
            q, k, v, backend, self.attn_drop if self.training else 0.0, self.attn_backend == "auto"
        )
        return self.proj_drop(self.proj(x.reshape(B, N, C)))
