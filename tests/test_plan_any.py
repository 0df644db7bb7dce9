"""The planner plans fine-tuning configs too (issue 32 §1): the classifier's step with its mixup,
its layer-decayed optimiser's states; a probe config is named as one it cannot plan."""

from __future__ import annotations

import json
import sys

from conftest import run_cli

from mpp.train.plan import PLACEHOLDER_SHARDS, load_plan_config


def test_a_fine_tuning_config_is_planned_and_a_probe_config_named(tmp_path):
    out = tmp_path / "plan.json"
    r = run_cli(
        [sys.executable, "-m", "mpp", "plan", "finetune_demo", "--gpus", "2", "--out", str(out)]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads(out.read_text())
    assert "finetune_demo.json" in r.stdout and "memory per GPU" in r.stdout
    # the classifier's step (mixup included): fwd + bwd of the demo's ViT and its 10-class head
    assert plan["fits"] and plan["activations_gib"] > 0 and plan["flops_per_image"] > 0
    assert plan["recipe"]["split"] == "32 x 1 x 2 = 64" and plan["recipe"]["lr"] == 4e-3 * 64 / 256
    # the shipped ImageNet recipe, which names no data: stand-ins for the train and val shards
    cfg, known = load_plan_config("finetune_b16", [])
    assert not known and cfg.data.val_shards == cfg.data.train_shards == PLACEHOLDER_SHARDS
    r = run_cli([sys.executable, "-m", "mpp", "plan", "linear_demo"])
    assert r.returncode == 2 and "a probe config: the planner plans training steps" in r.stderr
