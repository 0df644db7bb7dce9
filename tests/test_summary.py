"""A run that speaks (issue 50 §5): the summary a training run starts with (mpp.train.summary),
the line each command ends with (this command's own steps after a resume; fine-tuning's top-1
formatted; the probes'; the monitor's first and last k-NN), and curves drawn from every step
with resumes marked (mpp.tools.plot)."""

import json
import shutil
import sys

from conftest import listed_samples, run_cli, tiny_config, write_config

from mpp.build import build_objective
from mpp.config import load_config
from mpp.tools.plot import resumes, series
from mpp.train.metrics import last_figures
from mpp.train.optim import lr_at
from mpp.transfer.probe_cli import done_line


def lines_starting(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_a_resumed_run_states_its_plan_and_counts_only_its_own_steps(
    one_rank_run, digits16, tmp_path
):
    """one_rank_run (8 steps, batch 16, 2 warm-up steps, log_every 1) taken on to 12 steps with
    a record every 4: the summary's figures; the done line counts steps 9 to 12 only; the
    curves hold every step, the last four from one record, and mark the resume at step 8."""
    run = tmp_path / "run"
    shutil.copytree(one_rank_run["run"], run)
    path = one_rank_run["config"]
    more = ["--set", "train.max_steps=12", "--set", "train.log_every=4"]
    cmd = [sys.executable, "pretrain/run.py", "--config", str(path), "--output-dir", str(run)]
    r = run_cli([*cmd, *more])
    assert r.returncode == 0, r.stderr[-3000:]

    objective = build_objective(load_config(str(path)))
    params = sum(p.numel() for p in objective.parameters())
    trainable = sum(p.numel() for p in objective.parameters() if p.requires_grad)
    per_epoch = listed_samples(digits16["train"]) // 16
    for fact in (
        f"  model: vit_tiny_patch4_16, {trainable:,} trainable parameters of {params:,} (encoder ",
        "  batch: 16 = 16 per rank x 1 accumulation x 1 rank (",
        "  lr: 0.001 (optim.lr), cosine to 0, weight decay ",
        f"  schedule: 12 steps ({12 / per_epoch:.4g} epochs of {per_epoch} steps), 2 warm-up "
        "steps (optim.warmup_steps)",
        f"  data: {listed_samples(digits16['train']):,} samples in ",
        "  input: decoded by the data workers (data.decode=auto), 2 workers per rank, "
        "data.prefetch=2",
        "  step: fp32, ZeRO stage 0, attention ",
    ):
        assert fact in r.stderr, (fact, r.stderr[-3000:])

    (done,) = lines_starting(r.stdout, "done: ")
    assert done.startswith("done: 4 steps, 64 images in "), done
    assert "(resumed at step 8: the run is at step 12)" in done, done

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last["step"] == 12 and len(last["step_losses"]) == 4 and last["resumed_at"] == 8
    assert abs(sum(last["step_losses"]) / 4 - last["loss"]) < 1e-6
    curves = series(run)
    loss_steps, losses = curves["training loss"]
    lr_steps, lrs = curves["learning rate"]
    assert loss_steps == lr_steps == list(range(1, 13))
    assert losses[8:] == last["step_losses"]
    # the lr each of steps 9-12 ran at, by hand: warm-up 2, cosine over the 12 steps
    assert lrs[8:] == [lr_at(s - 1, peak=1e-3, total=12, warmup=2) for s in range(9, 13)]
    assert resumes(run) == [8]


def test_finetune_states_its_plan_and_ends_with_its_top1_formatted(digits16, tmp_path):
    raw = tiny_config(digits16, train={"max_steps": 2, "ckpt_every": 100})
    raw.pop("objective"), raw.pop("masking")
    raw["data"]["val_shards"] = digits16["val"]
    raw["finetune"] = {"num_classes": 10}
    raw["init"] = "scratch"
    out = tmp_path / "ft"
    path = write_config(tmp_path / "ft.json", raw)
    cmd = ["downstream/finetune.py", "--config", str(path), "--output-dir", str(out)]
    r = run_cli([sys.executable, *cmd])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "  batch: 16 = 16 per rank x 1 accumulation x 1 rank (" in r.stderr, r.stderr[-3000:]
    assert "  schedule: 2 steps (" in r.stderr and "2 warm-up steps" in r.stderr

    res = json.loads((out / "results.json").read_text())
    (epoch,) = lines_starting(r.stdout, "epoch ")
    assert f"top-1 {res['top1']:.2f} %" in epoch
    *_, done = r.stdout.splitlines()
    assert done.startswith("done: 2 steps, 32 images in "), r.stdout
    assert f"; top-1 {res['top1']:.1f} %, top-5 {res['top5']:.1f} % at epoch " in done, done
    assert '"top1"' not in r.stdout  # results.json keeps the raw figures


def test_the_monitor_and_the_probes_end_lines_say_their_figures(tmp_path):
    records = [
        {"step": 0, "epoch": 0, "monitor/knn_top1": 65.0},
        {"step": 60, "epoch": 30, "loss": 2.5, "lr": 1e-4, "imgs_per_sec": 90.0},
        {"step": 60, "epoch": 30, "monitor/knn_top1": 47.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    figures = last_figures(tmp_path)
    assert "monitor k-NN top-1 65.0 % at step 0 -> 47.5 % at step 60" in figures, figures

    knn = {"top1": 84.99999, "top5": 99.0, "num_train": 1497, "num_val": 300, "skipped": 3}
    assert done_line("knn", knn, 65.2, tmp_path) == (
        f"done: k-NN top-1 85.0 %, top-5 99.0 % (1,497 train, 300 val images kept, 3 skipped) in 1m05s -> "
        f"{tmp_path}: results.json"
    )
    linear = {"top1": 85.0, "num_val": 300, "protocol": "mae"}
    assert done_line("linear", linear, 3, tmp_path).startswith(
        "done: linear probe (mae) top-1 85.0 % (300 val images kept) in 0m03s"
    )
