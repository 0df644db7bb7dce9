"""The masking ablation as cluster jobs (``pretrain/ablate.py --submit slurm|local``) and its
state (``--status DIR``).

Each cell and seed is two jobs: its pretraining (``mpp.submit.SubmittedRun``: nodes x GPUs
tasks, requeued on preemption, ``--resume auto``) and its evaluations, a dependent one-task job
(``afterok`` on SLURM; the local executor has no dependencies, so there the evaluation job waits
for the pretraining to finish, or fails when its job has ended without it) that runs them through
the launcher as the sequential runner does. A baseline is one evaluation job. The command returns
once everything is submitted; the job ids go to ``DIR/jobs.json``.

``--status DIR`` reads ``ablation.json`` and ``jobs.json``, asks each job's state (SLURM's
``sacct`` through submitit; a local job's controller process, else its result file) and rebuilds
results.csv/md/png from what has finished. Submitting again submits only what is neither finished
nor queued or running: a missing, failed or killed cell.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import signal
import time
from pathlib import Path
from typing import Any

from mpp.tools import ablation
from mpp.tools.ablation import (
    SCRIPTS,
    SPEC_FILE,
    AblationSpec,
    AblationStopped,
    Baseline,
    Job,
    is_complete,
    is_done,
    result_row,
)

JOBS_FILE = "jobs.json"
ACTIVE = ("queued", "running", "unknown")  # unknown: sacct could not say; never resubmitted
POLL_S = 5.0
# SLURM's job states (sacct) as ours: anything else (CANCELLED, TIMEOUT, NODE_FAIL, ...) ended it
SLURM_STATES = {
    "PENDING": "queued",
    "REQUEUED": "queued",
    "CONFIGURING": "queued",
    "SUSPENDED": "queued",
    "RESIZING": "queued",
    "RUNNING": "running",
    "COMPLETING": "running",
    "COMPLETED": "finished",
}


def saved_spec(out_dir: Path) -> AblationSpec:
    """The spec an ablation in ``out_dir`` ran with (``ablation.json``)."""
    from mpp.config import ConfigError

    path = Path(out_dir) / SPEC_FILE
    if not path.is_file():
        raise ConfigError(f"{out_dir}: no {SPEC_FILE} here: not an ablation's output folder")
    return AblationSpec.model_validate_json(path.read_text())


def read_jobs(out_dir: Path) -> dict[str, Any]:
    path = Path(out_dir) / JOBS_FILE
    return json.loads(path.read_text()) if path.is_file() else {"backend": None, "jobs": {}}


def write_jobs(out_dir: Path, record: dict[str, Any]) -> None:
    path = Path(out_dir) / JOBS_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def job_state(backend: str, folder: Path, job_id: str) -> str:
    """queued, running, finished, failed (it raised or exited non-zero), killed (it ended without
    a word: scancel -9, a lost node, the local controller killed) or SLURM's own state, lower case."""
    if backend == "local":
        if _local_controller_alive(job_id):
            return "running"
    else:
        try:
            import submitit

            state = submitit.SlurmJob(folder=folder, job_id=job_id).state.split()[0]
        except Exception:  # no sacct here, or it failed: judge by the result file below
            state = "UNKNOWN"
        if state in SLURM_STATES and SLURM_STATES[state] != "finished":
            return SLURM_STATES[state]
        if state not in ("UNKNOWN", "COMPLETED", "FAILED"):
            return state.lower()
    # submitit's: ("success", value) or ("error", traceback)
    result = folder / f"{job_id}_0_result.pkl"
    if not result.is_file():
        return "killed" if backend == "local" else "unknown"
    with open(result, "rb") as f:
        return "finished" if pickle.load(f)[0] == "success" else "failed"


def _local_controller_alive(job_id: str) -> bool:
    """A local job's id is its controller's pid: alive and still submitit's controller."""
    import psutil

    try:
        proc = psutil.Process(int(job_id))
        return proc.status() != psutil.STATUS_ZOMBIE and "submitit.local._local" in " ".join(
            proc.cmdline()
        )
    except (psutil.Error, ValueError):
        return False


def work_items(spec: AblationSpec) -> list[Job | Baseline]:
    cells = ablation.plan_cells(spec)
    return [*ablation.plan_jobs(spec, cells), *ablation.plan_baselines(spec)]


def item_state(spec: AblationSpec, item: Job | Baseline, record: dict[str, Any]) -> tuple[str, str]:
    """(done | queued | running | failed | not submitted, what it is doing or why it failed)."""
    if is_complete(spec, item):
        return "done", ""
    ids = record["jobs"].get(item.label)
    if not ids:
        return "not submitted", ""
    states = {
        stage: job_state(record["backend"], item.dir / "submitit", job_id)
        for stage, job_id in ids.items()
        if job_id
    }
    for stage in ("pretrain", "evaluate"):
        if states.get(stage) in ACTIVE:
            doing = "pretraining" if stage == "pretrain" else "evaluating"
            return states[stage], f"{doing}: job {ids[stage]}" + (
                " (sacct does not know it)" if states[stage] == "unknown" else ""
            )
    for stage in ("pretrain", "evaluate"):
        if stage in states and states[stage] != "finished":
            log = item.dir / "submitit" / f"{ids[stage]}_0_log.err"
            return "failed", f"{stage} job {ids[stage]} {states[stage]}, log: {log}"
    return "failed", f"its jobs finished without results: see {item.dir}"


