"""Submitting through submitit (mpp/submit.py): a 2-task job on the local executor is signalled as
SLURM signals a job before its time limit, requeues itself and finishes, each step once; the SLURM
path writes the sbatch file a cluster needs; the submission flags never reach the job."""

import json
import re
import signal
import stat
import subprocess
import sys
import time

import psutil
import pytest
from conftest import REPO, cli_env, read_metrics, run_cli, tiny_config, write_config

from mpp.preemption import SIGNALS
from mpp.submit import SubmitError, sbatch_options, split_argv, timeout_minutes, with_resume_auto

submitit = pytest.importorskip("submitit")


def test_the_submission_flags_are_taken_out_of_the_command_each_task_runs():
    argv = ["--config", "c.json", "--submit", "slurm", "--nodes=2", "--gpus-per-node", "8", "--set",
            "train.max_steps=5", "--partition", "p", "--time", "72:00:00", "--slurm-arg", "account=a", "--wait",
            "--gpus", "4", "--output-dir", "runs/x"]  # fmt: skip  (--gpus: an abbreviation, as argparse takes it)
    sub, rest = split_argv(argv)
    assert rest == ["--config", "c.json", "--set", "train.max_steps=5", "--output-dir", "runs/x"]
    assert (sub.submit, sub.nodes, sub.gpus_per_node, sub.partition, sub.time, sub.wait) == ("slurm", 2, 4, "p", "72:00:00", True)
    assert sub.slurm_arg == ["account=a"]
    # the requeued command resumes: a given --resume is replaced, not doubled
    assert with_resume_auto(["--config", "c", "--resume", "runs/y/checkpoints"]) == ["--config", "c", "--resume", "auto"]
    assert with_resume_auto(["--resume=runs/y", "--config", "c"]) == ["--config", "c", "--resume", "auto"]
    assert with_resume_auto(["--config", "c"], keep_given=True) == ["--config", "c", "--resume", "auto"]
    assert with_resume_auto(["--resume", "runs/y"], keep_given=True) == ["--resume", "runs/y"]


def test_slurm_time_formats_and_sbatch_options():
    assert [timeout_minutes(t) for t in ("90", "90:30", "72:00:00", "1-12", "1-0:30", "0-0:0:59")] == [90, 91, 4320, 2160, 1470, 1]
    with pytest.raises(SubmitError, match="--time 3h"):
        timeout_minutes("3h")
    assert sbatch_options(["cpus-per-task=10", "--exclusive", "mail-type=END,FAIL"]) == {
        "cpus_per_task": "10", "exclusive": True, "mail_type": "END,FAIL"}  # fmt: skip
    assert signal.SIGUSR2 in SIGNALS  # submitit's preemption signal takes the checkpointing stop path


def test_submit_refuses_what_cannot_work_before_submitting(tmp_path, digits16, monkeypatch, capsys):
    from pretrain.run import main

    path = write_config(tmp_path / "c.json", tiny_config(digits16))
    base = ["--config", str(path), "--output-dir", str(tmp_path / "run")]
    assert main([*base, "--submit", "slurm"]) == 2
    assert "--submit slurm needs --time" in capsys.readouterr().err  # submitit's default limit is 5 minutes
    assert main([*base, "--submit", "local", "--nodes", "2"]) == 2
    assert "the local executor runs on this machine only" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "submitit", None)  # not installed
    assert main([*base, "--submit", "local"]) == 2
    assert "error: --submit needs submitit: pip install 'mpp[slurm]'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing written, nothing submitted


