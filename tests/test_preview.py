"""Previews while it trains (issue 23 §3): pictures in TensorBoard at every ``train.preview_every``
steps, the same losses as without them, nothing done on the other steps."""

import json

import pytest
import torch
from conftest import read_metrics, run_cli, tiny_config, write_config

from mpp.train.preview import Preview, caption

# a small pixel decoder (the default is 512 wide, 8 blocks: 10x the time of this 2-block
# encoder); the previews, their panels and the caption do not depend on its size
HPM = {
    "name": "hpm",
    "base": "mae",
    "norm_pix_loss": True,
    "decoder_dim": 32,
    "decoder_depth": 1,
    "decoder_heads": 2,
}


def tb_events(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    return acc


def tb_images(run_dir):
    acc = tb_events(run_dir)
    return acc.Images("preview"), acc.Tensors("preview/text_summary")


def tb_tags(run_dir):
    return tb_events(run_dir).Tags()["images"]


def test_previews_land_in_tensorboard_and_change_nothing_in_training(tmp_path, digits16):
    runs = {}
    for every in (0, 2):
        cfg = tiny_config(digits16, objective=HPM, train={"max_steps": 4, "preview_every": every})
        out = tmp_path / f"every{every}"
        r = run_cli(
            [
                "python",
                "pretrain/run.py",
                "--config",
                str(write_config(tmp_path / f"{every}.json", cfg)),
                "--output-dir",
                str(out),
            ]
        )
        assert r.returncode == 0, r.stderr[-2000:]
        runs[every] = out
    images, text = tb_images(runs[2])
    assert [e.step for e in images] == [2, 4]
    # 4 panels of the 16-px images at 6x (96 px) side by side, 8 rows, 2-px gaps
    assert (images[0].width, images[0].height) == (4 * 96 + 5 * 2, 8 * 96 + 9 * 2)
    assert "norm_pix_loss" in text[0].tensor_proto.string_val[0].decode()
    assert "preview" not in tb_tags(runs[0])
    # the previews' masks come from a forked RNG: training draws exactly what it would without them
    losses = {every: [m["loss"] for m in read_metrics(out)] for every, out in runs.items()}
    assert losses[2] == losses[0] and len(losses[0]) == 4


def test_the_previews_without_val_shards_draw_the_first_training_shard_there(digits16):
    """No held-out images: the first training shard the plan found, not a missing one; ``mpp
    viz`` of such a run draws the same."""
    from types import SimpleNamespace

    from mpp.build import build_objective
    from mpp.config import validate
    from mpp.data import expand_shards
    from mpp.data.stats import Pixels
    from mpp.data.transforms import RGB
    from mpp.train.preview import build_preview

    shards = expand_shards(digits16["train"])
    spec = [shards[0].replace("train-", "lost-"), *shards]  # the first one is missing
    cfg = validate(tiny_config(digits16, data={"train_shards": spec}, train={"preview_every": 1}))
    pixels = Pixels((0.5,) * 3, (0.25,) * 3, RGB)
    plan = SimpleNamespace(pixels=pixels, img_size=16, train_shards=shards)
    preview = build_preview(cfg, plan, build_objective(cfg), torch.device("cpu"), 0)
    assert preview.every == 1 and preview.images.shape == (8, 3, 16, 16)
    from mpp.tools.viz import run_images

    drawn = run_images(cfg, (pixels.mean, pixels.std, pixels.format), 8, 16)
    assert torch.equal(drawn, preview.images)  # both normalised with the run's statistics


class Untouchable:
    def __getattr__(self, name):
        raise AssertionError(f"a step without a preview touched the model ({name})")


def test_a_step_without_a_preview_does_nothing():
    preview = Preview(
        1000,
        torch.zeros(2, 3, 16, 16, dtype=torch.uint8),
        (0.5,) * 3,
        (0.5,) * 3,
        torch.device("cpu"),
        rank=0,
    )
    for step in (1, 999, 1001):
        preview(Untouchable(), step, [Untouchable()])
    with pytest.raises(AssertionError, match="touched"):
        preview(Untouchable(), 1000, [])


def test_the_caption_says_how_the_reconstruction_was_unnormalised(digits16):
    from mpp.build import build_objective
    from mpp.config import Config

    def build(objective):
        return build_objective(Config.model_validate(tiny_config(digits16, objective=objective)))

    assert "teacher's predicted loss" in caption(build(HPM)) and "norm_pix_loss" in caption(
        build(HPM)
    )
    assert "predicted colour" in caption(build({"name": "mpp"}))
    assert (
        caption(build({"name": "mae", "norm_pix_loss": False})) == "input | mask | reconstruction"
    )
    json.dumps(caption(build(HPM)))  # plain text
