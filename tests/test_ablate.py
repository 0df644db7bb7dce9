"""pretrain/ablate.py: a grid of masking settings x seeds through the real deepspeed launcher,
the table and the plot, reruns that skip finished cells and resume a half-done one, a failed
cell that does not stop the others, bad cells refused before anything runs, and a stop signal
that ends the ablation with 75 for the same command to continue."""

import csv
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, cli_env, read_metrics, run_cli, tiny_config, write_config
from PIL import Image

import mpp.tools.ablation
from mpp.config import ConfigError
from mpp.tools.ablation import AblationSpec, Cell, Job, load_spec, pretrain_args
from mpp.train.preemption import PREEMPTED_EXIT
from pretrain.ablate import main, parse_args, split_values

# The evaluations' own configs name a different (larger) model on purpose: the runner must
# hand them the pretraining's architecture.
OTHER_MODEL = {"name": "vit_tiny_patch4_32", "depth": 4, "embed_dim": 128, "num_heads": 4}


def probe_config(digits) -> dict:
    return {
        "name": "p",
        "model": OTHER_MODEL,
        "data": {"train_shards": digits["train"], "val_shards": digits["val"], "num_workers": 1},
        "probe": {"epochs": 3, "batch_size": 128, "warmup_epochs": 1},
    }


def finetune_config(digits) -> dict:
    return {
        "name": "ft",
        "model": {**OTHER_MODEL, "drop_path_rate": 0.1},
        "finetune": {"mixup": 0.0, "cutmix": 0.0, "randaug_n": 0, "reprob": 0.0},
        "data": {
            "train_shards": digits["train"],
            "val_shards": digits["val"],
            "num_workers": 1,
            "shuffle_buffer": 64,
        },
        "optim": {"lr": 1e-3, "layer_decay": 0.75},
        "train": {"batch_size": 16, "max_steps": 2, "log_every": 1, "ckpt_every": 100},
        "deepspeed": {"zero_optimization": {"stage": 0}},
    }


def read_rows(out):
    with open(out / "results.csv") as f:
        return list(csv.DictReader(f))


def mtimes(out):
    return {
        p: p.stat().st_mtime_ns
        for p in out.rglob("*")
        if p.is_file() and not p.name.startswith("results.")
    }


