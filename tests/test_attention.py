import sys

import pytest
import torch

from mpp.models.attention import (
    ATTN_BACKENDS,
    Attention,
    attention,
    resolve_backend,
    xformers_refusal,
)


def _qkv(B, N, H, hd, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, N, H, hd, generator=g, dtype=torch.float32, requires_grad=True)
        for _ in range(3)
    ]


@pytest.mark.parametrize("N", [197, 1025])
def test_sdpa_matches_math_forward_and_backward(N):
    q, k, v = _qkv(2, N, 3, 32)
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out_math = attention(q, k, v, "math")
    out_sdpa = attention(q2, k2, v2, "sdpa")
    assert out_sdpa.shape == (2, N, 3, 32)
    torch.testing.assert_close(out_sdpa, out_math, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out_math)
    out_math.backward(grad)
    out_sdpa.backward(grad)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-5)


def test_math_is_the_textbook_formula():
    q, k, v = (t.detach() for t in _qkv(1, 5, 2, 4))
    out = attention(q, k, v, "math")
    for h in range(2):
        qh, kh, vh = q[0, :, h], k[0, :, h], v[0, :, h]  # (N, hd)
        ref = torch.softmax(qh @ kh.T / 2.0, dim=-1) @ vh  # sqrt(4) = 2
        torch.testing.assert_close(out[0, :, h], ref, atol=1e-6, rtol=1e-6)


def test_attention_module_backends_agree():
    torch.manual_seed(0)
    x = torch.randn(2, 17, 48)
    outs = {}
    for backend in ("math", "sdpa", "auto"):
        torch.manual_seed(1)
        m = Attention(48, 4, attn_backend=backend)
        outs[backend] = m(x)
    torch.testing.assert_close(outs["sdpa"], outs["math"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["auto"], outs["sdpa"])


def test_auto_resolves_to_sdpa_on_cpu():
    assert resolve_backend("auto", torch.device("cpu")) == "sdpa"


def test_forcing_xformers_on_cpu_is_a_clear_error():
    m = Attention(32, 2, attn_backend="xformers")
    with pytest.raises(RuntimeError, match="xformers.*CUDA"):
        m(torch.randn(1, 4, 32))


def test_unknown_backend_names_the_allowed_ones():
    with pytest.raises(ValueError, match="flash.*allowed"):
        Attention(32, 2, attn_backend="flash")
    assert set(ATTN_BACKENDS) == {"auto", "xformers", "sdpa", "math"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="xformers runs on CUDA only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [50, 197, 257])
def test_xformers_matches_sdpa_on_cuda_forward_and_backward(
    dtype, N
):  # runs on a GPU machine, not in CI
    """On the model's own strided views (``qkv.reshape(B, N, 3, H, hd).unbind(2)``), both passes.
    An install whose xformers has no kernel (a wheel built for another torch: `mpp doctor` warns)
    skips, saying why."""
    refused = xformers_refusal(dtype, 64, torch.device("cuda"))
    if refused:
        pytest.skip(f"xformers {refused}")
    qkv = torch.randn(2, N, 3 * 12 * 64, device="cuda", dtype=dtype)
    grads = []
    for backend in ("xformers", "sdpa"):
        x = qkv.detach().clone().requires_grad_(True)
        q, k, v = x.reshape(2, N, 3, 12, 64).unbind(2)  # (B, N, H, hd), not contiguous
        out = attention(q, k, v, backend)
        out.backward(torch.ones_like(out))
        grads.append((out.detach(), x.grad))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_auto_falls_back_to_sdpa_where_xformers_has_no_kernel(monkeypatch, caplog):
    """xformers' dispatcher raises NotImplementedError ("No operator found") for inputs none of
    its kernels take: ``auto`` runs SDPA with one warning, an explicit ``xformers`` still raises."""
    attn = sys.modules[
        attention.__module__
    ]  # the module (mpp.models exports the function by its name)
    calls = []

    class NoKernel:
        @staticmethod
        def memory_efficient_attention(q, k, v, p=0.0):
            calls.append(q.shape)
            raise NotImplementedError("No operator found for `memory_efficient_attention_forward`")

    monkeypatch.setattr(attn, "_xformers_ops", lambda: (NoKernel, ""))
    monkeypatch.setattr(attn, "_XFORMERS_REFUSED", set())
    q, k, v = _qkv(2, 50, 2, 8)
    with pytest.raises(NotImplementedError):
        attention(q, k, v, "xformers")
    with caplog.at_level("WARNING", logger="mpp.models.attention"):
        for _ in range(2):
            torch.testing.assert_close(
                attention(q, k, v, "xformers", fallback=True), attention(q, k, v, "sdpa")
            )
    assert len(calls) == 2  # the refused shape is not tried again
    assert "xformers has no kernel" in caplog.text


def test_xformers_refusal_says_why_it_cannot_run_here():
    """What the gpu-step suite and the CUDA parity test ask before they time or compare xformers."""
    assert xformers_refusal(torch.float32, 64, torch.device("cpu")) == "no CPU kernels (device cpu)"
