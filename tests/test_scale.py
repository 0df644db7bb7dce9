"""What a first cluster run meets, simulated with 3 CPU ranks through the real launcher:
unequal val shards under ZeRO-3 (every rank runs the same number of forwards, every val
image is counted once), a label outside the classes (counted and skipped, never an assert).
The fine-tuning run is the suite's (conftest.zero3_finetune); fewer shards than ranks x data
workers is test_data_census's 3-rank run."""

import json

import pytest
from conftest import launcher, read_metrics, run_cli, tiny_config, write_config


def test_three_ranks_zero3_finetune_on_unequal_val_shards_and_a_bad_label(zero3_finetune):
    """conftest.zero3_finetune: 3 ranks under ZeRO-3; val shards of 5 and 40 images (rank 0: a
    full batch and a short one, rank 1: 10 batches, rank 2: no shard at all); a quarter of the 96
    training images labelled 99 in a 10-class task."""
    out = zero3_finetune["run"]
    assert zero3_finetune["config"]["deepspeed"]["zero_optimization"]["stage"] == 3
    res = json.loads((out / "results.json").read_text())
    assert res["last"]["num_val"] == 45  # every val image once, whatever each rank's share
    train_records = [m for m in read_metrics(out) if "loss" in m]
    assert (
        train_records[-1]["step"] == 8 and train_records[-1]["skipped"] > 0
    )  # label 99: skipped, counted; one epoch of 96 images in batches of 12


def test_ranks_that_see_different_files_agree_on_one_epoch_length_and_resume_tag(
    tmp_path, digits16
):
    root = tmp_path / "checkpoints"
    for step in (4, 8):  # two complete checkpoints; rank 1 will only "see" the older one
        (root / f"step{step:08d}").mkdir(parents=True)
        (root / f"step{step:08d}" / "COMPLETE").write_text("{}")
    path = write_config(tmp_path / "c.json", tiny_config(digits16))
    r = run_cli(
        [
            *launcher(2),
            "tests/rank_view.py",
            str(path),
            str(root),
        ]
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    by_rank = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert by_rank[0]["own"] != by_rank[1]["own"]  # the two views really differ
    assert (
        by_rank[0]["steps_per_epoch"] == by_rank[1]["steps_per_epoch"] == by_rank[0]["own"]
    )  # rank 0's
    assert by_rank[0]["tag"] == by_rank[1]["tag"] == "step00000008"


def test_rank_0_does_not_mark_a_checkpoint_complete_without_every_ranks_shard(tmp_path):
    from mpp.checkpoint.format import missing_rank_files

    for r in (0, 2):
        (tmp_path / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")
    assert "rank(s) [1] (of 3)" in missing_rank_files(tmp_path, 3, stage=2)
    assert "storage every node shares" in missing_rank_files(tmp_path, 3, stage=3)
    assert (
        missing_rank_files(tmp_path, 3, stage=0) is None
    )  # rank 0 writes a stage-0 checkpoint alone
    (tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"")
    assert missing_rank_files(tmp_path, 3, stage=2) is None


def test_probes_on_two_ranks_equal_one(tmp_path, one_rank_probes):
    """Features are extracted by every rank on its share and gathered in key order: k-NN and the
    linear probe on 2 ranks give what one process gives (conftest.one_rank_probes: the same
    config in one process)."""
    path = one_rank_probes["config"]
    for tool in ("knn", "linear_probe"):
        out = tmp_path / f"{tool}2"
        head = launcher(2)
        r = run_cli(
            [*head, f"downstream/{tool}.py", "--config", str(path), "--output-dir", str(out)]
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        one, two = one_rank_probes[tool], json.loads((out / "results.json").read_text())
        assert one["ranks"] == 1 and two["ranks"] == 2
        assert (
            one["num_train"] == two["num_train"] == 1497 and one["num_val"] == two["num_val"] == 300
        )
        assert one["skipped"] == two["skipped"] == 0  # every rank's count, summed
        assert two["top1"] == pytest.approx(one["top1"], abs=1e-9) and two["top5"] == pytest.approx(
            one["top5"], abs=1e-9
        )
