"""Submitting through submitit (mpp/submit.py): a 2-task job on the local executor is signalled as
SLURM signals a job before its time limit, requeues itself and finishes, each step once; the SLURM
path writes the sbatch file a cluster needs; the submission flags never reach the job."""

import csv
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

from mpp.submit import SubmitError, sbatch_options, split_argv, timeout_minutes, with_resume_auto
from mpp.train.preemption import SIGNALS

submitit = pytest.importorskip("submitit")


def test_the_submission_flags_are_taken_out_of_the_command_each_task_runs():
    argv = [
        "--config",
        "c.json",
        "--submit",
        "slurm",
        "--nodes=2",
        "--gpus-per-node",
        "8",
        "--set",
        "train.max_steps=5",
        "--partition",
        "p",
        "--time",
        "72:00:00",
        "--slurm-arg",
        "account=a",
        "--wait",
        "--gpus",
        "4",
        "--output-dir",
        "runs/x",
    ]  # (--gpus: an abbreviation, as argparse takes it)
    sub, rest = split_argv(argv)
    assert rest == ["--config", "c.json", "--set", "train.max_steps=5", "--output-dir", "runs/x"]
    assert (sub.submit, sub.nodes, sub.gpus_per_node, sub.partition, sub.time, sub.wait) == (
        "slurm",
        2,
        4,
        "p",
        "72:00:00",
        True,
    )
    assert sub.slurm_arg == ["account=a"]
    # the requeued command resumes: a given --resume is replaced, not doubled
    assert with_resume_auto(["--config", "c", "--resume", "runs/y/checkpoints"]) == [
        "--config",
        "c",
        "--resume",
        "auto",
    ]
    assert with_resume_auto(["--resume=runs/y", "--config", "c"]) == [
        "--config",
        "c",
        "--resume",
        "auto",
    ]
    assert with_resume_auto(["--config", "c"], keep_given=True) == [
        "--config",
        "c",
        "--resume",
        "auto",
    ]
    assert with_resume_auto(["--resume", "runs/y"], keep_given=True) == ["--resume", "runs/y"]


def test_slurm_time_formats_and_sbatch_options():
    assert [
        timeout_minutes(t) for t in ("90", "90:30", "72:00:00", "1-12", "1-0:30", "0-0:0:59")
    ] == [90, 91, 4320, 2160, 1470, 1]
    with pytest.raises(SubmitError, match="--time 3h"):
        timeout_minutes("3h")
    assert sbatch_options(["cpus-per-task=10", "--exclusive", "mail-type=END,FAIL"]) == {
        "cpus_per_task": "10",
        "exclusive": True,
        "mail_type": "END,FAIL",
    }
    assert (
        signal.SIGUSR2 in SIGNALS
    )  # submitit's preemption signal takes the checkpointing stop path


def test_submit_refuses_what_cannot_work_before_submitting(tmp_path, digits16, monkeypatch, capsys):
    from pretrain.run import main

    path = write_config(tmp_path / "c.json", tiny_config(digits16))
    base = ["--config", str(path), "--output-dir", str(tmp_path / "run")]
    assert main([*base, "--submit", "slurm"]) == 2
    assert (
        "--submit slurm needs --time" in capsys.readouterr().err
    )  # submitit's default limit is 5 minutes
    assert main([*base, "--submit", "local", "--nodes", "2"]) == 2
    assert "the local executor runs on this machine only" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "submitit", None)  # not installed
    assert main([*base, "--submit", "local"]) == 2
    assert "error: --submit needs submitit: pip install 'mpp[slurm]'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing written, nothing submitted


