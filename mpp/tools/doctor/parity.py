"""The doctor's attention rows: every kernel against ``math`` (fp32 and bf16, forward and backward,
N = 50, 197, 257, with and without a key mask), the backend ``auto`` picks and the fastest
(docs/ARCHITECTURE.md §4.1). The reference is the same computation in float64 from the same
(rounded) inputs, so only the kernel's own error counts."""

from __future__ import annotations

from collections.abc import Callable
from statistics import median

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from mpp.models.attention import _xformers_ops, attention, resolve_backend
from mpp.tools.doctor import FAIL, PASS, WARN, Row, needs_gpu
from mpp.tools.measure import interleaved_times

SECTION = "attention"
# 7x7+1 (ViT-B/32 at 224), 14x14+1 (ViT-B/16 at 224), 16x16+1 (ViT-L/14 at 224)
SEQ_LENS = (50, 197, 257)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# max |error| / max |reference| a correct kernel stays under: fp32 only sums in another order
# (measured ~1e-6 on CPU), bf16 rounds products and the output to 8 bits of mantissa (~4e-3)
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}
SDPA_KERNELS = {
    "sdpa math": SDPBackend.MATH,
    "sdpa flash": SDPBackend.FLASH_ATTENTION,  # on CPU: _scaled_dot_product_flash_attention_for_cpu
    "sdpa efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa cudnn": SDPBackend.CUDNN_ATTENTION,
}
CPU_KERNELS = ("sdpa math", "sdpa flash", "mpp sdpa")  # CPU SDPA has no efficient or cuDNN kernel
# (q, k, v in (B, N, H, hd), keep: (B, N) bool key mask or None) -> out (B, N, H, hd)
Kernel = Callable[[Tensor, Tensor, Tensor, "Tensor | None"], Tensor]


class NoKernel(Exception):
    """This kernel has no implementation for these inputs (dtype, mask, device): not a wrong result."""


def sdpa_with(backend: SDPBackend) -> Kernel:
    def run(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None) -> Tensor:
        mask = None if keep is None else keep[:, None, None, :]  # (B, 1, 1, N): True = attend
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
            )
        return out.transpose(1, 2)

    return run


def project_sdpa(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None) -> Tensor:
    """The model's own call (``attn_backend: sdpa``): the dispatcher picks the kernel; no mask API."""
    if keep is not None:
        raise NoKernel("no mask argument: the ViT attends to every token")
    return attention(q, k, v, "sdpa")


