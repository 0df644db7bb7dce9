"""The doctor's environment rows: torch, CUDA / NCCL, bf16, the xformers wheel against this torch
and GPU, and the DeepSpeed ops a run here JIT-builds (docs/ARCHITECTURE.md §4.1)."""

from __future__ import annotations

import contextlib
import io
import platform
import subprocess
import sys

import torch

from mpp.tools.doctor import FAIL, PASS, WARN, Row, needs_gpu

SECTION = "environment"


def environment_rows() -> list[Row]:
    return [torch_row(), cuda_row(), bf16_row(), xformers_row(), deepspeed_ops_row()]


def torch_row() -> Row:
    values = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }
    return Row(
        SECTION,
        "torch",
        PASS,
        f"torch {torch.__version__}, Python {platform.python_version()}",
        values,
    )


def cuda_row() -> Row:
    if not torch.cuda.is_available():
        return needs_gpu(
            SECTION, "CUDA / NCCL / GPU", "reports the CUDA, cuDNN and NCCL versions and the GPU"
        )
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    values = {
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "nccl": nccl,
        "gpu": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "gpus": torch.cuda.device_count(),
    }
    reason = f"{values['gpus']} x {values['gpu']} (sm {values['capability']}), CUDA {values['cuda']}, NCCL {nccl}"
    return Row(SECTION, "CUDA / NCCL / GPU", PASS, reason, values)


def bf16_row() -> Row:
    if not torch.cuda.is_available():
        return needs_gpu(
            SECTION, "bf16", "checks the GPU computes in bf16 (precision auto is bf16 on CUDA)"
        )
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return Row(
            SECTION,
            "bf16",
            PASS,
            "native bf16: precision auto trains under bf16 autocast at ZeRO stage 0, in "
            "DeepSpeed's bf16 mode at stages 1-3",
        )
    return Row(
        SECTION,
        "bf16",
        FAIL,
        "no native bf16 on this GPU: set train.precision (fp16 diverges in MAE reports)",
    )


def parse_xformers_info(text: str) -> dict[str, str]:
    """``python -m xformers.info``'s ``key:   value`` lines as a dict."""
    info = {}
    for line in text.splitlines():
        key, sep, value = line.partition(": ")
        if sep and key and " " not in key.strip():
            info[key.strip()] = value.strip()
    return info


def built_cuda(info: dict[str, str]) -> str | None:
    """The CUDA the wheel was built with, as ``torch.version.cuda`` spells it (1208 -> "12.8")."""
    code = info.get("build.cuda_version", "")
    return f"{int(code) // 100}.{int(code) % 100}" if code.isdigit() else None


def xformers_build_problems(
    info: dict[str, str],
    torch_version: str,
    torch_cuda: str | None,
    python: str,
    capability: str | None,
) -> list[str]:
    """What in the wheel's build does not match this torch (and its CUDA), Python and GPU
    (sm ``capability``)."""
    problems = []
    built_torch = info.get("build.torch_version", "")
    if built_torch.split("+")[0] != torch_version.split("+")[0]:
        problems.append(f"torch {built_torch or '?'} (here {torch_version})")
    cuda = built_cuda(info)
    if cuda and cuda != torch_cuda:
        problems.append(f"CUDA {cuda} (here {torch_cuda or 'none: a CPU torch'})")
    built_py = info.get("build.python_version", "")
    if built_py.rsplit(".", 1)[0] != python.rsplit(".", 1)[0]:
        problems.append(f"Python {built_py or '?'} (here {python})")
    arch = info.get("build.env.TORCH_CUDA_ARCH_LIST", "")
    if capability and arch and capability not in arch.replace("+PTX", "").replace("a", "").split():
        problems.append(f"sm {arch} (this GPU: sm {capability})")
    return problems


def xformers_fix(info: dict[str, str]) -> str:
    """The pip command that installs the torch the wheel was built for, read off its build
    (2.10.0+cu128: torch==2.10.0 from PyTorch's cu128 index); xformers 0.0.35's where it has none."""
    version, _, tag = (info.get("build.torch_version") or "2.10.0+cu128").partition("+")
    cuda = built_cuda(info)
    tag = tag or (f"cu{cuda.replace('.', '')}" if cuda else "cu128")
    return f'pip install "torch=={version}" --index-url https://download.pytorch.org/whl/{tag}'