def stand_in_slurm(tmp_path):
    """No SLURM here: a ``bin`` folder for PATH whose ``sbatch`` keeps the file submitit writes
    (``tmp_path/job.sh``) and answers job 4242."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!/bin/sh\ncp \"$1\" {tmp_path}/job.sh\necho 'Submitted batch job 4242'\n")
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit looks for it before it submits
    for tool in (sbatch, bin_dir / "srun"):
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def test_submit_slurm_writes_the_sbatch_file_a_cluster_needs(tmp_path, digits16):
    """No SLURM here: a stand-in ``sbatch`` on PATH takes the file submitit writes."""
    bin_dir = stand_in_slurm(tmp_path)
    path = write_config(tmp_path / "c.json", tiny_config(digits16))
    out = tmp_path / "run"
    r = run_cli(
        [
            sys.executable,
            "pretrain/run.py",
            "--config",
            str(path),
            "--output-dir",
            str(out),
            "--submit",
            "slurm",
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--partition",
            "learn",
            "--time",
            "72:00:00",
            "--slurm-arg",
            "cpus-per-task=10",
            "--slurm-arg",
            "account=vision",
        ],
        env={"PATH": f"{bin_dir}:{cli_env()['PATH']}"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"submitted job 4242 (slurm, 2 node(s) x 8 task(s)) -> {out}" in r.stdout
    script = (tmp_path / "job.sh").read_text()
    for line in (
        "--nodes=2",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--partition=learn",
        "--time=4320",
        "--signal=USR2@90",
        "--cpus-per-task=10",
        "--account=vision",
        f"--output={out}/submitit/%j_0_log.out",
    ):
        assert f"#SBATCH {line}\n" in script, line
    assert script.count("--cpus-per-task") == 1  # replaced, not a second line
    job = submitit.helpers.DelayedSubmission.load(out / "submitit" / "4242_submitted.pkl").function
    assert job.script == "mpp.commands.pretrain"  # a module: it runs from any install
    assert job.argv == [
        "--config",
        str(path),
        "--output-dir",
        str(out),
        "--resume",
        "auto",
    ]  # any restart resumes


def test_a_submission_does_not_look_for_shards_seen_by_the_compute_nodes_only(
    tmp_path, digits16, monkeypatch, capsys
):
    """From a login node: shards that are not here, with the class count given, are the job's to
    read. Pretraining, fine-tuning and the probes submit alike (none asks for the data here)."""
    from mpp.commands import finetune, knn, pretrain, probe

    monkeypatch.setenv("PATH", f"{stand_in_slurm(tmp_path)}:{cli_env()['PATH']}")
    cluster = "/cluster/data/{}-{{000000..000003}}.tar"  # not on this machine
    data = [
        f"data.train_shards={cluster.format('train')}",
        f"data.val_shards={cluster.format('val')}",
    ]
    pretrain_cfg = write_config(tmp_path / "p.json", tiny_config(digits16))
    small = ["model.name=vit_tiny_patch4_16", "model.depth=1", "model.embed_dim=32", "init=scratch"]
    for main, config, sets in (
        (pretrain.main, str(pretrain_cfg), data),
        (finetune.main, "finetune_demo", [*data, *small, "finetune.num_classes=10"]),
        (knn.main, "linear_demo", [*data, *small, "data.num_classes=10"]),
        (probe.main, "linear_demo", [*data, *small, "data.num_classes=10"]),
    ):
        out = tmp_path / f"{main.__module__}"
        argv = ["--config", config, "--output-dir", str(out), "--submit", "slurm", "--time", "60"]
        assert main([*argv, *(x for s in sets for x in ("--set", s))]) == 0, capsys.readouterr().err
        assert (
            f"submitted job 4242 (slurm, 1 node(s) x 1 task(s)) -> {out}" in capsys.readouterr().out
        )
        assert (out / "submitit" / "4242_submitted.pkl").is_file()
        # run here instead, the same command is refused up front, nothing created
        here = ["--config", config, "--output-dir", str(tmp_path / "here")]
        assert main([*here, *(x for s in sets for x in ("--set", s))]) == 2
        assert "data.train_shards: 4 shard(s) not found" in capsys.readouterr().err
        assert not (tmp_path / "here").exists()


def test_a_local_job_signalled_before_its_time_limit_requeues_itself_and_finishes_each_step_once(
    tmp_path, digits16
):
    """What ``--signal=USR2@90`` does on SLURM, to each task of a 2-task job (2 gloo ranks): every rank
    stops after the same step with one complete checkpoint, rank 0 requeues the job through
    submitit, the local executor restarts both tasks with ``--resume auto`` and the run finishes."""
    cfg = tiny_config(digits16, train={"max_steps": 30, "ckpt_every": 100, "keep_last": 5})
    out = tmp_path / "run"
    status, stdout, job_id = run_signalled(
        write_config(tmp_path / "c.json", cfg), out, signal.SIGUSR2
    )
    assert status == 0, stdout
    assert f"job {job_id} ended: exit status 0" in stdout

    assert [m["step"] for m in read_metrics(out)] == list(
        range(1, 31)
    )  # each step once, across the requeue
    log = (out / "submitit" / f"{job_id}_0_log.err").read_text()  # both starts' (submitit appends)
    stops = re.findall(r"stopped: preempted by SIGUSR2 after step (\d+)", log)
    assert len(stops) == 1 and 3 <= (step := int(stops[0])) < 30
    assert log.count(f"Requeued job {job_id}") == 1
    assert (
        len(re.findall(rf"resumed from \S+/step{step:08d} at step {step}\n", log)) == 1
    )  # the stop's checkpoint
    assert not (
        out / "preempted.json"
    ).exists()  # the resumed run removed it: nothing is left stopped
    assert (out / "encoder.safetensors").is_file()
    requeued = submitit.helpers.DelayedSubmission.load(
        out / "submitit" / f"{job_id}_submitted.pkl"
    ).function
    assert requeued.argv[-2:] == ["--resume", "auto"]  # what checkpoint() handed to submitit


def test_a_stop_on_another_signal_ends_the_job_with_75_and_is_not_requeued(tmp_path, digits16):
    """scancel's SIGTERM (or Ctrl-C): the same checkpointing stop, but the job is over; --wait
    returns the run's status, 75, and the same command with --resume auto would continue."""
    cfg = tiny_config(digits16, train={"max_steps": 30, "ckpt_every": 100})
    out = tmp_path / "run"
    status, stdout, job_id = run_signalled(
        write_config(tmp_path / "c.json", cfg), out, signal.SIGTERM
    )
    assert status == 75, stdout
    stop = json.loads((out / "preempted.json").read_text())
    assert stop["signal"] == "SIGTERM" and 3 <= stop["step"] < 30
    assert [m["step"] for m in read_metrics(out)] == list(range(1, stop["step"] + 1))
    assert "Requeued" not in (out / "submitit" / f"{job_id}_0_log.err").read_text()


