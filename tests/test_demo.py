"""The demo's table compares fairly (issue 23 §4): scratch fine-tuned with a schedule of its own,
and the same short schedule as the pretrained model, both labelled."""

import json
from pathlib import Path

import torch

from mpp.config import FinetuneConfig, load_config
from mpp.tools.demo import ROWS, render, stages, summary


def test_scratch_gets_its_own_schedule_and_the_equal_schedule_row_stays(tmp_path):
    todo = {name: cmd for name, cmd, _ in stages(tmp_path, ["--num_gpus", "2"])}
    own = todo["finetune scratch_own"]
    assert own[own.index("--config") + 1] == "finetune_scratch_demo" and "init=scratch" in own
    same = todo["finetune scratch"]
    assert same[same.index("--config") + 1] == "finetune_demo" and "init=scratch" in same
    short = load_config("finetune_demo", cls=FinetuneConfig)
    fair = load_config("finetune_scratch_demo", cls=FinetuneConfig)
    assert fair.train.epochs == 3 * short.train.epochs  # its own schedule, not the pretrained one's
    assert (
        fair.optim.layer_decay == 1.0 and fair.finetune.head_init_std == 0.02
    )  # timm's supervised recipe
    assert fair.model == short.model and fair.data == short.data  # the same model on the same data
    assert "probe scratch_own" not in " ".join(todo)  # a probe has no schedule to be fair about


def test_the_table_labels_both_comparisons(tmp_path):
    for key, ft in (("pretrained", 90.0), ("scratch", 70.0), ("scratch_own", 82.5)):
        (tmp_path / f"finetune_{key}").mkdir()
        (tmp_path / f"finetune_{key}" / "results.json").write_text(json.dumps({"top1": ft}))
    table = summary(Path(tmp_path))
    assert table["scratch_own"] == {"fine-tune": 82.5, "linear": None, "k-NN": None}
    text = render(table, tmp_path)
    assert (
        "+7.5 against scratch on its own schedule (the fair comparison), +20.0 on the same short one"
        in text
    )
    assert [label for _, label, *_ in ROWS] == [
        "pretrained (mpp), 10 ep",
        "scratch, same 10 ep",
        "scratch, own 30 ep",
    ]


def test_head_init_std_is_the_recipes():
    from mpp.downstream.finetune import Classifier
    from mpp.models import create_vit

    for std in (2e-5, 0.02):
        enc = create_vit("vit_tiny_patch4_16", depth=1, embed_dim=128, num_heads=2, num_classes=64)
        head = Classifier(enc, head_init_std=std).encoder.head
        assert abs(head.weight.std().item() / std - 1) < 0.05 and torch.all(head.bias == 0)
