"""What a first cluster run meets, simulated with 3 CPU ranks through the real launcher:
unequal val shards under ZeRO-3 (every rank runs the same number of forwards, every val
image is counted once), a label outside the classes (counted and skipped, never an assert)."""

import json

import numpy as np
import pytest
from conftest import free_port, read_metrics, run_cli, tiny_config, write_config, zero

from mpp.data import WriterOptions, write_shards


def shards(out, sizes, prefix, label_of=lambda i: i % 10) -> list[str]:
    """One shard per entry of ``sizes``, random 16-px images, labels from ``label_of(index)``."""
    rng = np.random.default_rng(len(sizes))
    paths, start = [], 0
    for k, n in enumerate(sizes):
        samples = [
            (rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), label_of(start + i))
            for i in range(n)
        ]
        paths += write_shards(
            samples,
            out,
            f"{prefix}{k}",
            options=WriterOptions(max_count=n, seed=None, progress=False),
            class_names=[str(c) for c in range(10)],
        )
        start += n
    return paths


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    # a quarter of the training labels are 99 in a 10-class task
    train = shards(root / "train", [24, 24, 24, 24], "t", lambda i: 99 if i % 4 == 0 else i % 10)
    return {
        "train": train,
        "val4": shards(root / "val4", [5, 17, 3, 40], "v"),
        "val1": shards(root / "val1", [7], "w"),
    }


@pytest.mark.parametrize("val,expected", [("val4", 65), ("val1", 7)])
def test_three_ranks_zero3_finetune_on_unequal_val_shards_and_a_bad_label(
    tmp_path, digits16, data, val, expected
):
    raw = tiny_config(
        digits16,
        train={"batch_size": 12, "max_steps": 2, "epochs": 1, "ckpt_every": 100},
        deepspeed={"zero_optimization": zero(3)},
    )
    raw.pop("objective"), raw.pop("masking")
    raw["data"].update(train_shards=data["train"], val_shards=data[val], num_workers=1)
    raw["finetune"] = {
        "mixup": 0.0,
        "cutmix": 0.0,
        "randaug_n": 0,
        "reprob": 0.0,
        "eval_batch_size": 4,
    }
    path = write_config(tmp_path / "ft.json", raw)
    out = tmp_path / "ft"
    r = run_cli(
        [
            "deepspeed",
            "--num_gpus",
            "3",
            "--master_port",
            str(free_port()),
            "downstream/finetune.py",
            "--config",
            str(path),
            "--output-dir",
            str(out),
        ],
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["last"]["num_val"] == expected  # every val image once, whatever each rank's share
    train_records = [m for m in read_metrics(out) if "loss" in m]
    assert (
        train_records[-1]["step"] == 2 and train_records[-1]["skipped"] > 0
    )  # label 99: skipped, counted


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
            "deepspeed",
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
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
    from mpp.train.checkpoint import missing_rank_files

    for r in (0, 2):
        (tmp_path / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")
    assert "rank(s) [1] (of 3)" in missing_rank_files(tmp_path, 3, stage=2)
    assert "storage every node shares" in missing_rank_files(tmp_path, 3, stage=3)
    assert (
        missing_rank_files(tmp_path, 3, stage=0) is None
    )  # rank 0 writes a stage-0 checkpoint alone
    (tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"")
    assert missing_rank_files(tmp_path, 3, stage=2) is None


def test_probes_on_two_ranks_equal_one(tmp_path, digits16):
    """Features are extracted by every rank on its share and gathered in key order: k-NN and the
    linear probe on 2 ranks give what one process gives."""
    probe = {
        "name": "p",
        "init": "scratch",
        "model": {"name": "vit_tiny_patch4_16", "depth": 2, "embed_dim": 32, "num_heads": 2},
        "data": {
            "train_shards": digits16["train"],
            "val_shards": digits16["val"],
            "num_workers": 1,
        },
        "probe": {"epochs": 3, "batch_size": 128},
    }
    path = write_config(tmp_path / "probe.json", probe)
    results = {}
    for tool in ("knn", "linear_probe"):
        for ranks in (1, 2):
            out = tmp_path / f"{tool}{ranks}"
            launcher = (
                ["python"]
                if ranks == 1
                else ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port())]
            )
            r = run_cli(
                [
                    *launcher,
                    f"downstream/{tool}.py",
                    "--config",
                    str(path),
                    "--output-dir",
                    str(out),
                ]
            )
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
            results[tool, ranks] = json.loads((out / "results.json").read_text())
    for tool in ("knn", "linear_probe"):
        one, two = results[tool, 1], results[tool, 2]
        assert one["ranks"] == 1 and two["ranks"] == 2
        assert (
            one["num_train"] == two["num_train"] == 1497 and one["num_val"] == two["num_val"] == 300
        )
        assert two["top1"] == pytest.approx(one["top1"], abs=1e-9) and two["top5"] == pytest.approx(
            one["top5"], abs=1e-9
        )


def test_seven_train_shards_feed_four_ranks_times_two_workers(tmp_path, digits16):
    """Fewer shards than ranks x workers: the training stream is resampled (every worker draws
    from every shard), so the run needs no shard per worker and runs, every rank in step."""
    from mpp.data import expand_shards

    seven = expand_shards(digits16["train"])[:7]
    cfg = tiny_config(
        digits16,
        train={"max_steps": 3, "ckpt_every": 100},
        data={"train_shards": seven, "num_workers": 2},
    )
    path = write_config(tmp_path / "c.json", cfg)
    out = tmp_path / "run"
    r = run_cli(
        [
            "deepspeed",
            "--num_gpus",
            "4",
            "--master_port",
            str(free_port()),
            "pretrain/run.py",
            "--config",
            str(path),
            "--output-dir",
            str(out),
        ],
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    last = read_metrics(out)[-1]
    assert last["step"] == 3 and last["samples"] == 3 * 16