def run_signalled(cfg_path, out, signum: int) -> tuple[int, str, str]:
    """``pretrain/run.py --submit local --gpus-per-node 2 --wait``, ``signum`` to each task at step 3:
    (the command's exit status, its output, the job id)."""
    cmd = [
        sys.executable,
        "pretrain/run.py",
        "--config",
        str(cfg_path),
        "--output-dir",
        str(out),
        "--submit",
        "local",
        "--gpus-per-node",
        "2",
        "--time",
        "00:10:00",
        "--wait",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        first = proc.stdout.readline()
        job_id = re.search(r"submitted job (\d+) \(local", first)[1]
        wait_for_step(out, 3)
        tasks = psutil.Process(
            int(job_id)
        ).children()  # the local executor's controller: one task per rank
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
        if metrics.exists() and any(
            json.loads(x)["step"] >= step for x in metrics.read_text().splitlines() if x
        ):
            return
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout} s")


# ---- the ablation as jobs (pretrain/ablate.py --submit / --status) ---------------------------------


def ablation_cmd(tmp_path, digits16, grid: str, *extra: str) -> tuple[list[str], object]:
    from test_ablate import probe_config

    base = write_config(
        tmp_path / "base.json", tiny_config(digits16, train={"max_steps": 3, "ckpt_every": 100})
    )
    probe = write_config(tmp_path / "probe.json", probe_config(digits16))
    out = tmp_path / "abl"
    return [
        sys.executable,
        "pretrain/ablate.py",
        "--base",
        str(base),
        "--grid",
        grid,
        "--eval",
        "knn",
        "--probe-config",
        str(probe),
        "--output-dir",
        str(out),
        *extra,
    ], out


