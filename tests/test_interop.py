"""The ecosystem both ways: Hugging Face transformers (real), timm's layout, MAE's release format."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file

from mpp.config import validate
from mpp.hub.encoder_file import save_weights
from mpp.hub.export import export, timm_model_args
from mpp.hub.hf import from_hf, to_hf
from mpp.hub.pretrained import load_pretrained
from mpp.models import create_vit
from mpp.models.vit import VisionTransformer

transformers = pytest.importorskip("transformers")

TINY = {"name": "vit_tiny_patch4_16", "depth": 2, "embed_dim": 32, "num_heads": 2}
MEAN, STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]


def fake_run(tmp_path, name="run", **extra) -> tuple:
    """A run directory as pretraining / fine-tuning leaves it: encoder.safetensors + config.json."""
    torch.manual_seed(0)
    model = create_vit(**{**TINY, **extra}).eval()
    run = tmp_path / name
    run.mkdir()
    save_weights(
        model.state_dict(),
        run / "encoder.safetensors",
        {"format": "mpp-encoder", "model": {**TINY, **extra}},
    )
    (run / "config.json").write_text(
        json.dumps({"model": TINY, "data": {"mean": MEAN, "std": STD, "builtin": "digits"}})
    )
    return run, model


def test_hf_export_of_a_pretrained_encoder_gives_our_features_and_round_trips_bitwise(tmp_path):
    run, ours = fake_run(tmp_path, pos_embed="sincos")  # a sin-cos table is exported as its values
    folder = export(run, "hf")
    hf = transformers.ViTModel.from_pretrained(folder, add_pooling_layer=False).eval()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(
            hf(pixel_values=x).last_hidden_state, ours.forward_features(x), rtol=0, atol=1e-5
        )
    processor = json.loads((folder / "preprocessor_config.json").read_text())
    assert (
        processor["image_mean"] == MEAN
        and processor["image_std"] == STD
        and processor["size"] == {"height": 16, "width": 16}
    )
    for source in (
        folder,
        _saved_by_transformers(hf, tmp_path / "resaved"),
    ):  # ours -> HF -> ours, both key styles
        sd, kwargs = load_pretrained(source)
        assert sd.keys() == ours.state_dict().keys()
        assert all(torch.equal(sd[k], v) for k, v in ours.state_dict().items())
        rebuilt = VisionTransformer(
            **{k: v for k, v in kwargs.items() if k != "name"}, pos_embed="learned"
        )
        rebuilt.load_state_dict(sd)


def _saved_by_transformers(model, folder):
    model.save_pretrained(folder)
    return folder


def test_hf_export_of_a_classifier_gives_our_logits_and_refuses_mean_pooling(tmp_path):
    run, ours = fake_run(tmp_path, num_classes=10, global_pool="token")
    folder = export(run, "hf")
    hf = transformers.ViTForImageClassification.from_pretrained(folder).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(hf(pixel_values=x).logits, ours(x), rtol=0, atol=1e-5)
    assert hf.config.id2label[3] == "3"  # the digits shards' class names
    avg, _ = fake_run(tmp_path, "avg", num_classes=10, global_pool="avg")
    with pytest.raises(ValueError) as e:
        export(avg, "hf", tmp_path / "refused")
    assert not (tmp_path / "refused").exists()  # refused before anything is written
    for fix in ("no counterpart", "--format timm", "finetune.global_pool=token", "ViTModel"):
        assert fix in str(e.value), str(e.value)


def test_an_hf_encoder_loads_as_the_docs_say_with_no_missing_pooler(tmp_path, capfd):
    """Issue 50, finding 11: transformers' ViTModel adds a pooler the export does not have and
    lists it as MISSING unless told add_pooling_layer=False; every page that shows the load says
    so, and so does the export command."""
    from mpp.hub.export import main

    for page in (REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))):
        text = page.read_text()
        for call in re.findall(r"ViTModel\.from_pretrained\([^)]*\)", text):
            assert "add_pooling_layer=False" in call, f"{page.name}: {call}"
        if "--format hf" in text:
            assert "add_pooling_layer=False" in text, page.name
    downstream = (REPO / "docs" / "downstream.md").read_text()
    assert "finetune_demo" in downstream and "finetune.global_pool=token" in downstream
    run, ours = fake_run(tmp_path)
    capfd.readouterr()
    assert main([str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    said = capfd.readouterr().err
    assert f"ViTModel.from_pretrained('{tmp_path / 'hf'}', add_pooling_layer=False)" in said
    load = transformers.ViTModel.from_pretrained
    hf, info = load(tmp_path / "hf", add_pooling_layer=False, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and hf.pooler is None
    _, info = load(tmp_path / "hf", output_loading_info=True)  # what the docs warn of
    assert set(info["missing_keys"]) == {"pooler.dense.weight", "pooler.dense.bias"}


def test_timm_export_of_a_classifier_carries_head_pooling_and_the_runs_statistics(tmp_path):
    run, ours = fake_run(tmp_path, num_classes=10, global_pool="avg")
    folder = export(run, "timm")
    config = json.loads((folder / "config.json").read_text())
    args = config["model_args"]
    assert args["num_classes"] == 10 and args["global_pool"] == "avg" and args["fc_norm"] is True
    assert config["pretrained_cfg"]["mean"] == MEAN and config["pretrained_cfg"]["std"] == STD
    sd = load_file(str(folder / "model.safetensors"))
    assert {
        "head.weight",
        "fc_norm.weight",
    } <= sd.keys() and "norm.weight" not in sd  # timm's avg-pool layout
    # timm does not import here: the same constructor arguments through our (timm-named) ViT
    ours_args = {k: v for k, v in args.items() if k not in ("class_token", "fc_norm")}
    rebuilt = VisionTransformer(**ours_args).eval()
    rebuilt.load_state_dict(sd, strict=True)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), ours(x), rtol=0, atol=0)
    assert timm_model_args(TINY)["num_classes"] == 0  # an encoder stays headless


def mae_release_checkpoint(objective) -> dict[str, torch.Tensor]:
    """Our MAE objective's weights in MAE's release names (models_mae.py)."""
    out = {}
    for k, v in objective.state_dict().items():
        for ours, theirs in (
            ("encoder.", ""),
            ("decoder_embed.proj.", "decoder_embed."),
            ("decoder_embed.mask_token", "mask_token"),
            ("decoder_embed.pos_embed", "decoder_pos_embed"),
            ("decoder.blocks.", "decoder_blocks."),
            ("decoder.norm.", "decoder_norm."),
            ("decoder.pred.", "decoder_pred."),
        ):
            if k.startswith(ours):
                out[theirs + k[len(ours) :]] = v.clone()
                break
    return out


def test_maes_release_format_initialises_pretraining_and_fine_tuning_and_a_pickle_is_refused(
    tmp_path, digits16
):
    from conftest import tiny_config

    from mpp.build import build_encoder, build_objective

    raw = tiny_config(
        digits16,
        objective={"name": "mae", "decoder_dim": 32, "decoder_depth": 1, "decoder_heads": 2},
    )
    raw.pop("masking")
    raw["train"]["seed"] = 1
    source = build_objective(validate(raw))  # "published" weights: another seed's MAE
    release = mae_release_checkpoint(source)
    assert {
        "decoder_embed.weight",
        "decoder_blocks.0.attn.qkv.weight",
        "mask_token",
        "decoder_pred.weight",
    } <= release.keys()
    path = tmp_path / "mae_pretrain_vit_tiny_full.pth"
    torch.save({"model": release, "epoch": 799}, path)

    torch.manual_seed(0)
    cont = validate({**raw, "model": {**raw["model"], "init": str(path)}})
    cont._source = "c.json"
    objective = build_objective(
        cont
    )  # pretraining continues from the release file, decoder included
    for k, v in source.state_dict().items():
        assert torch.equal(objective.state_dict()[k], v), k
    hpm_raw = {
        **raw,
        "objective": {"name": "hpm", "decoder_dim": 32, "decoder_depth": 1, "decoder_heads": 2},
        "model": {**raw["model"], "init": str(path)},
    }
    hpm = build_objective(validate(hpm_raw))
    assert torch.equal(hpm.base.decoder.pred.weight, source.decoder.pred.weight)
    assert torch.equal(
        hpm.teacher["base"].encoder.blocks[0].attn.qkv.weight,
        source.encoder.blocks[0].attn.qkv.weight,
    )

    from mpp.config import FinetuneConfig

    ft_raw = {k: v for k, v in raw.items() if k not in ("objective",)}
    ft_raw["data"] = {**raw["data"], "val_shards": digits16["val"]}
    ft = validate({**ft_raw, "init": str(path)}, cls=FinetuneConfig)
    encoder = build_encoder(ft, num_classes=10, global_pool="avg")  # fine-tuning from it
    assert torch.equal(encoder.blocks[1].mlp.fc2.weight, source.encoder.blocks[1].mlp.fc2.weight)

    class Payload:
        def __reduce__(self):
            return (print, ("this must never run",))

    evil = tmp_path / "evil.pth"
    torch.save({"model": release, "x": Payload()}, evil)
    with pytest.raises(ValueError, match="refused"):
        load_pretrained(evil)


def test_hf_names_map_both_ways():
    torch.manual_seed(0)
    ours = create_vit(**TINY, num_classes=3).state_dict()
    back = from_hf(to_hf(ours, 2, classifier=True), 2)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)


def wandb_records(path):
    """The protobuf records of an offline W&B run file (a LevelDB-style log: 32 KiB blocks of
    chunks with a 7-byte header; the file starts with a 7-byte W&B header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, pending = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_has_the_config_and_the_loss_series(tmp_path, digits16):
    pytest.importorskip("wandb")
    from conftest import read_metrics, run_cli, tiny_config, write_config

    cfg = tiny_config(digits16, train={"max_steps": 4, "report_to": ["tensorboard", "wandb"]})
    path = write_config(tmp_path / "c.json", cfg)
    out = tmp_path / "run"
    r = run_cli(
        ["python", "pretrain/run.py", "--config", str(path), "--output-dir", str(out)],
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    config, losses = {}, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):  # the config comes with the run record (and later updates)
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in updates
                }
            )
        elif kind == "history":
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            if "train/loss" in items:
                losses[items["step"]] = items["train/loss"]
    assert config["model"]["name"] == "vit_tiny_patch4_16" and config["train"]["report_to"] == [
        "tensorboard",
        "wandb",
    ]
    assert config["model"]["img_size"] is None and config["architecture"]["img_size"] == 16
    expected = {m["step"]: m["loss"] for m in read_metrics(out)}
    assert losses == pytest.approx(expected) and sorted(losses) == [1, 2, 3, 4]
    assert any((out / "tb").iterdir())  # TensorBoard still written


