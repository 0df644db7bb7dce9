"""The one GPU check (issue 36 §5, issue 49 §6): what a lent GPU should measure, as one command from a
fresh checkout, in under 8 minutes (a lent session has 15 minutes of device time, the machine's
start included). Each step runs under its own limit, cut to what is left of BUDGET_S (460 s):
a step left under MIN_STEP_S is skipped, and said so. The steps, most important first, with
their limits and what they should take on the H200 of 2026-11-27 (16 Xeon cores):

1. shards (60 s; ~15-25 s): ``python -m benchmarks compiled-run --shards-only``: 15,616
   photo-like JPEGs of ImageNet's sizes (one epoch of 61 batches of 256) in 32 shards, written
   once, on every core, into the scratch folder that every run then reads;
2. gpu-step 256 (180 s; ~20 s eager, plus a cold compile of ~40-60 s per objective):
   ``python -m benchmarks gpu-step --compile --profile --batch 256 --objectives mpp,mae``: each
   step alone, eager and compiled (img/s, MFU, GPU idle share, kernels per step, peak memory):
   the whole runs' reference. Run with ``--compile`` because a compiled run has to be held
   against a compiled step; the compile is not lost either: it fills inductor's cache, which the
   compiled runs then read (the fourth session: a compiled run 4 s slower than eager, after the
   doctor had compiled the same graph in the same call);
3. runs mae_b16 (180 s) and 4. runs mpp_b16 (180 s), each ~4 x 30-40 s:
   ``python -m benchmarks compiled-run --config C --decode cpu,gpu --compile false,true``: whole
   runs under the real launcher on step 1's shards, batch 256, 60 steps, min(16, cores - 2) data
   workers, ``data.decode`` cpu and gpu, ``model.compile`` false and true. Per run: img/s (the
   median logging window), data wait, and the run's img/s over its step alone's (eager run
   against eager step, compiled against compiled: step 2). Issue 49's goals: >= 0.9 of the step,
   data wait <= 5 %. The last mae_b16 run also calls the monitor and previews and writes a
   checkpoint half-way (they work compiled: the fourth session; not what is measured now); the
   others write only their final checkpoint. Each gets ``--budget-s`` (its limit less
   RUN_MARGIN_S): when time runs short its last runs are skipped, its JSON still written;
5. cuda tests (60 s; 20-40 s): the CUDA-only tests (``CUDA_TESTS``: xformers against SDPA, the
   gpu-step test, nvJPEG against PIL, masks generated on CUDA; the doctor's test left out);
6. decode (40 s; 14-30 s): ``python -m benchmarks decode``: a CPU decode worker's img/s per path,
   and nvJPEG's img/s and GPU ms per batch in the training process.

Expected ~400-450 s in all; the limits add up to 700 s, the budget cuts them to 460: steps 5 and
6 run in whatever is left (when skipped they fail nothing). Left out of the fourth session's
check, to fit the whole runs: the doctor ``--quick`` (123 s; its rows unchanged over three
sessions, its launcher run now one of steps 3-4; ``python -m mpp doctor --quick`` by hand),
``gpu-step 128 --levers`` (issue 36's exploration of the ZeRO-1 paths; its figures are in
BENCHMARKS.md), and HPM in gpu-step (no whole run of it here; its step figures stand in
BENCHMARKS.md; gpu-step's goal table, which needs all three objectives, is empty).

Writes OUT/gpu-check.json (every step's command, exit status, seconds, limit and own JSON, and the
whole runs against their steps) and prints the steps' table, then the whole runs' table. Exit
status 0 when every step that had to run exited 0 and every whole run did. ``--dry-run`` runs the
same steps on the CPU in their small forms, so the script does not break the first time it meets
a GPU (``tests/test_benchmarks.py`` runs it so): shards for the doctor's tiny CPU model, gpu-step
``--device cpu`` at that model's batch (img/s and run/step then a code check, not a figure), one
eager run per config with ``data.decode=cpu`` (nvJPEG needs a GPU; a compile on 2 CPU cores
takes ~80 s), the tests collected but not run, decode ``--quick``.

    python benchmarks/gpu_check.py [--out runs/gpu-check] [--dry-run] [--budget-s 460]

Each step's JSON and log land in OUT, small enough to bring back whole; the shards and runs
(GBs) in a scratch folder (the runs' checkpoints removed once counted). On the lent machine (its
README: wheels staged into .whl, carried; no network), first:
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
BUDGET_S = 460  # the whole call; a lent session's 15 minutes also pay the machine's start
MIN_STEP_S = 20  # a step left less than this is skipped
RUN_MARGIN_S = 15  # a runs step's --budget-s: its limit less this (its start, the JSON)
CONFIGS = ("mae_b16", "mpp_b16")
DRY_BATCH = 16  # the doctor's tiny CPU run's batch (mpp.tools.doctor.engine_run.CPU_RUN)
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
    """(name, argv, JSON it writes, time limit in s, whether it takes --budget-s, whether it may
    be skipped) of each step, in order."""
    py, bench = sys.executable, [sys.executable, "-m", "benchmarks"]
    # the shards and runs: GBs on a GPU, kept out of OUT; the tiny ones of --dry-run in it
    scratch = out / "scratch" if dry else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    quick = ["--quick"] if dry else []
    runs = [*bench, "compiled-run", *quick, "--keep", str(scratch / "runs")]
    gpu_step = out / "gpu-step-256.json"
    whole = [
        step(
            f"runs {config}",
            [*runs, "--config", config, "--decode", "cpu" if dry else "cpu,gpu"]
            + ["--compile", "false" if dry else "false,true"]
            + ["--extras", "last" if config == CONFIGS[0] else "none"]
            + ["--step-json", str(gpu_step), "--out", str(out / f"runs-{config}.json")],
            out / f"runs-{config}.json",
            300 if dry else 180,
            budget=True,
        )
        for config in CONFIGS
    ]
    return [
        step(
            "shards",
            [*runs, "--shards-only", "--config", ",".join(CONFIGS)]
            + ["--out", str(out / "shards.json")],
            out / "shards.json",
            60,
        ),
        step(
            "gpu-step 256",
            [*bench, "gpu-step", "--objectives", "mpp,mae", "--out", str(gpu_step)]
            + (
                ["--device", "cpu", "--batch", str(DRY_BATCH)]
                if dry
                else ["--compile", "--profile", "--batch", "256"]
            ),
            gpu_step,
            300 if dry else 180,
        ),
        *whole,
        step(
            "cuda tests",
            [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            + (
                ["--collect-only", *CUDA_TESTS]
                if dry
                # the doctor's test would run the doctor (123 s), which this check leaves out
                else ["-rs", *CUDA_TESTS, "--deselect", DOCTOR_TEST]
            ),
            None,
            120 if dry else 60,
            optional=True,
        ),
        step(
            "decode",
            [*bench, "decode", *quick, "--out", str(out / "decode.json")],
            out / "decode.json",
            120 if dry else 40,
            optional=True,
        ),
    ]


def step(
    name: str,
    argv: list[str],
    result: Path | None,
    limit: int,
    budget: bool = False,
    optional: bool = False,
) -> dict[str, Any]:
    return {
        "name": name,
        "argv": argv,
        "result": result,
        "limit_s": limit,
        "budget": budget,
        "optional": optional,
    }


def run_step(s: dict[str, Any], log: Path, left: float) -> dict[str, Any]:
    """One step in a subprocess under its limit or what is ``left`` of the budget, whichever is
    less (``--budget-s`` that less RUN_MARGIN_S where it takes one), its output to ``log``; the
    record. A step that times out is killed with everything it started."""
    limit = int(min(s["limit_s"], left))
    argv = s["argv"] + (["--budget-s", str(limit - RUN_MARGIN_S)] if s["budget"] else [])
    record: dict[str, Any] = {
        "name": s["name"],
        "command": " ".join(argv),
        "limit_s": limit,
        "optional": s["optional"],
    }
    if limit < MIN_STEP_S:
        return record | {"rc": "skipped", "seconds": 0.0, "last_line": f"{left:.0f} s left"}
    if s["result"] is not None:
        Path(s["result"]).unlink(missing_ok=True)  # an earlier call's, in the same OUT
    start = time.perf_counter()
    with (
        open(log, "w") as f,
        subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT) as p,
    ):
        try:
            rc: int | str = p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            kill_tree(p)
            rc = "timeout"
        except BaseException:
            kill_tree(p)
            raise
    record |= {"rc": rc, "seconds": round(time.perf_counter() - start, 1), "log": str(log)}
    if s["result"] is not None and Path(s["result"]).exists():
        record["result"] = json.loads(Path(s["result"]).read_text())
    tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
    record["last_line"] = tail[0][:200] if tail else ""
    return record


def kill_tree(p: subprocess.Popen) -> None:
    """``p`` and every process under it (the launcher runs a step starts are their own process
    groups): killed, so that none holds the GPU into the next step."""
    import psutil

    try:
        procs = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    p.wait()


def figures(record: dict[str, Any]) -> str:
    """The step's headline figures, one line."""
    r = record.get("result")
    if not r:
        return record["last_line"]
    if record["name"].startswith("gpu-step"):
        cells = []
        for row in r["rows"]:
            if "error" in row:
                cells.append(f"{row['objective']}: {row['error'][:80]}")
                continue
            idle = (row.get("gpu_time") or {}).get("idle")
            cells.append(
                f"{row['objective']}{' compiled' if row.get('compiled') else ''}: "
                f"{row['imgs_per_sec']:.0f} img/s, MFU {fmt(row.get('mfu'))}"
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
    if record["name"] == "shards":
        sh = r["setting"]["shards"]
        return (
            f"{sh['count']} JPEGs in {sh['files']} shards, {sh['mean_kib']} KiB and "
            f"{sh['mean_pixels']} pixels on average, "
            + ("reused" if sh["reused"] else f"written in {sh['write_s']} s")
        )
    if record["name"].startswith("runs "):
        return "; ".join(
            f"{row['decode']} {'compiled' if row['compile'] else 'eager'}: exit {row['rc']}"
            + (
                f", {row['imgs_per_sec']:.0f} img/s, wait {row['data_wait']:.3f}"
                if row.get("imgs_per_sec")
                else ""
            )
            + (f", run/step {row['run_over_step']:.2f}" if row.get("run_over_step") else "")
            for row in r["rows"]
        )
    return record["last_line"]


def whole_runs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every whole run's row, against gpu-step 256's step alone (whatever order they ran in)."""
    if str(ROOT) not in sys.path:  # run as a script, from anywhere
        sys.path.insert(0, str(ROOT))
    from benchmarks.compiled_run import against_step

    by = {r["name"]: r.get("result") or {} for r in records}
    rows = [
        row
        for r in records
        if r["name"].startswith("runs ")
        for row in by[r["name"]].get("rows", [])
    ]
    against_step(rows, by.get("gpu-step 256"))
    return rows


def whole_runs_table(rows: list[dict[str, Any]]) -> str:
    from mpp.tools.measure import format_table

    columns = [
        ("config", "config", ""),
        ("decode", "decode", ""),
        ("compile", "compile", ""),
        ("rc", "exit", ""),
        ("imgs_per_sec", "img/s", ".0f"),
        ("data_wait", "data wait (<= 0.05)", ".3f"),
        ("step_imgs_per_sec", "step alone img/s", ".0f"),
        ("run_over_step", "run / step (>= 0.9)", ".3f"),
        ("met", "met", ""),
    ]
    return "whole runs against their step alone\n" + format_table(rows, columns)


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-check")
    p.add_argument("--dry-run", action="store_true", help="the small forms, on the CPU")
    p.add_argument(
        "--budget-s", type=float, default=BUDGET_S, help="seconds for every step together"
    )
    args = p.parse_args(argv)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA GPU here; --dry-run runs the small forms on the CPU")
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    start = time.perf_counter()
    print("| step | exit | time | limit | figures |\n|---|---|---|---|---|")
    for s in steps(args.out, args.dry_run):
        left = args.budget_s - (time.perf_counter() - start)
        record = run_step(s, args.out / f"{s['name'].replace(' ', '-')}.log", left)
        records.append(record)
        print(
            f"| {record['name']} | {record['rc']} | {record['seconds']} s | "
            f"{record['limit_s']} s | {figures(record)} |"
        )
        sys.stdout.flush()
    runs = whole_runs(records)
    print("\n" + whole_runs_table(runs))
    summary = {
        "dry_run": args.dry_run,
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": git_commit(),
        "budget_s": args.budget_s,
        "seconds": round(time.perf_counter() - start, 1),
        "steps": records,
        "whole_runs": runs,
    }
    (args.out / "gpu-check.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"-> {args.out / 'gpu-check.json'} ({summary['seconds']} s)")
    # a skipped optional step (the tail the budget left no time for) fails nothing
    ok = all(r["rc"] == 0 or (r["optional"] and r["rc"] == "skipped") for r in records)
    return 0 if ok and all(r["rc"] == 0 for r in runs) else 1


def git_commit() -> str:
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