# the long cell's steps: it is killed as soon as it starts, and its rerun trains them all
LONG = 200


def test_a_submitted_ablation_shows_a_killed_cell_and_a_rerun_submits_only_that_one(
    tmp_path, digits16
):
    """Two cells as local jobs (a pretraining job and a dependent evaluation job each); the long
    cell's pretraining job is killed mid-run as ``scancel -s KILL`` would; --status names it and
    its job, and builds the table from the other; the same command again submits only the killed
    cell, which resumes, and with --wait completes the table."""
    from mpp.tools.ablation_jobs import saved_spec, status_rows

    cmd, out = ablation_cmd(
        tmp_path, digits16, f"train.max_steps=3,{LONG}", "--submit", "local", "--time", "00:20:00"
    )
    with open(
        tmp_path / "submit.log", "w+"
    ) as log:  # not a pipe: the local jobs inherit the submitter's stdout
        assert (
            subprocess.run(
                cmd, cwd=REPO, env=cli_env(), stdout=log, stderr=subprocess.STDOUT, timeout=240
            ).returncode
            == 0
        )
    assert "2 submitted; pretrain/ablate.py --status" in (tmp_path / "submit.log").read_text()
    record = json.loads((out / "jobs.json").read_text())
    assert record["backend"] == "local" and set(record["jobs"]) == {
        "train.max_steps=3/seed0",
        f"train.max_steps={LONG}/seed0",
    }
    killed = record["jobs"][f"train.max_steps={LONG}/seed0"]["pretrain"]
    pretrain = out / f"train.max_steps={LONG}" / "seed0" / "pretrain"
    deadline = time.monotonic() + 300
    # the run has started: its engine and data workers still to start, then LONG steps (> 4 s)
    while not (pretrain / "job.lock").is_file():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    controller = psutil.Process(int(killed))
    for proc in [controller, *controller.children(recursive=True)]:
        proc.kill()

    deadline = time.monotonic() + 600
    while any(state in ("queued", "running") for _, state, _ in status_rows(saved_spec(out))[1]):
        assert time.monotonic() < deadline, status_rows(saved_spec(out))[1]
        time.sleep(0.2)
    status = run_cli([sys.executable, "pretrain/ablate.py", "--status", str(out)])
    assert status.returncode == 1, status.stdout + status.stderr  # one failed
    assert re.search(r"train.max_steps=3/seed0\s+done\n", status.stdout), status.stdout
    assert re.search(
        rf"train.max_steps={LONG}/seed0\s+failed\s+pretrain job {killed} killed, log: \S+",
        status.stdout,
    )
    assert "2 runs: 1 done, 1 failed" in status.stdout
    md = (out / "results.md").read_text()
    assert re.search(r"\| 3 \| \d+\.\d\d ± 0\.00 \(1\) \|", md) and f"| {LONG} | failed (0) |" in md
    assert f"- {LONG}, seed 0, knn: failed" in md

    rerun = run_cli([*cmd, "--wait"], timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "train.max_steps=3/seed0: done; not submitted" in rerun.stdout
    assert (
        f"train.max_steps={LONG}/seed0: submitted (pretrain " in rerun.stdout
        and "1 submitted" in rerun.stdout
    )
    assert "2 runs: 2 done" in rerun.stdout
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["train.max_steps"], r["status"]) for r in rows] == [("3", "ok"), (str(LONG), "ok")]
    # the killed cell resumed (--resume auto) and logged every step once
    assert [m["step"] for m in read_metrics(pretrain)] == list(range(1, LONG + 1))

    # a probe as a job (--submit on downstream/*.py) computes what the ablation's direct run did
    knn = run_cli(
        [
            sys.executable,
            "downstream/knn.py",
            "--config",
            str(pretrain.parent / "knn" / "config.json"),
            "--output-dir",
            str(tmp_path / "knn"),
            "--submit",
            "local",
            "--wait",
        ]
    )
    assert knn.returncode == 0 and "ended: exit status 0" in knn.stdout, (
        knn.stdout[-3000:] + knn.stderr[-3000:]
    )
    assert json.loads((tmp_path / "knn" / "results.json").read_text())["top1"] == float(
        rows[1]["top1"]
    )


