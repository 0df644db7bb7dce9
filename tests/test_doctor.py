"""python -m mpp.tools.doctor: run once here (CPU: the GPU rows say so, the rest runs), and its
verdicts checked on inputs whose answer is known (a wrong attention kernel fails)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import run_cli
from torch.nn.attention import SDPBackend

from mpp.tools.doctor import FAIL, NEEDS_GPU, PASS, VERDICTS, WARN, Row
from mpp.tools.doctor.engine_gpu import memory_row, mfu_row, sync_row
from mpp.tools.doctor.engine_run import plan_for
from mpp.tools.doctor.environment import (
    parse_xformers_info,
    xformers_build_problems,
    xformers_fix,
    xformers_row,
)
from mpp.tools.doctor.parity import TOLERANCE, NoKernel, parity_row, relative_error, sdpa_with
from mpp.tools.planner.hardware import spec_peak

CPU = torch.device("cpu")
GPU_ROWS = {
    "CUDA / NCCL / GPU",
    "bf16",
    "MFU vs plan",
    "peak memory vs plan",
    "host syncs per step",
    "torch.compile",
    *(f"{k} {d}" for k in ("sdpa efficient", "sdpa cudnn", "xformers") for d in ("fp32", "bf16")),
}
CPU_PARITY_ROWS = {
    f"{k} {d}" for k in ("sdpa math", "sdpa flash", "mpp sdpa") for d in ("fp32", "bf16")
}


@pytest.fixture(scope="module")
def doctor_here(tmp_path_factory):
    """One ``python -m mpp.tools.doctor --quick`` on this machine: (exit status, stdout, doctor.json)."""
    out = tmp_path_factory.mktemp("doctor")
    r = run_cli(["python", "-m", "mpp.tools.doctor", "--quick", "--out", str(out)], timeout=300)
    report = (
        json.loads((out / "doctor.json").read_text()) if (out / "doctor.json").is_file() else None
    )
    return r, report, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form: GPU rows not run")
def test_doctor_on_the_cpu_runs_what_it_can_and_says_what_needs_a_gpu(doctor_here):
    r, report, out = doctor_here
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {row["check"]: row for row in report["rows"]}
    assert all(row["verdict"] in VERDICTS and row["reason"] for row in rows.values())
    assert {c for c, row in rows.items() if row["verdict"] == NEEDS_GPU} == GPU_ROWS
    for (
        check
    ) in CPU_PARITY_ROWS:  # the kernels CPU SDPA has, forward and backward, against mpp's math
        row = rows[check]
        assert row["verdict"] == PASS, row
        tol = TOLERANCE[row["values"]["dtype"]]
        assert 0 < row["values"]["worst_fwd"] < tol and 0 < row["values"]["worst_bwd"] < tol
        ns = {(c["n"], c["masked"]) for c in row["values"]["cases"]}
        assert ns == {(n, m) for n in (50, 197, 257) for m in (False, True)}
    assert rows["auto vs fastest"]["values"]["auto"] == "sdpa"
    assert (
        rows["DeepSpeed ops"]["verdict"] == PASS and rows["DeepSpeed ops"]["values"]["needed"] == []
    )
    assert rows["xformers wheel"]["verdict"] in (PASS, WARN)
    run = rows[
        "deepspeed launcher run"
    ]  # the real CLI under the real launcher, read from its metrics.jsonl
    assert run["verdict"] in (PASS, WARN), run
    assert run["values"]["imgs_per_sec"] > 0 and 0 <= run["values"]["data_wait_frac"] < 1
    assert run["values"]["steps"] == 4 and run["values"]["batch"] == 16
    assert (out / "engine" / "run" / "metrics.jsonl").is_file()
    assert "| verdict" in r.stdout and "needs a GPU" in r.stdout and "doctor.json" in r.stdout


def _wrong_scale(q, k, v, keep):  # forgets 1/sqrt(d): a plausible kernel bug
    return sdpa_with(SDPBackend.MATH)(q * q.shape[-1] ** 0.5, k, v, keep)


def _no_key_gradient(q, k, v, keep):  # the forward is right, d k is lost
    return sdpa_with(SDPBackend.MATH)(q, k.detach(), v, keep)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_parity_fails_a_kernel_that_computes_a_wrong_result(dtype):
    assert parity_row("right", sdpa_with(SDPBackend.MATH), dtype, CPU).verdict == PASS
    off_by_a_bit = lambda q, k, v, keep: sdpa_with(SDPBackend.MATH)(q, k, v, keep) * 1.05  # noqa: E731
    for kernel, where in [(_wrong_scale, "fwd"), (_no_key_gradient, "bwd"), (off_by_a_bit, "fwd")]:
        row = parity_row("wrong", kernel, dtype, CPU)
        assert row.verdict == FAIL and "wrong result at N=50" in row.reason, row.reason
        case = row.values["cases"][0]
        assert case[where] > TOLERANCE[dtype]
    if dtype == "fp32":  # 1e-3 relative: far below bf16's rounding, far above fp32's
        slightly = lambda q, k, v, keep: sdpa_with(SDPBackend.MATH)(q, k, v, keep) * 1.001  # noqa: E731
        assert parity_row("wrong", slightly, dtype, CPU).verdict == FAIL


def test_parity_names_a_crash_and_a_missing_kernel():
    def crashes(q, k, v, keep):
        raise ValueError("bad stride")

    def absent(q, k, v, keep):
        raise NoKernel("no kernel for these inputs")

    row = parity_row("crash", crashes, "fp32", CPU)
    assert row.verdict == FAIL and "ValueError: bad stride" in row.reason
    assert parity_row("absent", absent, "fp32", CPU).verdict == WARN


def test_relative_error_is_on_the_scale_of_the_reference():
    ref = torch.tensor([1.0, -4.0], dtype=torch.float64)
    assert relative_error(torch.tensor([1.0, -4.0]), ref) == 0.0
    assert relative_error(torch.tensor([1.4, -4.0]), ref) == pytest.approx(0.1)
    q = torch.randn(1, 3, 2, 8)
    out = F.scaled_dot_product_attention(*(q.transpose(1, 2),) * 3).transpose(1, 2)
    assert relative_error(out, out.double()) == 0.0


XFORMERS_INFO = """xFormers 0.0.35
memory_efficient_attention.cutlassF-pt:            available
memory_efficient_attention.fa3F@0.0.0:             unavailable
pytorch.version:                                   2.13.0+cpu
build.cuda_version:                                1208
build.torch_version:                               2.10.0+cu128
build.python_version:                              3.10.19
build.env.TORCH_CUDA_ARCH_LIST:                    7.5 8.0+PTX 8.0 9.0a
"""


def test_xformers_build_is_checked_against_torch_python_and_gpu():
    info = parse_xformers_info(XFORMERS_INFO)
    assert info["build.torch_version"] == "2.10.0+cu128"
    assert info["memory_efficient_attention.cutlassF-pt"] == "available"
    assert (
        xformers_build_problems(info, "2.10.0+cu128", "12.8", "3.10.4", "9.0") == []
    )  # an H100: sm 9.0a built
    problems = xformers_build_problems(info, "2.13.0+cu128", "12.8", "3.11.7", "12.0")
    assert len(problems) == 3 and "torch 2.10.0+cu128" in problems[0] and "sm 12.0" in problems[2]
    # the right torch for another CUDA (13.0: another libcudart), or a CPU torch
    assert xformers_build_problems(info, "2.10.0+cu130", "13.0", "3.10.4", None) == [
        "CUDA 12.8 (here 13.0)"
    ]
    assert (
        "CUDA 12.8 (here none" in xformers_build_problems(info, "2.10.0", None, "3.10.4", None)[0]
    )


# what xformers 0.0.35's wheel (torch 2.10.0+cu128) asks for
FIX_0035 = 'pip install "torch==2.10.0" --index-url https://download.pytorch.org/whl/cu128'


def test_the_xformers_fix_installs_the_torch_the_wheel_was_built_for():
    assert xformers_fix(parse_xformers_info(XFORMERS_INFO)) == FIX_0035
    built = {"build.torch_version": "2.11.0+cu130", "build.cuda_version": "1300"}
    assert xformers_fix(built) == (
        'pip install "torch==2.11.0" --index-url https://download.pytorch.org/whl/cu130'
    )
    # no local label: the tag from build.cuda_version; no build at all: 0.0.35's own
    assert xformers_fix({"build.torch_version": "2.8.0", "build.cuda_version": "1206"}).endswith(
        'torch==2.8.0" --index-url https://download.pytorch.org/whl/cu126'
    )
    assert xformers_fix({}) == FIX_0035


def test_the_xformers_row_prints_the_fix_for_this_install(monkeypatch):
    """The real wheel under the real torch: here xformers 0.0.35 (built for 2.10.0+cu128) under
    the CPU torch 2.13.0. On a GPU (here as one with sm 9.0) the row ends with the command that
    installs torch 2.10.0; without one it gave the same CUDA torch as advice (issue 50, finding
    10): there SDPA is the path, said so, and no command is given."""
    if not torch.cuda.is_available():
        row = xformers_row()
        assert row.verdict == PASS and "fix" not in row.values, row
        assert "no GPU here: attn_backend auto runs PyTorch's SDPA" in row.reason, row.reason
        assert "pip install" not in row.reason and "index-url" not in row.reason, row.reason
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    row = xformers_row()
    assert row.values, row.reason  # xformers is a dependency: installed and answering
    built = row.values["build"]["build.torch_version"]
    if built == torch.__version__:  # e.g. a GPU machine installed with the gpu extra
        assert "fix" not in row.values and "fix:" not in row.reason
        return
    version, _, tag = built.partition("+")
    fix = f'pip install "torch=={version}" --index-url https://download.pytorch.org/whl/{tag}'
    assert row.verdict == WARN and row.values["fix"] == fix and row.reason.endswith(f"; fix: {fix}")
    if row.values["version"] == "xFormers 0.0.35":
        assert fix == FIX_0035


def test_the_doctor_table_fits_100_columns():
    """A reason as long as a real xformers row's (335 columns wide once): wrapped onto lines of
    its own row, every word kept, the table 100 wide; short rows keep one line."""
    from mpp.tools.doctor.__main__ import render

    long = (
        "built for torch 2.10.0+cu128 (here 2.13.0+cpu), CUDA 12.8 (here none: a CPU torch), "
        "Python 3.10.19 (here 3.11.7): its own kernels do not load; ops left: cutlassF-pt, "
        "cutlassB-pt, triton_splitKF; fix: " + FIX_0035
    )
    rows = [
        Row("environment", "torch", PASS, "torch 2.13.0+cpu, Python 3.11.7"),
        Row("environment", "xformers wheel", WARN, long),
        Row("engine", "deepspeed launcher run", PASS, "4 steps"),
    ]
    table, counts = render(rows).split("\n\n")
    lines = table.splitlines()
    assert max(map(len, lines)) == 100, table
    assert len(lines) > 2 + len(rows)  # the long reason wrapped
    assert "https://download.pytorch.org/whl/cu128" in table  # no word broken
    reason = " ".join(line.split("|")[4].strip() for line in lines[2:])
    assert " ".join(r.reason for r in rows) == reason
    assert counts == "2 pass, 1 warn, 0 fail, 0 needs a GPU"


def test_spec_peaks_are_datasheet_dense_bf16_by_device_name():
    assert spec_peak("NVIDIA H100 80GB HBM3")[0] == 989e12  # the SXM part's name
    assert spec_peak("NVIDIA H100 PCIe")[0] == 756e12
    assert spec_peak("NVIDIA H200")[0] == 989e12 and spec_peak("NVIDIA A100-SXM4-80GB")[0] == 312e12
    assert "datasheet" in spec_peak("NVIDIA H100 80GB HBM3")[1]
    assert spec_peak("Tesla V100-SXM2-32GB")[0] is None


def test_engine_verdicts_against_the_plan():
    """The comparisons a GPU run makes, on figures whose verdict is known."""
    step = {"peak_mem_gib": 10.0, "reserved_gib": 12.0}
    assert memory_row(step, ({"peak_gib": 9.0}, "")).verdict == FAIL  # the plan under-predicts
    assert memory_row(step, ({"peak_gib": 11.0}, "")).verdict == PASS
    assert memory_row(step, ({"peak_gib": 30.0}, "")).verdict == WARN  # far too pessimistic
    unavailable = memory_row(step, (None, "plan unavailable: no planner"))
    assert unavailable.verdict == WARN and "plan unavailable" in unavailable.reason
    run = Row("engine", "deepspeed launcher run", PASS, "", {"imgs_per_sec": 1000.0})
    h100 = spec_peak("NVIDIA H100 80GB HBM3")
    row = mfu_row(run, 300e9, ({"mfu_ceiling": 0.6}, ""), h100)  # 0.3 PFLOP/s of 989
    assert row.verdict == PASS and row.values["mfu"] == pytest.approx(300e12 / 989e12)
    assert mfu_row(run, 100e9, ({"mfu_ceiling": 0.6}, ""), h100).verdict == WARN
    assert "plan unavailable" in mfu_row(run, 300e9, (None, "plan unavailable: x"), h100).reason
    # the figures an H200 gave (DeepSpeed 0.19.8, ZeRO-1 bf16): DeepSpeed's own syncs named, not judged
    ds = {
        "deepspeed/runtime/utils.py:233": 2,
        "deepspeed/runtime/zero/stage_1_and_2.py:3248": 1,
    }
    fine = {"with_finite_check": 4, "without_finite_check": 3, "own": 1}
    row = sync_row({"host_syncs": {**fine, "sites": {**ds, "mpp/train/nonfinite.py:40": 1}}})
    assert row.verdict == PASS and "(1 of them mpp's)" in row.reason
    assert "deepspeed/runtime/utils.py:233 x2" in row.reason and "mpp/train" not in row.reason
    two = {**fine, "own": 2, "sites": {"mpp/train/step.py:9": 1, "mpp/train/nonfinite.py:40": 1}}
    assert sync_row({"host_syncs": two}).verdict == WARN
    spec, why = plan_for(__file__, "Tesla V100-SXM2-32GB", None)
    assert spec is None and why.startswith("plan unavailable")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_doctor_on_a_gpu_runs_every_row(doctor_here):
    r, report, _ = doctor_here
    assert report is not None, r.stderr[-2000:]
    rows = {row["check"]: row for row in report["rows"]}
    assert not [c for c, row in rows.items() if row["verdict"] == NEEDS_GPU]
    for check in CPU_PARITY_ROWS | {"sdpa efficient bf16", "sdpa cudnn bf16", "xformers bf16"}:
        assert rows[check]["verdict"] in (PASS, WARN), rows[
            check
        ]  # WARN: no kernel for this input here
    assert rows["host syncs per step"]["values"]["own"] <= 1
    assert rows["deepspeed launcher run"]["verdict"] in (PASS, WARN)