def test_submit_slurm_writes_the_sbatch_file_a_cluster_needs(tmp_path, digits16):
    """No SLURM here: a stand-in ``sbatch`` on PATH takes the file submitit writes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!/bin/sh\ncp \"$1\" {tmp_path}/job.sh\necho 'Submitted batch job 4242'\n")
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit looks for it before it submits
    for tool in (sbatch, bin_dir / "srun"):
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    path = write_config(tmp_path / "c.json", tiny_config(digits16))
    out = tmp_path / "run"
    r = run_cli([sys.executable, "pretrain/run.py", "--config", str(path), "--output-dir", str(out), "--submit",
                 "slurm", "--nodes", "2", "--gpus-per-node", "8", "--partition", "learn", "--time", "72:00:00",
                 "--slurm-arg", "cpus-per-task=10", "--slurm-arg", "account=vision"],
                env={"PATH": f"{bin_dir}:{cli_env()['PATH']}"})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"submitted job 4242 (slurm, 2 node(s) x 8 task(s)) -> {out}" in r.stdout
    script = (tmp_path / "job.sh").read_text()
    for line in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=learn", "--time=4320",
                 "--signal=USR2@90", "--cpus-per-task=10", "--account=vision", f"--output={out}/submitit/%j_0_log.out"):  # fmt: skip
        assert f"#SBATCH {line}\n" in script, line
    assert script.count("--cpus-per-task") == 1  # replaced, not a second line
    job = submitit.helpers.DelayedSubmission.load(out / "submitit" / "4242_submitted.pkl").function
    assert job.script == str(REPO / "pretrain" / "run.py")
    assert job.argv == ["--config", str(path), "--output-dir", str(out), "--resume", "auto"]  # any restart resumes


def test_a_local_job_signalled_before_its_time_limit_requeues_itself_and_finishes_each_step_once(tmp_path, digits16):
    """What ``--signal=USR2@90`` does on SLURM, to each task of a 2-task job (2 gloo ranks): every rank
    stops after the same step with one complete checkpoint, rank 0 requeues the job through
    submitit, the local executor restarts both tasks with ``--resume auto`` and the run finishes."""
    cfg = tiny_config(digits16, train={"max_steps": 30, "ckpt_every": 100, "keep_last": 5})
    out = tmp_path / "run"
    status, stdout, job_id = run_signalled(write_config(tmp_path / "c.json", cfg), out, signal.SIGUSR2)
    assert status == 0, stdout
    assert f"job {job_id} ended: exit status 0" in stdout

    assert [m["step"] for m in read_metrics(out)] == list(range(1, 31))  # each step once, across the requeue
    log = (out / "submitit" / f"{job_id}_0_log.err").read_text()  # both starts' (submitit appends)
    stops = re.findall(r"stopped: preempted by SIGUSR2 after step (\d+)", log)
    assert len(stops) == 1 and 3 <= (step := int(stops[0])) < 30
    assert log.count(f"Requeued job {job_id}") == 1
    assert len(re.findall(rf"resumed from \S+/step{step:08d} at step {step}\n", log)) == 1  # the stop's checkpoint
    assert not (out / "preempted.json").exists()  # the resumed run removed it: nothing is left stopped
    assert (out / "encoder.safetensors").is_file()
    requeued = submitit.helpers.DelayedSubmission.load(out / "submitit" / f"{job_id}_submitted.pkl").function
    assert requeued.argv[-2:] == ["--resume", "auto"]  # what checkpoint() handed to submitit


def test_a_stop_on_another_signal_ends_the_job_with_75_and_is_not_requeued(tmp_path, digits16):
    """scancel's SIGTERM (or Ctrl-C): the same checkpointing stop, but the job is over; --wait
    returns the run's status, 75, and the same command with --resume auto would continue."""
    cfg = tiny_config(digits16, train={"max_steps": 30, "ckpt_every": 100})
    out = tmp_path / "run"
    status, stdout, job_id = run_signalled(write_config(tmp_path / "c.json", cfg), out, signal.SIGTERM)
    assert status == 75, stdout
    stop = json.loads((out / "preempted.json").read_text())
    assert stop["signal"] == "SIGTERM" and 3 <= stop["step"] < 30
    assert [m["step"] for m in read_metrics(out)] == list(range(1, stop["step"] + 1))
    assert "Requeued" not in (out / "submitit" / f"{job_id}_0_log.err").read_text()


def run_signalled(cfg_path, out, signum: int) -> tuple[int, str, str]:
    """``pretrain/run.py --submit local --gpus-per-node 2 --wait``, ``signum`` to each task at step 3:
    (the command's exit status, its output, the job id)."""
    cmd = [sys.executable, "pretrain/run.py", "--config", str(cfg_path), "--output-dir", str(out), "--submit", "local",
           "--gpus-per-node", "2", "--time", "00:10:00", "--wait"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline()
        job_id = re.search(r"submitted job (\d+) \(local", first)[1]
        wait_for_step(out, 3)
        tasks = psutil.Process(int(job_id)).children()  # the local executor's controller: one task per rank
        assert len(tasks) == 2
        for task in tasks:
            task.send_signal(signum)
        rest, _ = proc.communicate(timeout=150)
    finally:
        proc.kill()
    return proc.returncode, first + rest, job_id


def wait_for_step(out, step: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    metrics = out / "metrics.jsonl"
    while time.time() < deadline:
        if metrics.exists() and any(json.loads(x)["step"] >= step for x in metrics.read_text().splitlines() if x):
            return
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout} s")
