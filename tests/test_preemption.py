"""Preemption through the real launcher: a signal makes every rank finish its step, write one
complete checkpoint and exit; --resume auto then continues bitwise (mpp/train/preemption.py)."""

import contextlib
import json
import os
import signal
import subprocess
import time

import psutil
from conftest import (
    BATCH,
    REPO,
    STEPS,
    cli_env,
    launch_cmd,
    read_metrics,
    run_cli,
    straight_config,
    tiny_config,
    write_config,
)
from PIL import Image

from mpp.checkpoint.format import complete_tags
from mpp.train.preemption import PREEMPTED_EXIT


def launch(cfg_path, out, extra=()) -> list[str]:
    """The command a user types (``deepspeed ...``): the signals here go to its runner too."""
    return launch_cmd(2, cfg_path, out, *extra, runner=True)


def run_until(cmd, out, step: int, send, log=None) -> int:
    """Start ``cmd``, call ``send(process)`` once ``step`` is logged, wait for every process of the
    job to end; the launcher's status. The job's output goes to ``log`` when given."""
    sink = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115  closed with the job
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=cli_env(),
        stdout=sink,
        stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 240
    while time.time() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and any(
            json.loads(x)["step"] >= step for x in metrics.read_text().splitlines() if x
        ):
            break
        time.sleep(0.02)
    job = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    send(proc)
    code = proc.wait(timeout=240)
    _, alive = psutil.wait_procs(job, timeout=240)  # the ranks outlive a launcher the signal killed
    assert not alive, alive
    if log:
        sink.close()
    return code


def ranks_of(proc) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "pretrain/run.py" in " ".join(p.cmdline())
        and "deepspeed.launcher" not in " ".join(p.cmdline())
    ]


def test_sigterm_to_the_launcher_and_sigusr1_to_the_ranks_checkpoint_and_resume_exactly(
    tmp_path, digits16, straight_runs
):
    """The uninterrupted run is the suite's ZeRO-0 one (conftest.straight_runs: 2 ranks x 2 data
    workers); the stopped run trains the same with no periodic checkpoint, so each checkpoint it
    has is a stop's."""
    straight, _ = straight_runs(0)
    cfg = straight_config(digits16, 0, ckpt_every=100)
    path = write_config(tmp_path / "c.json", cfg)
    stopped = tmp_path / "stopped"

    # what SLURM does at a job's end or on scancel: SIGTERM to every process of the job. The
    # `deepspeed` runner dies of it (it forwards nothing on one node); each rank finishes its step
    code = run_until(launch(path, stopped), stopped, 4, lambda p: os.killpg(p.pid, signal.SIGTERM))
    first = json.loads((stopped / "preempted.json").read_text())
    assert code != 0 and first["signal"] == "SIGTERM" and 4 <= first["step"] < STEPS
    assert (
        complete_tags(stopped / "checkpoints")[-1] == f"step{first['step']:08d}"
    )  # written whole, at that step

    # what `#SBATCH --signal=USR1@120` does under srun: SIGUSR1 to every rank; the launcher exits 75
    def usr1(proc):
        for rank in ranks_of(proc):
            rank.send_signal(signal.SIGUSR1)

    code = run_until(launch(path, stopped, ["--resume", "auto"]), stopped, first["step"] + 2, usr1)
    second = json.loads((stopped / "preempted.json").read_text())
    assert (
        code == PREEMPTED_EXIT
        and second["signal"] == "SIGUSR1"
        and first["step"] < second["step"] < STEPS
    )
    # Ctrl-C in a terminal: SIGINT to the whole foreground group (runner, launcher, ranks,
    # workers). The launcher adds a SIGTERM of its own: the record keeps the first signal
    log = tmp_path / "ctrl-c.log"
    ctrl_c = lambda p: os.killpg(p.pid, signal.SIGINT)  # noqa: E731
    run_until(launch(path, stopped), stopped, second["step"] + 2, ctrl_c, log)
    third = json.loads((stopped / "preempted.json").read_text())
    assert third["signal"] == "SIGINT" and second["step"] < third["step"] < STEPS
    assert complete_tags(stopped / "checkpoints")[-1] == f"step{third['step']:08d}"
    text = log.read_text()
    assert "going on from it" in text and "stopped: preempted by SIGINT" in text, text[-3000:]
    # a traceback only from DeepSpeed's runner (its KeyboardInterrupt), none from a rank or worker
    for block in text.split("Traceback (most recent call last):")[1:]:
        assert "deepspeed/launcher/runner.py" in block.split("KeyboardInterrupt")[0], block[:3000]

    # the same command again, no --resume: a run directory with a checkpoint goes on, saying so
    r = run_cli(launch(path, stopped))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"holds a checkpoint (step{third['step']:08d}): going on from it" in r.stderr
    # the line it ends with, and its curves (also `mpp plot` for any run)
    # this command's own steps and images, not the run's (issue 50 §5)
    own, at = STEPS - third["step"], third["step"]
    done = [x for x in r.stdout.splitlines() if x.startswith("done: ")]
    assert len(done) == 1 and done[0].startswith(f"done: {own} steps, {own * BATCH} images in ")
    assert f"img/s (resumed at step {at}: the run is at step {STEPS}); last loss " in done[0], done
    assert f"{stopped / 'curves.png'}" in done[0], done
    with Image.open(stopped / "curves.png") as pic:
        assert pic.format == "PNG" and pic.width > 400
    plotted = run_cli(
        ["python", "-m", "mpp", "plot", str(stopped), "--out", str(tmp_path / "c.png")]
    )
    assert plotted.returncode == 0 and (tmp_path / "c.png").stat().st_size > 1000, plotted.stderr

    steps = [m["step"] for m in read_metrics(stopped)]
    assert steps == list(range(1, STEPS + 1))  # each step once, across two stops
    a = {m["step"]: m["loss"] for m in read_metrics(straight)}
    b = {m["step"]: m["loss"] for m in read_metrics(stopped)}
    assert a == b  # the same batches and updates, bitwise