def status_rows(spec: AblationSpec) -> tuple[list[dict], list[tuple[str, str, str]]]:
    """(results rows: the finished evaluations' results, the others' state; a line per item)."""
    record = read_jobs(spec.out_dir)
    rows, lines = [], []
    for item in work_items(spec):
        state, detail = item_state(spec, item, record)
        lines.append((item.label, state, detail))
        for kind in ablation.evaluations(spec, item):
            out = item.dir / kind
            done = is_done(kind, out)
            rows.append(
                result_row(
                    item, kind, "ok" if done else state, out / "results.json" if done else item.dir
                )
            )
    return rows, lines


@dataclasses.dataclass
class EvaluateJob:
    """The job that evaluates one pretrained cell (or runs one baseline): one task, on a node of
    the pretraining's GPU count, running each evaluation through the launcher (``evaluate``).
    submitit's Checkpointable protocol: on the preemption signal the running evaluation
    checkpoints and exits 75, then this job requeues itself and skips what has finished."""

    spec: AblationSpec
    item: Job | Baseline
    model_overrides: list[str]
    backend: str
    pretrain_id: str | None

    def __call__(self) -> None:
        from submitit import JobEnvironment

        self._wait_for_pretraining()
        usr_sig = JobEnvironment._usr_sig()
        requeue = signal.getsignal(usr_sig)  # submitit's handler: called after the stop, not before
        ablation._stop_signal.clear()
        record = lambda signum, frame: ablation._stop_signal.append(signum)  # noqa: E731
        previous = {s: signal.signal(s, record) for s in {*ablation.SIGNALS, usr_sig}}
        try:
            try:
                rows = ablation.evaluate(
                    self.spec, self.item, self.model_overrides, self.spec.launcher, "[job]"
                )
            finally:  # submitit's handlers back before its requeue
                for s, handler in previous.items():
                    signal.signal(s, handler)
        except AblationStopped:
            if ablation._stop_signal[:1] == [usr_sig] and callable(requeue):
                requeue(usr_sig, None)  # checkpoint() below, the requeue, and exit
            raise
        failed = [f"{r['eval']} (log: {r['path']})" for r in rows if r["status"] != "ok"]
        if failed:
            raise RuntimeError(f"{self.item.label}: failed: {', '.join(failed)}")

    def checkpoint(self) -> Any:
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(dataclasses.replace(self, pretrain_id=None))

    def _wait_for_pretraining(self) -> None:
        """SLURM starts this job after the pretraining's succeeded (afterok); locally, wait here."""
        if not isinstance(self.item, Job):
            return
        pre = self.item.dir / "pretrain"
        while not is_done("pretrain", pre):
            state = (
                job_state(self.backend, self.item.dir / "submitit", self.pretrain_id)
                if self.pretrain_id
                else "none"
            )
            if state not in ACTIVE:
                raise RuntimeError(
                    f"{self.item.label}: the pretraining (job {self.pretrain_id}) ended ({state}) "
                    f"without finishing: {pre}"
                )
            time.sleep(POLL_S)


def submit_item(
    spec: AblationSpec, item: Job | Baseline, model_overrides: list[str], sub: Any
) -> dict[str, str | None]:
    """Submit what ``item`` still needs; its job ids by stage."""
    from mpp.submit import SubmittedRun, make_executor

    folder = item.dir / "submitit"
    pretrain_id = None
    if isinstance(item, Job) and not is_done("pretrain", item.dir / "pretrain"):
        run = SubmittedRun(SCRIPTS["pretrain"], ablation.pretrain_args(spec, item))
        pretrain_id = make_executor(sub, folder, f"pretrain-{item.label}").submit(run).job_id
    after = (
        {"dependency": f"afterok:{pretrain_id}", "kill_on_invalid_dep": "yes"}
        if pretrain_id
        else {}
    )
    one_task = argparse.Namespace(**{**vars(sub), "nodes": 1})
    executor = make_executor(
        one_task, folder, f"evaluate-{item.label}", tasks_per_node=1, sbatch_extra=after
    )
    evaluate_id = executor.submit(
        EvaluateJob(spec, item, model_overrides, sub.submit, pretrain_id)
    ).job_id
    return {"pretrain": pretrain_id, "evaluate": evaluate_id}


def submit_ablation(spec: AblationSpec, sub: Any) -> tuple[list[str], dict[str, Any]]:
    """Validate, then submit every cell and baseline that is neither done nor queued/running:
    (the labels submitted, the job record). ConfigError before anything is created."""
    spec, jobs, baselines, model_sets = ablation.prepare(spec)
    record = read_jobs(spec.out_dir)
    if record["backend"] not in (None, sub.submit):
        record = {"backend": sub.submit, "jobs": {}}  # another cluster's ids mean nothing here
    record["backend"] = sub.submit
    submitted = []
    for item in [*jobs, *baselines]:
        state, detail = item_state(spec, item, record)
        if state in ("done", *ACTIVE):
            print(
                f"{item.label}: {state}{f' ({detail})' if detail else ''}; not submitted",
                flush=True,
            )
            continue
        overrides = model_sets[item.cell] if isinstance(item, Job) else model_sets[None]
        record["jobs"][item.label] = submit_item(spec, item, overrides, sub)
        write_jobs(spec.out_dir, record)
        ids = ", ".join(f"{stage} {i}" for stage, i in record["jobs"][item.label].items() if i)
        print(f"{item.label}: submitted ({ids})", flush=True)
        submitted.append(item.label)
    write_jobs(spec.out_dir, record)
    return submitted, record


def wait_all(spec: AblationSpec) -> None:
    """Until no job of the ablation is queued or running."""
    while True:
        record = read_jobs(spec.out_dir)
        if not any(item_state(spec, item, record)[0] in ACTIVE for item in work_items(spec)):
            return
        time.sleep(POLL_S)
