"""The training monitor (mpp/train/monitor.py, issue 30 §3): knn.py's k-NN of the current encoder
and each objective's own held-out signal, every train.monitor_every steps, on any rank count
and ZeRO stage; and HPM's teacher views (mpp/objectives/hpm.py)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import launcher, read_metrics, run_cli, tiny_config, write_config, zero

from mpp.models.vit import create_vit
from mpp.objectives import create_objective
from mpp.objectives.hpm import masked_views, rank_correlation

SMALL = dict(decoder_dim=32, decoder_depth=1, decoder_heads=4)


def tiny(name: str, **kwargs):
    torch.manual_seed(0)
    encoder = create_vit("vit_tiny_patch4_16", depth=2, embed_dim=32, num_heads=2)
    extra = SMALL if name in ("mae", "hpm") else {}
    return create_objective(name, encoder, **{**extra, **kwargs}).eval()


@pytest.mark.parametrize(
    "name, kwargs, keys",
    [
        ("mpp", {}, {"masked_acc", "masked_loss"}),
        ("mpp", {"target": "pixel"}, {"masked_loss"}),
        ("mae", {}, {"rec_loss"}),
        ("hpm", {"base": "mae"}, {"rank_corr", "teacher_rank_corr", "rec_loss"}),
        ("hpm", {"base": "mpp"}, {"rank_corr", "teacher_rank_corr", "masked_acc", "masked_loss"}),
    ],
)
def test_every_objective_reports_its_held_out_signal_per_image(name, kwargs, keys):
    objective = tiny(name, **kwargs)
    images = torch.randn(5, 3, 16, 16)
    with torch.no_grad():
        metrics = objective.held_out_metrics(images)
    assert set(metrics) == keys
    assert all(v.shape == (5,) and torch.isfinite(v).all() for v in metrics.values())
    for k in keys & {"masked_acc", "rank_corr", "teacher_rank_corr"}:
        assert ((metrics[k] >= -1) & (metrics[k] <= 1)).all()
    if name == "mpp" and "masked_acc" in keys:  # the per-patch accuracy, averaged per image
        torch.manual_seed(3)
        out = objective.forward_per_patch(images)
        torch.manual_seed(3)
        again = objective.held_out_metrics(images)
        assert torch.equal(again["masked_acc"], out["correct"].mean(1))


@pytest.mark.parametrize("num_patches, num_masked", [(64, 48), (16, 8), (10, 4), (10, 7)])
def test_masked_views_mask_every_patch_with_the_exact_count(num_patches, num_masked):
    views = masked_views(3, num_patches, num_masked, "cpu")
    assert (views.sum(-1) == num_masked).all()
    assert (views.sum(0) >= 1).all()  # every patch is scored by a view that masks it
    if num_patches % (num_patches - num_masked) == 0:  # the visible sets partition the patches
        assert views.shape[0] == num_patches // (num_patches - num_masked)
        assert ((~views).sum(0) == 1).all()


def test_the_masked_teacher_view_averages_the_views_that_mask_each_patch():
    hpm = tiny("hpm", base="mae", teacher_view="masked")
    images = torch.randn(2, 3, 16, 16)
    torch.manual_seed(5)
    scores = hpm.teacher_scores(images)
    torch.manual_seed(5)
    views = masked_views(2, hpm.encoder.num_patches, hpm.num_masked, "cpu")
    by_hand = torch.zeros(2, hpm.encoder.num_patches)
    for mask in views:  # each view alone: the teacher's predictor on that view's tokens
        tokens = hpm.teacher["base"].predictor_tokens(images, mask)
        by_hand += hpm.predict_loss(tokens, hpm.teacher["predictor"]) * mask
    torch.testing.assert_close(scores, by_hand / views.sum(0))
    visible = tiny("hpm", base="mae")  # the paper's: the fully visible image
    tokens = visible.teacher["base"].predictor_tokens(images)
    torch.testing.assert_close(
        visible.teacher_scores(images), visible.predict_loss(tokens, visible.teacher["predictor"])
    )
    assert rank_correlation(scores, scores).allclose(torch.ones(2))


def tb_scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_the_monitor_on_three_zero3_ranks_is_what_knn_py_reports(tmp_path, digits16):
    """HPM on 3 ranks under ZeRO-3 (every parameter partitioned): the monitor before the first
    step, every 2 steps and after the last, into metrics.jsonl and TensorBoard; its last k-NN is
    knn.py's on the run's final encoder with the same bank and held-out split."""
    cfg = tiny_config(
        digits16,
        objective={"name": "hpm", "base": "mae", **SMALL, "teacher_view": "masked"},
        train={"batch_size": 12, "max_steps": 5, "monitor_every": 2, "ckpt_every": 100},
        data={"val_shards": digits16["val"]},
        deepspeed={"zero_optimization": zero(3)},
    )
    cfg.pop("masking")
    cfg["monitor"] = {"bank_per_class": 7}
    path = write_config(tmp_path / "c.json", cfg)
    out = tmp_path / "run"
    head = launcher(3)
    r = run_cli([*head, "pretrain/run.py", "--config", str(path), "--output-dir", str(out)])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    monitored = [m for m in read_metrics(out) if "monitor/knn_top1" in m]
    assert [m["step"] for m in monitored] == [0, 2, 4, 5]
    names = {"knn_top1", "knn_top5", "rank_corr", "teacher_rank_corr", "rec_loss", "seconds"}
    assert {k.removeprefix("monitor/") for k in monitored[-1] if "/" in k} == names
    assert monitored[-1]["monitor/rec_loss"] < monitored[0]["monitor/rec_loss"]  # it trained
    assert [s for s, _ in tb_scalars(out, "monitor/knn_top1")] == [0, 2, 4, 5]
    bank = (out / "monitor_bank_keys.txt").read_text().splitlines()
    assert len(bank) == 7 * 10
    knn = {"name": "k", "init": str(out), "model": cfg["model"], "data": {}}
    knn["data"] = {
        "train_shards": digits16["train"],
        "val_shards": digits16["val"],
        "num_workers": 1,
        "label_keys": str(out / "monitor_bank_keys.txt"),
    }
    probe = write_config(tmp_path / "knn.json", knn)
    r = run_cli(
        [
            "python",
            "downstream/knn.py",
            "--config",
            str(probe),
            "--output-dir",
            str(tmp_path / "knn"),
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "knn" / "results.json").read_text())
    assert res["num_train"] == 70 and res["num_val"] == 300
    assert res["top1"] == monitored[-1]["monitor/knn_top1"]
    assert res["top5"] == monitored[-1]["monitor/knn_top5"]
