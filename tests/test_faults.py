"""Kill it, corrupt it, misconfigure it: nothing lost (issue: fault tolerance). Each test goes
through the real CLI, and the multi-rank ones through the real DeepSpeed launcher."""

import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    BATCH,
    REPO,
    STEPS,
    cli_env,
    launch_cmd,
    read_metrics,
    restamp,
    run_cli,
    tiny_config,
    write_config,
)
from PIL import Image
from test_downstream import Payload

from mpp.checkpoint.format import complete_tags


def last_per_step(metrics: list[dict]) -> dict[int, dict]:
    """A resumed run appends: the last record of each step is the one that stands."""
    return {m["step"]: m for m in metrics if "loss" in m}


def launch(cfg_path, out, extra=()) -> list[str]:
    return launch_cmd(2, cfg_path, out, *extra)


def test_sigkill_mid_epoch_then_resume_auto_equals_an_uninterrupted_run(tmp_path, straight_runs):
    """The uninterrupted run is the suite's ZeRO-0 one (conftest.straight_runs: 2 ranks x 2 data
    workers, a checkpoint every 4 steps); the killed run has its config."""
    straight, path = straight_runs(0)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        launch(path, killed),
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 240
    while (
        time.time() < deadline
    ):  # kill as soon as step 6 is logged: after the step-4 checkpoint, mid-epoch
        metrics = killed / "metrics.jsonl"
        if metrics.exists() and any(
            json.loads(x)["step"] >= 6 for x in metrics.read_text().splitlines()
        ):
            break
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "encoder.safetensors").exists(), "the run finished before the kill"
    killed_at = max(m["step"] for m in read_metrics(killed))
    assert 6 <= killed_at < STEPS

    # a save that was cut off: a newer tag, files truncated, no completion marker
    half = killed / "checkpoints" / "step00000099"
    half.mkdir()
    (half / "mp_rank_00_model_states.pt").write_bytes(b"\x80\x02 truncated")
    r = run_cli(launch(path, killed, ["--resume", "auto"]))
    assert r.returncode == 0, r.stderr[-3000:]
    (resumed,) = [line for line in r.stderr.splitlines() if "resumed from" in line]
    assert "step00000099" not in resumed
    assert "incomplete checkpoint(s) in" in r.stderr and not half.exists()  # removed

    steps = [m["step"] for m in read_metrics(killed)]
    assert steps == sorted(set(steps)), steps  # the replayed steps are logged once, not twice
    a, b = last_per_step(read_metrics(straight)), last_per_step(read_metrics(killed))
    assert sorted(b) == list(range(1, STEPS + 1))
    assert [b[s]["samples"] for s in range(1, STEPS + 1)] == [
        BATCH * s for s in range(1, STEPS + 1)
    ]  # no gap, no repeat
    assert [b[s]["loss"] for s in range(1, STEPS + 1)] == [
        a[s]["loss"] for s in range(1, STEPS + 1)
    ]  # the same batches, bitwise


def _jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8))
    out = io.BytesIO()
    img.save(out, format="JPEG")
    return out.getvalue()


def _write_shard(path: Path, samples: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, data in samples:
            for name, blob in ((f"{key}.jpg", data), (f"{key}.cls", b"0")):
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))