@pytest.fixture(scope="module")
def ablation(tmp_path_factory, digits16):
    """random vs block, 2 seeds, k-NN; default launcher arguments (2 CPU ranks)."""
    tmp = tmp_path_factory.mktemp("ablation")
    base = write_config(
        tmp / "base.json", tiny_config(digits16, train={"max_steps": 3, "ckpt_every": 2})
    )
    probe = write_config(tmp / "probe.json", probe_config(digits16))
    out = tmp / "abl"
    cmd = [
        "python",
        "pretrain/ablate.py",
        "--base",
        str(base),
        "--grid",
        "masking.strategy=random,block",
        "--seeds",
        "2",
        "--eval",
        "knn",
        "--probe-config",
        str(probe),
        "--output-dir",
        str(out),
    ]
    first = run_cli(cmd, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return cmd, out, first


def test_every_cell_and_seed_is_pretrained_evaluated_and_tabulated(ablation):
    _, out, _ = ablation
    rows = read_rows(out)
    assert [(r["masking.strategy"], r["seed"], r["eval"], r["status"]) for r in rows] == [
        (s, str(seed), "knn", "ok") for s in ("random", "block") for seed in (0, 1)
    ]
    for r in rows:
        run = out / f"masking.strategy={r['masking.strategy']}" / f"seed{r['seed']}"
        pre = json.loads((run / "pretrain" / "config.json").read_text())
        assert pre["masking"]["strategy"] == r["masking.strategy"] and pre["train"]["seed"] == int(
            r["seed"]
        )
        assert (
            "dist_world_size=2" in (run / "pretrain.log").read_text()
        )  # through the launcher, 2 ranks
        knn = json.loads((run / "knn" / "config.json").read_text())
        assert knn["init"] == str(run / "pretrain") and knn["seed"] == int(r["seed"])
        assert (knn["model"]["name"], knn["model"]["depth"], knn["model"]["embed_dim"]) == (
            "vit_tiny_patch4_16",
            2,
            32,
        )
        assert float(r["top1"]) == json.loads((run / "knn" / "results.json").read_text())["top1"]

    table = (out / "results.md").read_text()
    for strategy in ("random", "block"):
        for metric in ("top1", "top5"):
            values = [float(r[metric]) for r in rows if r["masking.strategy"] == strategy]
            cell = f"{statistics.fmean(values):.2f} ± {statistics.stdev(values):.2f} (2)"
            assert f"| {strategy} | {cell} |" in table, (cell, table)

    img = Image.open(out / "results.png")
    assert img.format == "PNG" and img.width >= 400 and img.height >= 300
    colours = {c for _, c in img.convert("RGB").getcolors(1 << 20)}
    # a bar in matplotlib's tab10 blue, text and error bars
    assert (31, 119, 180) in colours and (0, 0, 0) in colours


def test_rerun_skips_finished_cells_and_resumes_a_half_done_one(ablation):
    cmd, out, _ = ablation
    before = mtimes(out)
    again = run_cli(cmd, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count(": skip") == 4 and ": pretrain" not in again.stdout, again.stdout
    assert mtimes(out) == before  # nothing launched, nothing rewritten
    assert len(read_rows(out)) == 4

    # a run killed after its step-2 checkpoint: no step-3 checkpoint, no encoder, no k-NN result
    run = out / "masking.strategy=block" / "seed1"
    top1 = json.loads((run / "knn" / "results.json").read_text())["top1"]
    shutil.rmtree(run / "pretrain" / "checkpoints" / "step00000003")
    (run / "pretrain" / "encoder.safetensors").unlink()
    (run / "knn" / "results.json").unlink()
    third = run_cli(cmd, timeout=600)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert third.stdout.count(": skip") == 3
    assert "masking.strategy=block/seed1: pretrain (resume from step00000002)" in third.stdout
    log = (run / "pretrain.log").read_text()
    assert (
        log.count("$ deepspeed") == 2 and "step00000002 at step 2" in log
    )  # resumed, not restarted
    assert json.loads((run / "knn" / "results.json").read_text())["top1"] == top1  # the same step 3


def test_a_failed_cell_is_reported_and_the_others_go_on(tmp_path, digits16):
    """The first cell's lr diverges at runtime (NaN at step 2, train.max_bad_steps=0): it fails
    in pretraining, is recorded with its log, and the next cell is still pretrained,
    fine-tuned and probed. The baselines fine-tune the base architecture from scratch, one on
    its own (longer) recipe and one on the cells', each labelled."""
    base = write_config(
        tmp_path / "base.json",
        tiny_config(
            digits16,
            optim={"warmup_steps": 0},
            train={"max_steps": 3, "ckpt_every": 100, "max_bad_steps": 0},
        ),
    )
    spec = {
        "base": str(base),
        "grid": {"optim.lr": [1e30, 1e-3]},
        "seeds": 1,
        "eval": ["finetune", "linear"],
        "launcher_args": ["--num_gpus", "1"],
        "output_dir": str(tmp_path / "abl"),
        "finetune_config": str(write_config(tmp_path / "ft.json", finetune_config(digits16))),
        "probe_config": str(write_config(tmp_path / "probe.json", probe_config(digits16))),
    }
    own = finetune_config(digits16)
    own["train"]["max_steps"] = 4
    spec["scratch_config"] = str(write_config(tmp_path / "scratch.json", own))
    r = run_cli(
        ["python", "pretrain/ablate.py", "--spec", str(write_config(tmp_path / "spec.json", spec))],
        timeout=600,
    )
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "abl"
    rows = {(row["optim.lr"], row["eval"]): row for row in read_rows(out)}
    bad_log = out / "optim.lr=1e+30" / "seed0" / "pretrain.log"
    for kind in ("finetune", "linear"):
        assert rows[("1e+30", kind)]["status"] == "failed" and rows[("1e+30", kind)]["path"] == str(
            bad_log
        )
        assert (
            rows[("0.001", kind)]["status"] == "ok"
            and 0 <= float(rows[("0.001", kind)]["top1"]) <= 100
        )
    assert "non-finite loss" in bad_log.read_text()
    assert "optim.lr=1e+30/seed0: pretrain FAILED (exit 1)" in r.stdout
    assert "| 1e+30 | failed (0) | failed (0) |" in (out / "results.md").read_text()
    ft = json.loads((out / "optim.lr=0.001" / "seed0" / "finetune" / "config.json").read_text())
    assert (ft["model"]["name"], ft["model"]["depth"], ft["model"]["embed_dim"]) == (
        "vit_tiny_patch4_16",
        2,
        32,
    )
    assert (
        ft["model"]["drop_path_rate"] == 0.1
    )  # the fine-tuning recipe's own, not the pretraining's 0
    assert Image.open(out / "results.png").format == "PNG"

    baselines = {row["baseline"]: row for row in read_rows(out) if row["baseline"]}
    assert set(baselines) == {"scratch_own", "scratch_same"}
    for name, steps in (("scratch_own", 4), ("scratch_same", 2)):  # own recipe vs the cells'
        assert baselines[name]["status"] == "ok" and baselines[name]["eval"] == "finetune"
        cfg = json.loads(
            (out / f"baseline={name}" / "seed0" / "finetune" / "config.json").read_text()
        )
        assert cfg["init"] == "scratch" and cfg["train"]["max_steps"] == steps
        assert (cfg["model"]["depth"], cfg["model"]["embed_dim"]) == (
            2,
            32,
        )  # the base's architecture
    md = (out / "results.md").read_text()
    assert "## Baselines: fine-tuning from scratch (top-1 %)" in md
    assert (
        f"| scratch, own schedule | {float(baselines['scratch_own']['top1']):.2f} ± 0.00 (1) |"
        in md
    )
    assert "| scratch, same schedule |" in md


@pytest.mark.parametrize(
    "grid,bad,good,message",
    [
        (
            ["masking.strategy=random,spiral"],
            "masking.strategy=spiral",
            "masking.strategy=random",
            "masking.strategy: Input should be 'random', 'block', 'grid', 'center' or 'units' "
            "(got 'spiral')",
        ),
        (
            ["masking.strategy=random,grid", "objective.mask_ratio=0.6"],
            "masking.strategy=grid,objective.mask_ratio=0.6",
            "masking.strategy=random,",
            "grid masking keeps one patch of every 2x2 cell, so mask_ratio must be 0.75, got 0.6",
        ),
        (
            ["masking.strategy=units", "masking.unit_size=2,3"],
            "masking.strategy=units,masking.unit_size=3",
            "masking.unit_size=2",
            "unit_size 3 must divide the 4x4 patch grid",
        ),
    ],
    ids=["unknown-strategy", "unreachable-ratio", "unit-size"],
)
def test_bad_cells_exit_2_before_any_run_directory(
    tmp_path, digits16, capsys, grid, bad, good, message
):
    base = write_config(tmp_path / "base.json", tiny_config(digits16))
    out = tmp_path / "abl"
    argv = ["--base", str(base), "--seeds", "2", "--eval", "knn", "--output-dir", str(out)]
    code = main(argv + [a for g in grid for a in ("--grid", g)])
    err = capsys.readouterr().err
    assert code == 2
    assert "1 of 2 cells have a bad config; nothing was run" in err
    # the cell, the file, and the --set a grid value became when the key is its own
    assert f"  {bad}: " in err and f"{base}" in err and message in err, err
    assert good not in err
    assert not out.exists()


def test_bad_spec_is_one_line_naming_the_key(tmp_path, capsys):
    spec = write_config(tmp_path / "spec.json", {"base": "mpp_demo", "seeds": 2, "evals": ["knn"]})
    assert main(["--spec", str(spec)]) == 2
    assert capsys.readouterr().err == f"error: {spec}: evals: unknown key (did you mean eval?)\n"
    assert main(["--base", "mpp_demo", "--eval", "knn,svm"]) == 2
    assert (
        "eval.1: Input should be 'finetune', 'linear' or 'knn' (got 'svm')"
        in capsys.readouterr().err
    )


def test_grid_values_split_on_top_level_commas_and_folder_names_stay_distinct():
    assert split_values("random,block,grid") == ["random", "block", "grid"]
    assert split_values("[0.2,1.0],[0.5,1.0]") == ["[0.2,1.0]", "[0.5,1.0]"]
    assert split_values('"a,b",c') == ['"a,b"', "c"]
    assert (
        Cell((("masking.strategy", "block"), ("objective.mask_ratio", "0.5"))).name
        == "masking.strategy=block,objective.mask_ratio=0.5"
    )
    a, b = Cell((("data.train_shards", "/x/a.tar"),)), Cell((("data.train_shards", "_x_a.tar"),))
    assert "/" not in a.name and a.name != b.name


def test_output_dir_and_its_older_name_out_are_the_same_option(tmp_path):
    assert (
        parse_args(["--output-dir", "d"]).output_dir == parse_args(["--out", "d"]).output_dir == "d"
    )
    assert load_spec(None, {"base": "mpp_demo", "output_dir": "d"}).out_dir == Path("d")
    assert load_spec(None, {"base": "mpp_demo"}).out_dir == Path("runs/ablation-mpp_demo")
    for key in ("output_dir", "out"):
        spec = write_config(tmp_path / f"{key}.json", {"base": "mpp_demo", key: "from-file"})
        assert load_spec(str(spec), {}).out_dir == Path("from-file")
        assert load_spec(str(spec), {"output_dir": "from-cli"}).out_dir == Path(
            "from-cli"
        )  # either name
    both = write_config(tmp_path / "both.json", {"base": "mpp_demo", "out": "a", "output_dir": "b"})
    with pytest.raises(ConfigError, match="out: the older name of output_dir"):
        load_spec(str(both), {})


def test_a_bad_set_key_exits_2_naming_it_before_any_run_directory(tmp_path, digits16, capsys):
    base = write_config(tmp_path / "base.json", tiny_config(digits16))
    out = tmp_path / "abl"
    argv = [
        "--base",
        str(base),
        "--grid",
        "masking.strategy=random,block",
        "--eval",
        "knn",
        "--output-dir",
        str(out),
    ]
    assert main([*argv, "--set", "train.max_steps=5", "--set", "train.nope=1"]) == 2
    err = capsys.readouterr().err
    assert "2 of 2 cells have a bad config; nothing was run" in err
    assert (
        f"  masking.strategy=block: --set train.nope=1 (over {base}): train.nope: unknown key"
        in err
    )
    assert "every cell's config has --set train.max_steps=5 train.nope=1" in err
    assert main([*argv, "--set", "train.max_steps"]) == 2
    assert "set: expected KEY=VALUE, got 'train.max_steps'" in capsys.readouterr().err
    assert not out.exists()


def test_set_reaches_every_pretraining_before_the_grid_and_its_model_keys_the_evaluations(
    tmp_path, digits16, monkeypatch, capsys
):
    """No real launches: the launcher is replaced by one that records each command (a probe
    writes its results.json)."""
    commands = []

    def fake_launch(cmd, log):
        commands.append(cmd)
        if "mpp.commands.knn" in cmd:
            run = Path(cmd[cmd.index("--output-dir") + 1])
            run.mkdir(parents=True)
            (run / "results.json").write_text(json.dumps({"top1": 50.0, "top5": 90.0}))
        return 0

    monkeypatch.setattr(mpp.tools.ablation, "launch", fake_launch)
    base = write_config(tmp_path / "base.json", tiny_config(digits16))
    probe = write_config(tmp_path / "probe.json", probe_config(digits16))
    out = tmp_path / "abl"
    shared = [
        "train.max_steps=7",
        "masking.strategy=grid",
        "model.depth=3",
    ]  # the grid's strategy wins
    code = main(
        [
            "--base",
            str(base),
            "--grid",
            "masking.strategy=random,block",
            "--eval",
            "knn",
            "--seeds",
            "2",
            "--probe-config",
            str(probe),
            "--output-dir",
            str(out),
            *[a for s in shared for a in ("--set", s)],
        ]
    )
    assert code == 0, capsys.readouterr().err
    pretrains = [c for c in commands if "mpp.commands.pretrain" in c]
    knns = [c for c in commands if "mpp.commands.knn" in c]
    assert len(pretrains) == len(knns) == 4
    for cmd, (strategy, seed) in zip(
        pretrains, [(s, n) for s in ("random", "block") for n in (0, 1)], strict=True
    ):
        sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
        assert sets == [*shared, f"masking.strategy={strategy}", f"train.seed={seed}"]
        run = out / f"masking.strategy={strategy}" / f"seed{seed}"
        assert cmd[cmd.index("--output-dir") + 1] == str(run / "pretrain")
    for cmd in knns:
        assert (
            "model.depth=3" in cmd and "model.embed_dim=32" in cmd
        )  # the pretraining's model, --set included
    assert sorted(p.name for p in out.iterdir()) == [
        "ablation.json",
        "masking.strategy=block",
        "masking.strategy=random",
        "results.csv",
        "results.md",
        "results.png",
    ]
    table = (out / "results.md").read_text()
    assert "Every cell: `train.max_steps=7`, `masking.strategy=grid`, `model.depth=3`" in table

    spec = AblationSpec(base="b.json", set=["train.max_steps=7"], output_dir="o")
    job = Job(Cell((("masking.strategy", "block"),)), 1, Path("o/masking.strategy=block/seed1"))
    assert pretrain_args(spec, job) == [
        "--config",
        "b.json",
        "--set",
        "train.max_steps=7",
        "--set",
        "masking.strategy=block",
        "--set",
        "train.seed=1",
        "--output-dir",
        "o/masking.strategy=block/seed1/pretrain",
        "--resume",
        "auto",
    ]


def test_a_stop_signal_stops_the_ablation_with_75_and_the_same_command_continues(
    tmp_path, digits16
):
    """SIGTERM to every process of the job (SLURM at a time limit): the running cell's ranks
    checkpoint and exit 75, the runner waits for them and exits 75 without launching anything
    more; the same command then resumes the cell and finishes."""
    base = write_config(
        tmp_path / "base.json", tiny_config(digits16, train={"max_steps": 40, "ckpt_every": 100})
    )
    probe = write_config(tmp_path / "probe.json", probe_config(digits16))
    out = tmp_path / "abl"
    cmd = [
        sys.executable,
        "pretrain/ablate.py",
        "--base",
        str(base),
        "--grid",
        "masking.strategy=random",
        "--eval",
        "knn",
        "--probe-config",
        str(probe),
        "--output-dir",
        str(out),
    ]
    run = out / "masking.strategy=random" / "seed0"
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.time() + 240
    metrics = run / "pretrain" / "metrics.jsonl"
    while time.time() < deadline and not (
        metrics.exists() and metrics.read_text().count('"step"') >= 2
    ):
        time.sleep(
            0.02
        )  # training has begun (a signal during start-up stops a run with nothing to save)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == PREEMPTED_EXIT, err[-3000:]
    assert "stopped:" in err and "the same command continues" in err
    step = json.loads((run / "pretrain" / "preempted.json").read_text())["step"]
    assert (
        1 <= step < 40
        and (run / "pretrain" / "checkpoints" / f"step{step:08d}" / "COMPLETE").is_file()
    )
    assert not (run / "knn").exists()  # nothing launched after the stop

    r = run_cli(cmd, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"pretrain (resume from step{step:08d})" in r.stdout
    assert [row["status"] for row in read_rows(out)] == ["ok"]
    assert [m["step"] for m in read_metrics(run / "pretrain")] == list(range(1, 41))
