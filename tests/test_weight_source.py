"""What an encoder was trained on travels with it (issue 50 §2): ``mpp.hub.source.weight_source``
reads the image and patch size, channels, mean, std and value range from every kind of source, and
the configs (``mpp.build.with_init_facts``, ``encoder_args``) and ``mpp.create_model`` /
``mpp.load_encoder`` take what they leave unset from it; what they set wins, with one line."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

import mpp
from mpp.build import encoder_args, with_init_facts
from mpp.config import ConfigError, FinetuneConfig, ProbeConfig, load_config
from mpp.hub.encoder_file import save_weights
from mpp.hub.export import export
from mpp.hub.source import weight_source
from mpp.models import create_vit
from mpp.ops import IMAGENET_MEAN

TINY = {"name": "vit_tiny_patch4_16", "depth": 2, "embed_dim": 32, "num_heads": 2}
# a 16-bit grey run's statistics (RUN/data.json), as pretraining on PNG16 with "auto" writes them
GREY = {"mean": [0.2744], "std": [0.3249], "value_range": [0.0, 65535.0]}


def grey_run(tmp_path, name="grey", pixels=GREY, **arch) -> tuple:
    """A pretraining run's directory as it ends: encoder.safetensors, config.json (as loaded:
    "auto" statistics), model.json (the encoder built) and data.json (what it used)."""
    torch.manual_seed(0)
    model_kwargs = {**TINY, "in_chans": 1, **arch}
    model = create_vit(**model_kwargs).eval()
    run = tmp_path / name
    run.mkdir()
    meta = {"format": "mpp-encoder", "model": model_kwargs}
    save_weights(model.state_dict(), run / "encoder.safetensors", meta)
    data = {"channels": 1, "mean": "auto", "std": "auto", "value_range": "auto"}
    (run / "config.json").write_text(json.dumps({"model": TINY, "data": data}))
    (run / "model.json").write_text(json.dumps(model_kwargs))
    if pixels is not None:
        (run / "data.json").write_text(json.dumps(pixels))
    return run, model


def as_stated(pixels: dict) -> dict:
    return {k: tuple(v) for k, v in pixels.items()}


def test_every_kind_of_source_states_what_its_encoder_was_trained_on(tmp_path):
    """A run, its encoder file copied alone, its timm and Hugging Face exports, a release .pth:
    each states the channels, size and statistics it carries (a .pth none)."""
    run, model = grey_run(tmp_path, img_size=32)
    facts = {"channels": 1, **as_stated(GREY)}
    assert weight_source(run).facts == facts
    assert weight_source(run).img_size == 32 and weight_source(run).run_dir == run
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(export(run, "safetensors", tmp_path / "e" / "enc.safetensors"), alone)
    assert weight_source(alone / "enc.safetensors").facts == facts  # its metadata says it
    assert weight_source(export(run, "timm", tmp_path / "timm")).facts == facts
    pytest.importorskip("transformers")
    hf = export(run, "hf", tmp_path / "hf")
    processor = json.loads((hf / "preprocessor_config.json").read_text())
    assert processor["rescale_factor"] == 1 / 65535  # not 8-bit's 1/255
    source = weight_source(hf)
    assert source.facts == facts and source.img_size == 32 and source.kind == "hf"
    torch.save({"model": model.state_dict()}, tmp_path / "release.pth")
    assert weight_source(tmp_path / "release.pth").facts == {}


def test_a_hugging_face_export_maps_a_value_range_that_starts_above_zero_exactly(tmp_path):
    """HF rescales by a factor only: the low end moves into the mean, and the processor's
    normalisation of a raw value equals ours."""
    run, _ = grey_run(tmp_path, pixels={**GREY, "value_range": [1000.0, 11000.0]})
    pytest.importorskip("transformers")
    processor = json.loads((export(run, "hf", tmp_path / "hf") / HF_PROCESSOR).read_text())
    raw = 3500.0
    ours = ((raw - 1000) / 10000 - GREY["mean"][0]) / GREY["std"][0]
    theirs = (raw * processor["rescale_factor"] - processor["image_mean"][0]) / GREY["std"][0]
    assert theirs == pytest.approx(ours, abs=1e-9)


HF_PROCESSOR = "preprocessor_config.json"


def probe_config(init, *sets: str) -> ProbeConfig:
    return load_config("linear_demo", [f"init={init}", *sets], cls=ProbeConfig)


def test_a_config_takes_channels_size_and_statistics_it_leaves_unset_from_init(tmp_path):
    """linear_demo (vit_tiny_patch8_32, RGB, ImageNet's statistics unset) over a 1-channel
    16-bit run at 16 px, patch 4: the encoder and the data as the run had them; the config as
    loaded unchanged."""
    run, _ = grey_run(tmp_path, embed_dim=128, depth=4, num_heads=4)
    cfg = probe_config(run)
    data = with_init_facts(cfg).data
    assert (data.channels, data.mean, data.std, data.value_range) == (
        1,
        *as_stated(GREY).values(),
    )
    assert cfg.data.channels == 3 and cfg.data.mean == IMAGENET_MEAN  # as loaded
    args = encoder_args(cfg)
    assert (args["in_chans"], args["img_size"], args["patch_size"]) == (1, 16, 4)
    assert encoder_args(probe_config(run, "model.img_size=32"))["img_size"] == 32
    ft = load_config(
        "finetune_demo", [f"init={run}", "train.max_steps=1"], cls=FinetuneConfig
    )  # fine-tuning reads them the same way
    assert with_init_facts(ft).data.value_range == (0.0, 65535.0)
    # data.channels=1 said by hand (statistics unset), or a 1-value mean with the channels left to
    # the init: both are taken, not refused for ImageNet's 3 values / the default 3 channels
    said = with_init_facts(probe_config(run, "data.channels=1")).data
    assert (said.channels, said.mean) == (1, as_stated(GREY)["mean"])
    mean = with_init_facts(probe_config(run, "data.mean=[0.5]")).data
    assert (mean.channels, mean.mean) == (1, (0.5,))


def test_a_key_the_config_sets_wins_with_one_line(tmp_path, caplog):
    run, _ = grey_run(tmp_path, embed_dim=128, depth=4, num_heads=4)
    cfg = probe_config(run, "data.mean=auto", "data.value_range=[0,60000]")
    with caplog.at_level(logging.WARNING, logger="mpp.build"):
        data = with_init_facts(cfg).data
    assert data.mean == "auto" and data.std == (0.3249,) and data.value_range == (0, 60000)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "was trained with data.mean [0.2744], data.value_range [0, 65535]" in line, line
    assert "keeps data.mean 'auto', data.value_range [0, 60000] as set" in line, line


def test_channels_that_differ_from_inits_name_data_channels_and_the_fix(tmp_path):
    run, _ = grey_run(tmp_path, embed_dim=128, depth=4, num_heads=4)
    from mpp.build import build_encoder

    with pytest.raises(ConfigError) as e:
        build_encoder(probe_config(run, "data.channels=3"))
    assert "takes 1 channel(s), the model 3 (data.channels=3)" in str(e.value)
    assert "leave data.channels unset to take the init's 1" in str(e.value)
    # a grey run that states no statistics: ImageNet's 3 values cannot serve its 1 channel
    bare, _ = grey_run(tmp_path, "bare", pixels=None, embed_dim=128, depth=4, num_heads=4)
    (bare / "config.json").unlink()  # an encoder file alone, from before data.json
    with pytest.raises(ConfigError, match=r"data.mean: 3 values, but init .* takes 1 channel"):
        with_init_facts(probe_config(bare))


def test_rgb_weights_are_adapted_only_when_the_channels_are_set(tmp_path):
    """An RGB init leaves data.channels at 3; set to 4, its patch embedding is adapted and the
    RGB run's statistics are not taken for 4 bands."""
    rgb = create_vit(**TINY, img_size=32)
    run = tmp_path / "rgb"
    run.mkdir()
    save_weights(rgb.state_dict(), run / "encoder.safetensors", {"model": {**TINY, "img_size": 32}})
    (run / "config.json").write_text(json.dumps({"model": TINY, "data": {}}))
    (run / "data.json").write_text(json.dumps({"mean": [0.4] * 3, "std": [0.2] * 3}))
    cfg = load_config("mae_demo", [f"model.init={run}"])  # pretraining's init
    assert with_init_facts(cfg).data.mean == (0.4,) * 3 and encoder_args(cfg)["in_chans"] == 3
    four = load_config(
        "mae_demo",
        [f"model.init={run}", "data.channels=4", "data.mean=auto", "data.std=auto"],
    )
    assert with_init_facts(four).data.mean == "auto" and encoder_args(four)["in_chans"] == 4


def test_create_model_builds_what_its_weights_state_and_says_what_they_expect(tmp_path, caplog):
    """A 64-px, patch-4 run read as vit_tiny_patch8_32 (issue 50, finding 3): 64 px and patch 4,
    the position embeddings as trained, 64-px input taken; a grey run's model takes 1 channel.
    pretrained_cfg carries what the weights were trained on, as timm's does."""
    run, ours = grey_run(tmp_path, img_size=64)
    with caplog.at_level(logging.INFO):
        model = mpp.create_model("vit_tiny_patch8_32", pretrained=run, num_classes=4)
    assert model.patch_embed.img_size == (64, 64) and model.patch_embed.patch_size == 4
    assert model.patch_embed.in_chans == 1
    assert torch.equal(model.pos_embed, ours.pos_embed)  # not resampled
    assert model(torch.randn(2, 1, 64, 64)).shape == (2, 4)
    assert not any("resampled" in r.getMessage() for r in caplog.records)
    assert model.pretrained_cfg == {
        "input_size": (1, 64, 64),
        "interpolation": "bicubic",
        **as_stated(GREY),
    }
    assert mpp.load_encoder(run).pretrained_cfg == model.pretrained_cfg
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        small = mpp.create_model("vit_tiny_patch8_32", pretrained=run, img_size=32)
    assert small.patch_embed.img_size == (32, 32)
    (line,) = [r.getMessage() for r in caplog.records if "resampled" in r.getMessage()]
    assert "to the model's 8x8 (img_size 32)" in line
    with pytest.raises(ValueError, match=r"\(in_chans=3\).*leave in_chans unset"):
        mpp.create_model("vit_tiny_patch8_32", pretrained=run, in_chans=3)