def test_garbage_jpegs_a_truncated_and_a_missing_shard_are_counted_and_the_run_completes(
    tmp_path, digits16
):
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    n_garbage = 0
    for s in range(4):
        samples = []
        for i in range(40):
            garbage = (s * 40 + i) % 20 == 7  # 5 %
            n_garbage += garbage
            samples.append((f"{s}-{i:03d}", os.urandom(300) if garbage else _jpeg(s * 40 + i)))
        _write_shard(shard_dir / f"train-{s:06d}.tar", samples)
    t = shard_dir / "train-000003.tar"
    t.write_bytes(t.read_bytes()[: t.stat().st_size // 2])  # truncated mid-member
    spec = str(shard_dir / "train-{000000..000004}.tar")  # 000004 does not exist
    cfg = tiny_config(
        digits16,
        data={"train_shards": spec, "num_workers": 2},  # counted: the cut shard's whole samples
        train={"max_steps": 12, "log_every": 4},
    )
    r = run_cli(
        [
            "python",
            "pretrain/run.py",
            "--config",
            str(write_config(tmp_path / "c.json", cfg)),
            "--output-dir",
            str(tmp_path / "run"),
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1 of 5 shards not found" in r.stderr and "train-000004.tar" in r.stderr
    last = read_metrics(tmp_path / "run")[-1]
    assert last["step"] == 12 and last["missing_shards"] == 1
    assert last["skipped"] >= 1  # garbage decodes and the truncated tail are counted
    assert (tmp_path / "run" / "encoder.safetensors").is_file()


def test_a_damaged_jpeg_is_named_once_a_command_and_skipped_counts_it_each_epoch_across_a_resume(
    tmp_path, digits16
):
    """Issue 50, finding 5: one damaged JPEG (a header, then garbage) in 48 samples, each trained
    once an epoch of 3 steps. 12 steps (4 epochs), stopped at step 4 (mid-epoch) and resumed:
    ``skipped`` ends at 4, one per epoch, as a straight run's does (it restarted at 0 after a
    resume), and each command names the sample once (every epoch did, before)."""
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    jpeg = _jpeg(99)
    damaged = jpeg[: jpeg.index(b"\xff\xda") + 14] + b"\x00\x01" * 200 + b"\xff\xd8\xff\xd9"
    for s in range(2):
        samples = [
            (f"{s}-{i:03d}", damaged if (s, i) == (1, 5) else _jpeg(24 * s + i)) for i in range(24)
        ]
        _write_shard(shard_dir / f"train-{s:06d}.tar", samples)
    spec = str(shard_dir / "train-{000000..000001}.tar")
    cfg = tiny_config(
        digits16,
        data={"train_shards": spec, "num_workers": 2},
        train={"max_steps": 12, "log_every": 2, "ckpt_every": 2},
    )
    cmd = ["python", "pretrain/run.py", "--config", str(write_config(tmp_path / "c.json", cfg))]
    cmd += ["--output-dir", str(tmp_path / "run")]
    stopped = run_cli([*cmd, "--set", "train.stop_at_step=4"])
    resumed = run_cli(cmd)
    for r in (stopped, resumed):
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stderr.count("train-000001.tar#1-005: cannot decode") == 1, r.stderr[-3000:]
    records = last_per_step(read_metrics(tmp_path / "run"))
    assert sorted(records) == list(range(2, 13, 2))
    assert records[12]["skipped"] == 4 and records[4]["skipped"] in (1, 2)
    assert [records[s]["skipped"] for s in sorted(records)] == sorted(
        records[s]["skipped"] for s in records
    )


def test_all_bad_shards_stop_the_run_with_their_names_not_a_hang(tmp_path, digits16):
    shard_dir = tmp_path / "bad"
    shard_dir.mkdir()
    for s in range(2):
        _write_shard(
            shard_dir / f"bad-{s:06d}.tar", [(f"{s}-{i}", os.urandom(200)) for i in range(30)]
        )
    cfg = tiny_config(
        digits16,
        data={
            "train_shards": str(shard_dir / "bad-{000000..000001}.tar"),
            "num_samples": 60,
            "num_workers": 1,
        },
    )
    t0 = time.time()
    r = run_cli(
        [
            "python",
            "pretrain/run.py",
            "--config",
            str(write_config(tmp_path / "c.json", cfg)),
            "--output-dir",
            str(tmp_path / "run"),
        ],
        timeout=120,
    )
    assert r.returncode == 1 and time.time() - t0 < 120
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-2000:]
    err = errors[0]
    assert "consecutive data failures" in err and "bad-00000" in err


def test_a_pickled_payload_in_a_checkpoint_is_refused_on_resume(
    tmp_path, one_rank_run, monkeypatch
):
    """A copy of the suite's one-process run (conftest.one_rank_run), its newest checkpoint
    (step 8) carrying a pickled payload."""
    run = tmp_path / "run"
    shutil.copytree(one_rank_run["run"], run)
    target = run / "checkpoints" / "step00000008" / "mp_rank_00_model_states.pt"
    state = torch.load(target, weights_only=True)
    mark = tmp_path / "pwned"
    monkeypatch.setenv("PAYLOAD_MARK", str(mark))
    state["evil"] = Payload()
    torch.save(state, target)
    restamp(target.parent)
    r = run_cli(
        [
            "python",
            "pretrain/run.py",
            "--config",
            str(one_rank_run["config"]),
            "--output-dir",
            str(run),
            "--resume",
            "auto",
            "--set",
            "train.max_steps=10",
        ],
        env={"PAYLOAD_MARK": str(mark), "PYTHONPATH": str(REPO / "tests")},
    )
    assert r.returncode != 0 and "Weights only load failed" in r.stderr
    assert not mark.exists()


def test_the_same_command_goes_on_and_restart_moves_the_earlier_run_aside(tmp_path, one_rank_run):
    """A copy of the suite's one-process run (8 steps, checkpoints at 4, 6, 8), its command run
    again with no --resume, then with --restart: nothing of an earlier invocation is deleted."""
    run = tmp_path / "run"
    shutil.copytree(one_rank_run["run"], run)
    # a save cut off before its marker (a second Ctrl-C), DeepSpeed's `latest` naming it: the
    # run that goes on removes it (no save of this run would: step 9 is not saved)
    half = run / "checkpoints" / "step00000009"
    half.mkdir()
    (half / "mp_rank_00_model_states.pt").write_bytes(b"\x80\x02 truncated")
    (run / "checkpoints" / "latest").write_text("step00000009")
    cmd = ["python", "pretrain/run.py", "--config", str(one_rank_run["config"])]
    cmd += ["--output-dir", str(run)]
    r = run_cli([*cmd, "--set", "train.max_steps=10"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{run} holds a checkpoint (step00000008): going on from it" in r.stderr
    assert f"removed 1 incomplete checkpoint(s) in {run / 'checkpoints'}" in r.stderr
    assert not half.exists() and complete_tags(run / "checkpoints")[-1] == "step00000010"
    assert [m["step"] for m in read_metrics(run)] == list(range(1, 11))  # 9 and 10 added
    # another config in the same run directory: what changed said, the earlier one kept
    (kept,) = run.glob("config.*.json")
    assert "was started with another config: train.max_steps 8 -> 10" in r.stderr
    assert f"kept as {kept.name}" in r.stderr
    assert json.loads(kept.read_text())["train"]["max_steps"] == 8
    assert json.loads((run / "config.json").read_text())["train"]["max_steps"] == 10

    r = run_cli([*cmd, "--set", "train.max_steps=2", "--restart"])
    assert r.returncode == 0, r.stderr[-3000:]
    (aside,) = tmp_path.glob("run.before-*")
    assert f"--restart: the earlier run moved to {aside}" in r.stderr
    assert complete_tags(aside / "checkpoints")[-1] == "step00000010"
    assert [m["step"] for m in read_metrics(aside)] == list(range(1, 11))
    assert [m["step"] for m in read_metrics(run)] == [1, 2]

    both = run_cli([*cmd, "--restart", "--resume", "auto"])
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_pipe_shards_are_refused_unless_allowed(tmp_path, digits16, capsys):
    from pretrain.run import main

    cfg = tiny_config(digits16, data={"train_shards": "pipe:cat /etc/hostname", "num_samples": 10})
    code = main(
        [
            "--config",
            str(write_config(tmp_path / "c.json", cfg)),
            "--output-dir",
            str(tmp_path / "run"),
        ]
    )
    assert (
        code == 2
        and "data.allow_pipe" in capsys.readouterr().err
        and not (tmp_path / "run").exists()
    )


def test_the_run_writes_only_under_its_output_directory(one_rank_run):
    """The suite's one-process run (conftest.one_rank_run: 8 steps, 4 checkpoints, 2 data
    workers), watched under the repository and beside the shards while it ran."""
    outside = one_rank_run["outside"]
    assert not outside, f"wrote outside the run directory: {outside[:5]}"
    assert (one_rank_run["run"] / "metrics.jsonl").is_file()


def test_a_nan_at_step_5_rolls_back_and_finishes_or_stops_naming_the_step(tmp_path, digits16):
    """train.on_nonfinite: rollback reloads the step-4 checkpoint, moves the data past the failed
    window, scales the lr, records the event and finishes; stop exits 1 naming the step."""
    env = {
        "MPP_INJECT_NONFINITE_AT_STEP": "5"
    }  # the check reports a NaN when step 5 is first tried
    cfg = tiny_config(
        digits16,
        train={
            "max_steps": 8,
            "ckpt_every": 2,
            "max_bad_steps": 0,
            "on_nonfinite": "rollback",
            "rollback_lr_scale": 0.5,
        },
    )
    path = write_config(tmp_path / "r.json", cfg)
    r = run_cli(launch(path, tmp_path / "rb"), env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    records = read_metrics(tmp_path / "rb")
    train = [m for m in records if "loss" in m]
    assert [m["step"] for m in train] == list(
        range(1, 9)
    )  # all steps, each once (4 was rewound to)
    (event,) = [m for m in records if m.get("event") == "rollback"]
    assert event["failed_step"] == 5 and event["to_step"] == 4 and event["lr_scale"] == 0.5
    assert np.isfinite(train[-1]["loss"]) and train[-1]["samples"] == 8 * 16
    from mpp.train.optim import lr_at

    schedule = dict(
        peak=1e-3, total=8, warmup=2
    )  # tiny_config's; the lr logged at step s is lr_at(s - 1)
    assert train[3]["lr"] == pytest.approx(lr_at(3, **schedule))
    assert train[4]["lr"] == pytest.approx(0.5 * lr_at(4, **schedule))  # after the rollback: scaled

    cfg["train"].update(on_nonfinite="stop", max_bad_steps=10)
    path = write_config(tmp_path / "s.json", cfg)
    r = run_cli(launch(path, tmp_path / "st"), env=env)
    assert r.returncode == 1 and "non-finite loss at step 5" in r.stderr
    assert max(m["step"] for m in read_metrics(tmp_path / "st")) == 4