# xformers' kernels are CUDA's: on a machine without a GPU, PyTorch's SDPA is the path, and
# the wheel's torch would be the wrong advice (a CUDA torch on a CPU machine)
NO_GPU = (
    "no GPU here: attn_backend auto runs PyTorch's SDPA, the right path on a CPU (xformers' "
    "kernels are CUDA's)"
)


def xformers_row() -> Row:
    """The wheel's build (torch, Python, CUDA arches) against this machine, from its own report;
    on a machine without a GPU, that SDPA is the path (the build is kept in the row's values)."""
    gpu = torch.cuda.is_available()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "xformers.info"], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return Row(
            SECTION, "xformers wheel", WARN, "python -m xformers.info did not answer in 120 s"
        )
    info = parse_xformers_info(r.stdout)
    if r.returncode != 0 or "pytorch.version" not in info:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        if not gpu:
            return Row(SECTION, "xformers wheel", PASS, f"{NO_GPU}; not usable here: {tail}")
        return Row(
            SECTION, "xformers wheel", WARN, f"not usable ({tail}): attn_backend auto runs SDPA"
        )
    cap = ".".join(map(str, torch.cuda.get_device_capability())) if gpu else None
    problems = xformers_build_problems(
        info, torch.__version__, torch.version.cuda, platform.python_version(), cap
    )
    ops = {
        k.split(".", 1)[1]: v
        for k, v in info.items()
        if k.startswith("memory_efficient_attention.")
    }
    usable = [k for k, v in ops.items() if v == "available"]
    values = {
        "version": r.stdout.split("\n", 1)[0],
        "build": {k: v for k, v in info.items() if k.startswith("build.")},
        "attention_ops_available": usable,
    }
    if not gpu:  # the wheel's build said, for the GPU node; no command for this machine
        built = info.get("build.torch_version", "?")
        reason = (
            f"{NO_GPU}; the wheel is built for torch {built}, which the gpu extra installs on a "
            'GPU node (README, "GPU install")'
        )
        return Row(SECTION, "xformers wheel", PASS, reason, values)
    if not problems:
        return Row(
            SECTION,
            "xformers wheel",
            PASS,
            f"built for this torch and GPU; kernels: {', '.join(usable)}",
            values,
        )
    # its own C++/CUDA kernels do not load; the "-pt" ops left call PyTorch's own kernels
    reason = f"built for {', '.join(problems)}: its own kernels do not load; ops left: {', '.join(usable) or 'none'}"
    if any(p.startswith(("torch ", "CUDA ")) for p in problems):
        values["fix"] = xformers_fix(info)
        reason += f"; fix: {values['fix']}"
    return Row(SECTION, "xformers wheel", WARN, reason, values)


def deepspeed_ops_row() -> Row:
    """``ds_report``'s table: which ops are prebuilt, which could be JIT-built. mpp's runs need
    none: NCCL or gloo, torch's Adam/AdamW (ZeRO-Offload too, mpp.config), and on CPU DeepSpeed's
    shm all-reduce skipped (``mpp.parallel.distributed.skip_shm_comm_op``)."""
    import deepspeed
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS
    from deepspeed.ops.op_builder.builder import probe_is_compatible

    with (
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):  # its warnings
        ops = {
            name: {
                "installed": bool(installed_ops.get(name)),
                "compatible": bool(probe_is_compatible(b, False)),
            }
            for name, b in ALL_OPS.items()
        }
    values = {
        "deepspeed": deepspeed.__version__,
        "needed": [],
        "ops": ops,
        "not_buildable": sorted(
            n for n, o in ops.items() if not o["installed"] and not o["compatible"]
        ),
    }
    reason = f"DeepSpeed {deepspeed.__version__}: the run needs no compiled op"
    if values["not_buildable"]:
        reason += f"; not buildable here, unused: {', '.join(values['not_buildable'])}"
    return Row(SECTION, "DeepSpeed ops", PASS, reason, values)
