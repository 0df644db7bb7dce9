"""Preemption through the real launcher: a signal makes every rank finish its step, write one
complete checkpoint and exit; --resume auto then continues bitwise (mpp/preemption.py)."""

import json
import os
import signal
import subprocess
import time

import psutil
from conftest import REPO, cli_env, free_port, read_metrics, run_cli, tiny_config, write_config

from mpp.checkpoint import complete_tags
from mpp.preemption import PREEMPTED_EXIT


def launch(cfg_path, out, extra=()) -> list[str]:
    return ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "pretrain/run.py",
            "--config", str(cfg_path), "--output-dir", str(out), *extra]  # fmt: skip


def run_until(cmd, out, step: int, send) -> int:
    """Start ``cmd``, call ``send(process)`` once ``step`` is logged, wait for every process of the
    job to end; the launcher's status."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    deadline = time.time() + 240
    while time.time() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and any(json.loads(x)["step"] >= step for x in metrics.read_text().splitlines() if x):
            break
        time.sleep(0.02)
    job = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    send(proc)
    code = proc.wait(timeout=240)
    _, alive = psutil.wait_procs(job, timeout=240)  # the ranks outlive a launcher the signal killed
    assert not alive, alive
    return code


def ranks_of(proc) -> list[psutil.Process]:
    return [p for p in psutil.Process(proc.pid).children(recursive=True) if "pretrain/run.py" in " ".join(p.cmdline())
            and "deepspeed.launcher" not in " ".join(p.cmdline())]  # fmt: skip


def test_sigterm_to_the_launcher_and_sigusr1_to_the_ranks_checkpoint_and_resume_exactly(tmp_path, digits16):
    cfg = tiny_config(digits16, train={"max_steps": 16, "ckpt_every": 100, "keep_last": 5}, data={"num_workers": 2})
    path = write_config(tmp_path / "c.json", cfg)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    r = run_cli(launch(path, straight))
    assert r.returncode == 0, r.stderr[-3000:]

    # what SLURM does at a job's end or on scancel: SIGTERM to every process of the job. The
    # `deepspeed` runner dies of it (it forwards nothing on one node); each rank finishes its step
    code = run_until(launch(path, stopped), stopped, 4, lambda p: os.killpg(p.pid, signal.SIGTERM))
    first = json.loads((stopped / "preempted.json").read_text())
    assert code != 0 and first["signal"] == "SIGTERM" and 4 <= first["step"] < 16
    assert complete_tags(stopped / "checkpoints")[-1] == f"step{first['step']:08d}"  # written whole, at that step
    # what `#SBATCH --signal=USR1@120` does under srun: SIGUSR1 to every rank; the launcher exits 75
    def usr1(proc):
        for rank in ranks_of(proc):
            rank.send_signal(signal.SIGUSR1)

    code = run_until(launch(path, stopped, ["--resume", "auto"]), stopped, first["step"] + 3, usr1)
    second = json.loads((stopped / "preempted.json").read_text())
    assert code == PREEMPTED_EXIT and second["signal"] == "SIGUSR1" and first["step"] < second["step"] < 16
    r = run_cli(launch(path, stopped, ["--resume", "auto"]))
    assert r.returncode == 0, r.stderr[-3000:]

    steps = [m["step"] for m in read_metrics(stopped)]
    assert steps == list(range(1, 17))  # each step once, across two stops
    a = {m["step"]: m["loss"] for m in read_metrics(straight)}
    b = {m["step"]: m["loss"] for m in read_metrics(stopped)}
    assert a == b  # the same batches and updates, bitwise