def test_sigterm_to_the_runner_alone_stops_every_rank_and_a_second_job_on_the_live_run_is_refused(
    tmp_path, digits16
):
    """What a container's PID 1, a user's `kill`, a CI timeout send: SIGTERM to the `deepspeed`
    runner only. It dies at once and forwards nothing; the ranks see their job lose its runner."""
    cfg = tiny_config(
        digits16, train={"max_steps": 100000, "ckpt_every": 100000}, data={"num_workers": 1}
    )
    path = write_config(tmp_path / "c.json", cfg)
    run = tmp_path / "run"
    proc = subprocess.Popen(
        launch(path, run),
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 240
        while (
            time.time() < deadline
            and len(read_metrics(run) if (run / "metrics.jsonl").exists() else []) < 3
        ):
            time.sleep(0.1)
        holder = json.loads((run / "job.lock").read_text())
        config_before = (run / "config.json").read_bytes()

        # a second job on the live directory: one line naming the holder, nothing written
        second = run_cli(launch(path, run, ["--resume", "auto"]))
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert second.returncode == 2 and len(errors) == 1, second.stderr[-3000:]
        assert (
            f"{run} is held by the job on {holder['host']} pid {holder['pid']} since {holder['since']}"
            in errors[0]
        )
        assert (
            proc.poll() is None and (run / "config.json").read_bytes() == config_before
        )  # the first goes on

        job = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGTERM)  # the runner alone
        assert proc.wait(timeout=30) != 0
        _, alive = psutil.wait_procs(job, timeout=60)
        assert not alive, alive  # no rank, launcher or data worker of the job left
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    stopped = json.loads((run / "preempted.json").read_text())
    assert (
        stopped["signal"] == "SIGHUP"
        and stopped["reason"] == f"the deepspeed runner (pid {proc.pid}) ended"
    )
    assert complete_tags(run / "checkpoints") == [
        f"step{stopped['step']:08d}"
    ]  # whole, at the step reached
    assert not (run / "job.lock").exists()  # released on the way out

    # a lock left by a job that died (kill -9) does not block; the resume finishes
    gone = subprocess.Popen(["sleep", "0"])
    gone.wait()
    (run / "job.lock").write_text(json.dumps({**holder, "pid": gone.pid}) + "\n")
    end = stopped["step"] + 2
    r = run_cli(launch(path, run, ["--resume", "auto", "--set", f"train.max_steps={end}"]))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "taking over the lock of a job that is gone" in r.stderr
    assert [m["step"] for m in read_metrics(run)] == list(range(1, end + 1))
    assert not (run / "job.lock").exists()