def test_a_slurm_ablation_submits_each_cells_evaluation_after_its_pretraining(tmp_path, digits16):
    """No SLURM here: a stand-in ``sbatch`` numbers the jobs and keeps the files submitit writes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        f"#!/bin/sh\nn=$(($(cat {tmp_path}/n 2>/dev/null || echo 100) + 1)); echo $n > {tmp_path}/n\n"
        f'cp "$1" {tmp_path}/job$n.sh\necho "Submitted batch job $n"\n'
    )
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).chmod(0o755)
    cmd, out = ablation_cmd(
        tmp_path,
        digits16,
        "masking.strategy=random,block",
        "--submit",
        "slurm",
        "--gpus-per-node",
        "8",
        "--time",
        "4:00:00",
        "--partition",
        "learn",
    )
    r = run_cli(cmd, env={"PATH": f"{bin_dir}:{cli_env()['PATH']}"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "masking.strategy=random/seed0: submitted (pretrain 101, evaluate 102)" in r.stdout
    assert "masking.strategy=block/seed0: submitted (pretrain 103, evaluate 104)" in r.stdout
    pretrain, evaluate = (tmp_path / "job101.sh").read_text(), (tmp_path / "job102.sh").read_text()
    for line in (
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--partition=learn",
        "--signal=USR2@90",
    ):
        assert f"#SBATCH {line}\n" in pretrain, line
    for line in (
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--dependency=afterok:101",
        "--kill-on-invalid-dep=yes",
    ):
        assert f"#SBATCH {line}\n" in evaluate, line
    assert "dependency" not in pretrain
    job = submitit.helpers.DelayedSubmission.load(
        out / "masking.strategy=random" / "seed0" / "submitit" / "102_submitted.pkl"
    )
    assert (
        job.function.pretrain_id == "101"
        and job.function.item.label == "masking.strategy=random/seed0"
    )

    # sacct says: the random cell pretrains, the block cell's pretraining was cancelled (and with
    # it its evaluation, kill_on_invalid_dep): --status says so, a rerun resubmits only the block cell
    (bin_dir / "sacct").write_text(
        "#!/bin/sh\necho 'JobID|State|NodeList'\necho '101|RUNNING|n1'\n"
        "echo '102|PENDING|(None)'\necho '103|CANCELLED by 0|n2'\necho '104|CANCELLED|(None)'\n"
    )
    (bin_dir / "sacct").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{cli_env()['PATH']}"}
    status = run_cli([sys.executable, "pretrain/ablate.py", "--status", str(out)], env=env)
    assert status.returncode == 3, status.stdout + status.stderr  # some still queued or running
    assert re.search(
        r"masking.strategy=random/seed0\s+running\s+pretraining: job 101\n", status.stdout
    ), status.stdout
    assert re.search(
        r"masking.strategy=block/seed0\s+failed\s+pretrain job 103 cancelled, log: ", status.stdout
    )
    rerun = run_cli(cmd, env=env)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert (
        "masking.strategy=random/seed0: running (pretraining: job 101); not submitted"
        in rerun.stdout
    )
    assert "masking.strategy=block/seed0: submitted (pretrain 105, evaluate 106)" in rerun.stdout
