"""HPM's EMA teacher under DeepSpeed ZeRO-2 and ZeRO-3, 2 CPU ranks, through the real launcher."""

import shutil
import sys

import pytest
import torch
from conftest import launcher, read_metrics, run_cli, tiny_config, write_config, zero

from mpp.checkpoint.format import zero_to_fp32
from mpp.objectives.hpm import momentum_at


@pytest.fixture(scope="module")
def hpm_runs(tmp_path_factory, digits16):
    tmp = tmp_path_factory.mktemp("hpm")
    runs = {}
    for stage in (2, 3):
        cfg = tiny_config(
            digits16,
            train={"max_steps": 3, "ckpt_every": 1, "keep_last": 3},
            objective={
                "name": "hpm",
                "base": "mae",
                "decoder_dim": 32,
                "decoder_depth": 1,
                "decoder_heads": 2,
                "momentum_start": 0.99,
                "momentum_end": 0.999,
                "momentum_epochs": 1,
            },
            deepspeed={"zero_optimization": zero(stage)},
            model={
                "grad_checkpointing": stage == 3
            },  # ZeRO-3 gathers again for each block's recompute
        )
        cfg.pop("masking")
        path = write_config(tmp / f"h{stage}.json", cfg)
        out = tmp / f"h{stage}"
        r = run_cli(
            [
                *launcher(2),
                "pretrain/run.py",
                "--config",
                str(path),
                "--output-dir",
                str(out),
            ]
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        runs[stage] = {s: zero_to_fp32(out / "checkpoints", f"step{s:08d}") for s in (2, 3)}
        runs[stage]["metrics"] = read_metrics(out)
        runs[stage]["run"] = (out, path)
    return runs


@pytest.mark.parametrize("stage", [2, 3])
def test_teacher_is_the_ema_of_the_student_after_a_step(hpm_runs, stage):
    before, after = hpm_runs[stage][2], hpm_runs[stage][3]
    teacher_keys = [k for k in after if k.startswith("teacher.")]
    assert len(teacher_keys) > 20  # the whole student: encoder, pixel decoder, loss predictor
    steps_per_epoch = 1497 // 16
    epoch = (
        2 * 16
    ) // 1497  # before step 3's micro-step: epoch 0; the momentum changes once per epoch
    assert epoch == 0 and 2 < steps_per_epoch
    m = momentum_at(epoch, 0.99, 0.999, 1)
    assert hpm_runs[stage]["metrics"][2]["teacher_momentum"] == pytest.approx(m, abs=1e-6)
    for k in teacher_keys:
        student = k.removeprefix("teacher.")
        expected = m * before[k] + (1 - m) * after[student]
        torch.testing.assert_close(after[k], expected, rtol=1e-5, atol=1e-6)
    moved = [k for k in teacher_keys if not torch.equal(after[k], before[k])]
    assert len(moved) > len(teacher_keys) // 2  # the teacher really moved


def test_zero2_and_zero3_keep_the_same_teacher(hpm_runs):
    z2, z3 = hpm_runs[2][3], hpm_runs[3][3]
    for k in (k for k in z2 if k.startswith("teacher.")):
        torch.testing.assert_close(z3[k], z2[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stage", [2, 3])
def test_an_elastic_resume_on_one_rank_keeps_the_teacher(hpm_runs, stage, tmp_path):
    """2 ranks -> 1: DeepSpeed's universal load restores trained parameters only; the frozen EMA
    teacher must come back too (mpp.checkpoint.manager), or step 3's teacher would average the initial one."""
    out, path = hpm_runs[stage]["run"]
    run = tmp_path / "run"
    shutil.copytree(out, run)
    shutil.rmtree(run / "checkpoints" / "step00000003")
    r = run_cli(
        [
            sys.executable,
            "pretrain/run.py",
            "--config",
            str(path),
            "--output-dir",
            str(run),
            "--resume",
            "auto",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "elastic resume" in r.stderr
    before, after = hpm_runs[stage][2], zero_to_fp32(run / "checkpoints", "step00000003")
    m = momentum_at(0, 0.99, 0.999, 1)
    bad = []
    for k in (k for k in after if k.startswith("teacher.")):
        expected = m * before[k] + (1 - m) * after[k.removeprefix("teacher.")]
        if not torch.allclose(after[k], expected, rtol=1e-5, atol=1e-7):
            bad.append((k, tuple(after[k].shape), (after[k] - expected).abs().max().item()))
    assert not bad, bad
