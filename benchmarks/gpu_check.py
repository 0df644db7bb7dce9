"""The one GPU check (issue 36 §5): everything a lent GPU should measure, as one command from a
fresh checkout, each step under its own time limit (about 7 minutes in all on the H200 of
2026-11-27 before step 5; 18 at most when the steps run to their limits):

1. ``mpp doctor --quick``: the environment, attention kernels, a launcher run;
2. ``python -m benchmarks gpu-step --levers --profile`` at batch 128 (each objective as shipped, ZeRO-1 bf16
   as mpp now sets it, ZeRO-1 bf16 as it ran before), then as shipped at batch 256: MFU, GPU
   idle share and time by kernel kind, kernels and host syncs per step, peak memory;
3. ``python -m benchmarks decode``: a CPU decode worker's img/s per path, and nvJPEG's img/s and GPU ms
   per batch in the training process;
4. the CUDA-only tests (``CUDA_TESTS``: xformers against SDPA, the gpu-step test, nvJPEG
   against PIL, masks generated on CUDA; the doctor's test is left out, as it would run the
   doctor of step 1 a second time);
5. ``python -m benchmarks compiled-run``: a whole launcher run of mae_b16 with ``model.compile``
   on (monitor, previews, checkpoints), against the same run eager.

Writes OUT/gpu-check.json (every step's command, exit status, seconds, and its own JSON) and
prints one table. ``--dry-run`` runs the same steps on the CPU in their small forms (gpu-step
``--device cpu`` with the levers for MAE, decode ``--quick``, the tests collected but not run,
the doctor's and compiled-run's help: the suite runs the doctor already), so the script does not break the first time it meets a GPU:
``tests/test_benchmarks.py`` runs it that way.

    python benchmarks/gpu_check.py [--out runs/gpu-check] [--dry-run]

Each step's JSON (the doctor's too, not its run) and log land in OUT: small enough to bring
back whole. On the lent machine (its README: wheels staged into .whl, carried; no network), first:
    python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl
    export PYTHONPATH=$PWD/.site:$PWD PATH=$PWD/.site/bin:$PATH
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# the tests that run only where CUDA is (each skips elsewhere, saying why)
CUDA_TESTS = [
    "tests/test_attention.py::test_xformers_matches_sdpa_on_cuda_forward_and_backward",
    "tests/test_benchmarks.py::test_gpu_step_times_the_recipes_step_against_the_datasheet_peak",
    "tests/test_device_decode.py::test_nvjpeg_fills_the_batch_as_pil_does_on_a_gpu",
    "tests/test_doctor.py::test_doctor_on_a_gpu_runs_every_row",
    "tests/test_masking.py::test_generated_on_cuda",
]
DOCTOR_TEST = CUDA_TESTS[3]


def steps(out: Path, dry: bool) -> list[dict[str, Any]]:
    """(name, argv, JSON it writes, time limit in s) of each step, in order."""
    py, bench = sys.executable, [sys.executable, "-m", "benchmarks"]
    if dry:
        return [
            step("doctor", [py, "-m", "mpp", "doctor", "--help"], None, 60),
            step(
                "gpu-step 128 levers",
                [*bench, "gpu-step", "--device", "cpu", "--levers", "--objectives", "mae"]
                + ["--out", str(out / "gs.json")],
                out / "gs.json",
                300,
            ),
            step(
                "decode",
                [*bench, "decode", "--quick", "--out", str(out / "decode.json")],
                out / "decode.json",
                120,
            ),
            step(
                "cuda tests",
                [py, "-m", "pytest", "-q", "--collect-only", *CUDA_TESTS],
                None,
                120,
            ),
            # the quick form compiles on the CPU for 80 s: `python -m benchmarks compiled-run
            # --quick` runs it by hand; here only the suite's arguments
            step("compiled run", [*bench, "compiled-run", "--help"], None, 60),
        ]
    gpu_step = [*bench, "gpu-step", "--profile"]
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    return [
        step(
            "doctor",
            # its run (a 330 MB checkpoint) stays out of OUT, only its JSON is kept there
            [py, "-m", "mpp", "doctor", "--quick", "--out", str(scratch / "doctor")],
            scratch / "doctor" / "doctor.json",
            200,  # 123 s on the H200 of 2026-11-27
        ),
        step(
            "gpu-step 128 levers",
            [*gpu_step, "--levers", "--batch", "128", "--out", str(out / "gpu-step-128.json")],
            out / "gpu-step-128.json",
            180,
        ),
        step(
            "gpu-step 256",
            [*gpu_step, "--batch", "256", "--out", str(out / "gpu-step-256.json")],
            out / "gpu-step-256.json",
            90,
        ),
        step(
            "decode",
            [*bench, "decode", "--out", str(out / "decode.json")],
            out / "decode.json",
            60,
        ),
        step(
            "cuda tests",
            # the doctor's test would run the doctor a second time (123 s): step 1 ran it
            [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *CUDA_TESTS]
            + ["--deselect", DOCTOR_TEST],
            None,
            150,
        ),
        step(
            "compiled run",
            # the runs (shards, checkpoints: GBs) in scratch, their launcher logs kept there too
            [*bench, "compiled-run", "--keep", str(scratch / "compiled-run")]
            + ["--out", str(out / "compiled-run.json")],
            out / "compiled-run.json",
            360,
        ),
    ]


def step(name: str, argv: list[str], result: Path | None, limit: int) -> dict[str, Any]:
    return {"name": name, "argv": argv, "result": result, "limit_s": limit}


def run_step(s: dict[str, Any], log: Path) -> dict[str, Any]:
    """One step in a subprocess under its limit, its output to ``log``; the record."""
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(
                s["argv"], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=s["limit_s"]
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    record = {
        "name": s["name"],
        "command": " ".join(s["argv"]),
        "rc": rc,
        "seconds": round(time.perf_counter() - start, 1),
        "log": str(log),
    }
    if s["result"] is not None and Path(s["result"]).exists():
        record["result"] = json.loads(Path(s["result"]).read_text())
    tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
    record["last_line"] = tail[0][:200] if tail else ""
    return record


def figures(record: dict[str, Any]) -> str:
    """The step's headline figures, one line."""
    r = record.get("result")
    if not r:
        return record["last_line"]
    if record["name"].startswith("gpu-step"):
        cells = []
        for row in r["rows"]:
            idle = (row.get("gpu_time") or {}).get("idle")
            cells.append(
                f"{row.get('lever', 'shipped')}/{row['objective']}: MFU {fmt(row.get('mfu'))}"
                + (f" idle {idle:.2f}" if idle is not None else "")
                + (f" k/step {row['kernels_per_step']:.0f}" if row.get("kernels_per_step") else "")
            )
        return "; ".join(cells)
    if record["name"] == "decode":
        cells = []
        for row in r["rows"]:
            rates = [f"{k} {v:.0f}" for k, v in row.items() if isinstance(v, float) and k != "kib"]
            gpu = row.get("gpu") or {}
            if "imgs_per_sec" in gpu:
                rates.append(
                    f"nvJPEG {gpu['imgs_per_sec']:.0f} img/s, {gpu['ms_per_batch']:.1f} ms"
                )
            elif gpu:
                rates.append(f"nvJPEG: {gpu.get('refused')}")
            cells.append(f"{row['source']}: " + ", ".join(rates))
        return "; ".join(cells)
    if record["name"] == "compiled run":
        cells = [
            f"{'compiled' if row['compile'] else 'eager'}: exit {row['rc']}, "
            f"{row.get('imgs_per_sec', 0):.0f} img/s, monitor {row['monitor_records']}, "
            f"recompiles {row['recompiles']}"
            for row in r["rows"]
        ]
        return "; ".join(cells)
    if record["name"] == "doctor":
        counts: dict[str, int] = {}
        for row in r.get("rows", []):
            counts[row.get("verdict", "?")] = counts.get(row.get("verdict", "?"), 0) + 1
        return ", ".join(f"{n} {v}" for v, n in counts.items())
    return record["last_line"]


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-check")
    p.add_argument("--dry-run", action="store_true", help="the small forms, on the CPU")
    args = p.parse_args(argv)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA GPU here; --dry-run runs the small forms on the CPU")
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    print("| step | exit | time | figures |\n|---|---|---|---|")
    for s in steps(args.out, args.dry_run):
        record = run_step(s, args.out / f"{s['name'].replace(' ', '-')}.log")
        records.append(record)
        print(f"| {record['name']} | {record['rc']} | {record['seconds']} s | {figures(record)} |")
        sys.stdout.flush()
    summary = {
        "dry_run": args.dry_run,
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": git_commit(),
        "steps": records,
    }
    (args.out / "gpu-check.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"-> {args.out / 'gpu-check.json'}")
    return 0 if all(r["rc"] == 0 for r in records) else 1


def git_commit() -> str:
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
