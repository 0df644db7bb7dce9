"""Attention alone on a GPU: xformers' ``memory_efficient_attention`` against PyTorch's SDPA at
the encoder's and the decoders' shapes (forward + backward, bf16), and which xformers operator
its dispatcher picked, so that BENCHMARKS can say which kernel ran.

    python benchmarks/attention_gpu.py [--out attention.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from mpp.models.attention import attention, xformers_refusal

# (name, batch, tokens, heads, head width): ViT-B/16 at 224 px (197 tokens; MAE's encoder sees
# 50 of them) and MAE's 8-layer 512-wide decoder (16 heads of 32)
SHAPES = [
    ("vit-b full", 128, 197, 12, 64),
    ("mae encoder", 128, 50, 12, 64),
    ("mae decoder", 128, 197, 16, 32),
]


def time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def row(name: str, b: int, n: int, h: int, hd: int) -> dict:
    qkv = torch.randn(b, n, 3 * h * hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = {"shape": name, "B": b, "N": n, "H": h, "hd": hd}
    refused = xformers_refusal(torch.bfloat16, hd, torch.device("cuda"))
    backends = ["sdpa"] + ([] if refused else ["xformers"])
    if refused:
        out["xformers"] = f"refused: {refused}"
    else:
        import xformers.ops.fmha as fmha

        q, k, v = qkv.detach().reshape(b, n, 3, h, hd).unbind(2)
        inp = fmha.Inputs(query=q, key=k, value=v)
        out["xformers_fw_op"] = fmha._dispatch_fw(inp, True).NAME
        out["xformers_bw_op"] = fmha._dispatch_bw(inp, None).NAME
    for backend in backends:

        def step(backend=backend):
            q, k, v = qkv.reshape(b, n, 3, h, hd).unbind(2)
            attention(q, k, v, backend).sum().backward()

        out[f"{backend}_ms"] = round(time_ms(step), 4)
    if "xformers_ms" in out:
        out["xformers_over_sdpa"] = round(out["xformers_ms"] / out["sdpa_ms"], 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import xformers

    rows = [row(*s) for s in SHAPES]
    result = {
        "torch": torch.__version__,
        "xformers": xformers.__version__,
        "device": torch.cuda.get_device_name(),
        "rows": rows,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