def test_a_real_pretraining_run_exports_to_hf_with_its_features(two_rank_runs, tmp_path):
    """The ZeRO-3 2-rank pretraining run of the suite, straight from its run directory."""
    from mpp.hub.pretrained import load_into

    run = two_rank_runs[3][0]
    folder = export(run, "hf", tmp_path / "hf")
    hf = transformers.ViTModel.from_pretrained(folder, add_pooling_layer=False).eval()
    ours = create_vit(**TINY).eval()
    load_into(ours, run)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(
            hf(pixel_values=x).last_hidden_state, ours.forward_features(x), rtol=0, atol=1e-5
        )


def google_style_vit(folder, qkv_bias=True):
    """A transformers ViT saved the way Google's checkpoints state their LayerNorms: eps 1e-12."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        image_size=16,
        patch_size=4,
        layer_norm_eps=1e-12,
        qkv_bias=qkv_bias,
    )
    model = transformers.ViTModel(config, add_pooling_layer=False).eval()
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_weights_from_a_transformers_folder_compute_what_transformers_computes(tmp_path, qkv_bias):
    from mpp.build import build_encoder, build_objective
    from mpp.config import ProbeConfig

    hf = google_style_vit(tmp_path / "vit", qkv_bias)
    cfg = validate(
        {"init": str(tmp_path / "vit"), "model": TINY, "data": {"builtin": "digits"}},
        cls=ProbeConfig,
    )
    encoder = build_encoder(cfg).eval()
    # small pixels: token variances near 1e-6, where eps 1e-6 instead of 1e-12 is 1e-3 off
    x = 0.01 * torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(pixel_values=x).last_hidden_state
        torch.testing.assert_close(encoder.forward_features(x), expected, rtol=0, atol=1e-5)
        arch = encoder.architecture()  # what the run's model.json states; the config stays
        assert arch["norm_eps"] == 1e-12 and arch["qkv_bias"] is qkv_bias
        assert cfg.model.norm_eps is None and cfg.model.qkv_bias is None
        raw = {
            "model": {**TINY, "init": str(tmp_path / "vit")},
            "data": {"builtin": "digits"},
            "optim": {"lr": 1e-3},
            "train": {"max_steps": 1},
        }
        objective = build_objective(
            validate(raw)
        )  # pretraining continues from it alike (model.init)
        torch.testing.assert_close(
            objective.encoder.eval().forward_features(x), expected, rtol=0, atol=1e-5
        )


@pytest.mark.parametrize(
    "key,value,stated", [("norm_eps", 1e-6, 1e-12), ("num_heads", 4, 2), ("qkv_bias", False, True)]
)
def test_a_config_that_contradicts_the_weights_file_is_an_error_naming_both_values(
    tmp_path, key, value, stated
):
    import re

    from mpp.build import build_encoder
    from mpp.config import ConfigError, ProbeConfig

    google_style_vit(tmp_path / "vit")
    cfg = validate(
        {
            "init": str(tmp_path / "vit"),
            "model": {**TINY, key: value},
            "data": {"builtin": "digits"},
        },
        cls=ProbeConfig,
    )
    expected = rf"init: .*{key}={re.escape(repr(stated))}, the config's model has {key}={re.escape(repr(value))} \(model\.{key}\)"
    with pytest.raises(ConfigError, match=expected):
        build_encoder(cfg)


def test_an_eps_timm_cannot_state_is_kept_for_hf_and_refused_for_timm(tmp_path):
    from mpp.hub.source import timm_model_kwargs

    run, ours = fake_run(tmp_path, norm_eps=1e-12)
    hf = transformers.ViTModel.from_pretrained(export(run, "hf"), add_pooling_layer=False).eval()
    assert hf.config.layer_norm_eps == 1e-12
    x = 0.01 * torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(
            hf(pixel_values=x).last_hidden_state, ours.forward_features(x), rtol=0, atol=1e-5
        )
    with pytest.raises(ValueError, match="norm_eps=1e-12: timm's VisionTransformer .* eps 1e-06"):
        export(run, "timm")
    with pytest.raises(
        ValueError, match="init_values=1e-05: our ViT supports only None"
    ):  # LayerScale
        timm_model_kwargs(
            {"architecture": "vit_base_patch16_224", "model_args": {"init_values": 1e-5}}
        )