def xformers_kernel(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None) -> Tensor:
    xops, why = _xformers_ops()
    if xops is None:
        raise NoKernel(f"xformers cannot be imported ({why})")
    bias = None
    # an additive (B, H, N, N) bias, its rows 8-aligned in memory as xformers asks
    if keep is not None:
        B, N, H, _ = q.shape
        pad = -(-N // 8) * 8
        bias = torch.zeros(B, H, N, pad, dtype=q.dtype, device=q.device)[..., :N]
        bias.masked_fill_(~keep[:, None, None, :], float("-inf"))
    return xops.memory_efficient_attention(q, k, v, attn_bias=bias)


KERNELS: dict[str, Kernel] = {
    **{n: sdpa_with(b) for n, b in SDPA_KERNELS.items()},
    "mpp sdpa": project_sdpa,
    "xformers": xformers_kernel,
}


def reference(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None) -> Tensor:
    """The project's ``math`` backend; with a mask (which it has no argument for), the same
    softmax(q k^T / sqrt(d)) v with the masked keys' scores at -inf."""
    if keep is None:
        return attention(q, k, v, "math")
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, N, hd)
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (B, H, N, N)
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def relative_error(out: Tensor, ref: Tensor) -> float:
    """max |out - ref| / max |ref|: the error on the scale of the values."""
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def case_errors(
    kernel: Kernel,
    n: int,
    dtype: torch.dtype,
    masked: bool,
    device: torch.device,
    shape: tuple[int, int, int] = (2, 4, 64),
) -> dict[str, float]:
    """Forward and backward (d qkv) error of ``kernel`` against the float64 reference, one case."""
    B, H, hd = shape
    gen = torch.Generator().manual_seed(n)
    qkv = torch.randn(B, n, 3, H, hd, generator=gen).to(device, dtype).requires_grad_()
    keep = None
    if masked:  # the last fifth of the keys hidden from every query of the second image
        keep = torch.ones(B, n, dtype=torch.bool, device=device)
        keep[-1, -(n // 5) :] = False
    grad_out = torch.randn(B, n, H, hd, generator=gen).to(device, dtype)
    try:
        out = kernel(*qkv.unbind(2), keep)
        out.backward(grad_out)
    except NotImplementedError as e:  # xformers' dispatcher: "No operator found for ..."
        raise NoKernel(str(e)) from None
    except RuntimeError as e:
        if "No available kernel" in str(e) or "No viable backend" in str(e):
            raise NoKernel(str(e)) from None
        raise
    qkv64 = qkv.detach().double().requires_grad_()
    ref = reference(*qkv64.unbind(2), keep)
    ref.backward(grad_out.double())
    return {"fwd": relative_error(out, ref), "bwd": relative_error(qkv.grad, qkv64.grad)}


def parity_row(
    name: str, kernel: Kernel, dtype_name: str, device: torch.device, shape=(2, 4, 64)
) -> Row:
    """``kernel`` over every N, with and without a mask: fail above TOLERANCE or on a crash."""
    tol, cases, missing = TOLERANCE[dtype_name], [], []
    for n in SEQ_LENS:
        for masked in (False, True):
            case = {"n": n, "masked": masked}
            try:
                case.update(case_errors(kernel, n, DTYPES[dtype_name], masked, device, shape))
            except NoKernel as e:
                case["no_kernel"] = str(e).strip().splitlines()[0][:160]
                missing.append(f"N={n}{' masked' if masked else ''}")  # the reason: in the case
            except Exception as e:  # a kernel that crashes on inputs it claims: a failure, named
                case["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
            cases.append(case)
    return verdict_of(name, dtype_name, cases, tol, missing)


def verdict_of(
    name: str, dtype_name: str, cases: list[dict], tol: float, missing: list[str]
) -> Row:
    ran = [c for c in cases if "fwd" in c]
    errors = [c for c in cases if "error" in c]
    worst = {k: max((c[k] for c in ran), default=0.0) for k in ("fwd", "bwd")}
    values = {
        "dtype": dtype_name,
        "tolerance": tol,
        "worst_fwd": worst["fwd"],
        "worst_bwd": worst["bwd"],
        "cases": cases,
    }
    check = f"{name} {dtype_name}"
    if errors:
        c = errors[0]
        return Row(
            SECTION,
            check,
            FAIL,
            f"crashed at N={c['n']}{' masked' if c['masked'] else ''}: {c['error']}",
            values,
        )
    if not ran:
        return Row(
            SECTION, check, WARN, f"no kernel for any case here: {cases[0]['no_kernel']}", values
        )
    bad = [c for c in ran if max(c["fwd"], c["bwd"]) > tol]
    reason = f"max rel. error fwd {worst['fwd']:.1e}, bwd {worst['bwd']:.1e} over {len(ran)} cases (tolerance {tol:.0e})"
    if missing:
        why = next(c["no_kernel"] for c in cases if "no_kernel" in c)
        every_masked = len(missing) == len(SEQ_LENS) and all(m.endswith(" masked") for m in missing)
        reason += f"; n/a: {'with a mask' if every_masked else ', '.join(missing)} ({why})"
    if bad:
        c = bad[0]
        where = f"N={c['n']}{' masked' if c['masked'] else ''}"
        return Row(
            SECTION,
            check,
            FAIL,
            f"wrong result at {where}: fwd {c['fwd']:.1e}, bwd {c['bwd']:.1e} > {tol:.0e}",
            values,
        )
    return Row(SECTION, check, PASS, reason, values)


def parity_rows(device: torch.device) -> list[Row]:
    """A row per kernel and dtype; the CUDA-only ones say "needs a GPU" on a CPU."""
    shape = (4, 12, 64) if device.type == "cuda" else (2, 4, 64)  # ViT-B's 12 heads of 64 on a GPU
    rows = []
    for name, kernel in KERNELS.items():
        for dtype_name in DTYPES:
            if device.type != "cuda" and name not in CPU_KERNELS:
                rows.append(
                    needs_gpu(
                        SECTION, f"{name} {dtype_name}", "compares this CUDA kernel with mpp's math"
                    )
                )
            else:
                rows.append(parity_row(name, kernel, dtype_name, device, shape))
    return rows


def speed_row(device: torch.device, quick: bool = False) -> Row:
    """fwd + bwd time at N = 197 of each backend ``attn_backend`` can name (and, on a GPU, of
    each SDPA kernel), in the training precision; ``auto``'s pick against the fastest backend."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    B, H, hd = (128, 12, 64) if cuda else (4, 12, 64)  # a ViT-B micro batch on a GPU
    qkv = torch.randn(B, 197, 3, H, hd, device=device, dtype=dtype, requires_grad=True)
    backends = ["sdpa", "math"] + (["xformers"] if cuda and _xformers_ops()[0] is not None else [])
    kernels = {
        name: _as_backend(kernel)
        for name, kernel in KERNELS.items()
        if cuda and name.startswith("sdpa ")
    }
    contenders = {name: _as_backend(name) for name in backends} | kernels
    steps = {}
    for name, fn in contenders.items():

        def fwd_bwd(fn=fn) -> None:
            fn(*qkv.unbind(2)).sum().backward()

        try:  # one with no kernel for these inputs is left out of the race
            fwd_bwd()
        except (RuntimeError, NotImplementedError):
            continue
        steps[name] = fwd_bwd
    times = {
        n: median(t) for n, t in interleaved_times(steps, 3 if quick else 10, 1, device).items()
    }
    picked = resolve_backend("auto", device)
    # the model's auto falls back to sdpa where xformers has no kernel (mpp.models.attention)
    auto = picked if picked in times else "sdpa"
    fastest = min((n for n in times if n in backends), key=times.get)
    values = {
        "dtype": str(dtype).removeprefix("torch."),
        "shape": [B, 197, H, hd],
        "auto": auto,
        "fastest": fastest,
        "ms": {n: 1e3 * t for n, t in times.items()},
    }
    reason = f"auto runs {auto} ({1e3 * times[auto]:.2f} ms fwd+bwd); fastest: {fastest} ({1e3 * times[fastest]:.2f} ms)"
    if auto != picked:
        reason += f"; {picked} had no kernel here"
    # within 10 %: closer figures are noise on a shared machine
    verdict = PASS if auto == picked and times[auto] <= 1.1 * times[fastest] else WARN
    return Row(SECTION, "auto vs fastest", verdict, reason, values)


def _as_backend(kernel: str | Kernel) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """(q, k, v) -> out: a backend name through the model's ``attention``, or a kernel unmasked."""
    if isinstance(kernel, str):
        return lambda q, k, v: attention(q, k, v, kernel)
    return lambda q, k, v: kernel(q, k, v, None)


def attention_rows(device: torch.device, quick: bool = False) -> list[Row]:
    return [*parity_rows(device), speed_row(device, quick)]
