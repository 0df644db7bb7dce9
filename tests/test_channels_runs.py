"""Users' own images through the real commands (issue 31 §4): shards of tifffile-written uint16
4-band images, numpy-written float32 2-band arrays and PIL 16-bit grey PNGs, each with a corrupt
sample, written by webdataset's TarWriter, Python's tarfile and our writer. Each is pretrained
through the deepspeed launcher with another objective (MAE, HPM over MPP's factorised colour
target, MPP), then fine-tuned (from RGB weights too), probed, pictured and exported."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import tifffile
import torch
from conftest import launcher, read_metrics, run_cli, write_config
from PIL import Image
from safetensors.torch import load_file, save_file

from mpp.hub import export
from mpp.hub.pretrained import load_pretrained
from mpp.models import create_vit
from mpp.models.vit import VisionTransformer

SIZE, TRAIN, VAL = 16, 48, 16
RNG = np.random.default_rng(7)


def tif(i: int) -> bytes:
    out = io.BytesIO()  # 4 bands, C x H x W, as tifffile writes a multi-band image
    tifffile.imwrite(out, _pattern(i, 4).astype(np.uint16) * 4000)
    return out.getvalue()


def npy(i: int) -> bytes:
    out = io.BytesIO()  # H x W x C float32
    np.save(out, (_pattern(i, 2) / 16).astype(np.float32).transpose(1, 2, 0))
    return out.getvalue()


def png16(i: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray((_pattern(i, 1)[0] * 4000).astype(np.uint16)).save(out, format="PNG")
    return out.getvalue()


def _pattern(i: int, bands: int) -> np.ndarray:
    """Class i % 4: a bright quarter of the image (in every band), plus noise; 0..15."""
    img = RNG.integers(0, 4, (bands, SIZE, SIZE)).astype(np.float64)
    q, h = i % 4, SIZE // 2
    img[:, (q // 2) * h : (q // 2 + 1) * h, (q % 2) * h : (q % 2 + 1) * h] += 12
    return img


def write_tar(path, samples, how: str) -> None:
    """(key, ext, bytes, label) samples into a tar by webdataset's TarWriter or tarfile."""
    if how == "webdataset":
        import webdataset as wds

        with wds.TarWriter(str(path)) as sink:
            for key, ext, data, label in samples:
                sink.write({"__key__": key, ext: data, "cls": label})
        return
    with tarfile.open(path, "w") as tar:
        for key, ext, data, label in samples:
            for name, blob in ((f"{key}.{ext}", data), (f"{key}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))


KINDS = {
    # kind: (encode, ext, channels, data section, objective, writer)
    "tif": (
        tif,
        "tif",
        4,
        {"value_range": "auto", "mean": "auto", "std": "auto"},
        "mae",
        "webdataset",
    ),
    "npy": (
        npy,
        "npy",
        2,
        {"value_range": [0, 1], "mean": [0.3, 0.3], "std": [0.3, 0.3]},
        "hpm",
        "tarfile",
    ),
    "png": (
        png16,
        "png",
        1,
        {"value_range": [0, 65535], "mean": "auto", "std": "auto"},
        "mpp",
        "ours",
    ),
}
OBJECTIVES = {
    "mae": {"name": "mae", "decoder_dim": 32, "decoder_depth": 1, "decoder_heads": 2},
    "hpm": {
        "name": "hpm",
        "base": "mpp",
        "decoder_dim": 32,
        "decoder_depth": 1,
        "decoder_heads": 2,
    },
    "mpp": {"name": "mpp"},
}


def shards(root, kind: str) -> dict:
    encode, ext, *_, how = KINDS[kind]
    root.mkdir(parents=True)
    out = {}
    for split, n, parts in (("train", TRAIN, 3), ("val", VAL, 1)):
        samples = [(f"{i:06d}", ext, encode(i), i % 4) for i in range(n)]
        if split == "train":  # a corrupt sample among the good ones
            samples.insert(
                5, ("bad000", ext, b"\x93NUMPY garbage" if ext == "npy" else b"II*\x00xx", 1)
            )
        chunks = [samples[k::parts] for k in range(parts)]
        paths = [root / f"{split}-{k}.tar" for k in range(parts)]
        if how == "ours":
            from mpp.data import WriterOptions, write_shards

            opts = WriterOptions(max_count=len(chunks[0]), seed=None, progress=False)
            got = write_shards([(d, y) for _, _, d, y in samples], root, split, options=opts)
            paths = [str(p) for p in got]
        else:
            for path, chunk in zip(paths, chunks, strict=True):
                write_tar(path, chunk, how)
        out[split] = [str(p) for p in paths]
    return out


def pretrain_config(kind: str, data: dict) -> dict:
    _, _, chans, pixels, objective, _ = KINDS[kind]
    return {
        "name": kind,
        "model": {"name": "vit_tiny_patch4_16", "depth": 2, "embed_dim": 32, "num_heads": 2},
        "objective": OBJECTIVES[objective],
        "data": {
            "train_shards": data["train"],
            "val_shards": data["val"],
            "channels": chans,
            "num_workers": 1,
            "shuffle_buffer": 4,
            "num_classes": 4,
            **pixels,
        },
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "train": {
            "batch_size": 12,
            "max_steps": 4,
            "ckpt_every": 100,
            "precision": "fp32",
            "monitor_every": 4,
            "preview_every": 4,
        },
        "monitor": {"bank_per_class": 2},
        "deepspeed": {"zero_optimization": {"stage": 2}},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("channels")
    made = {}
    for kind, ranks in (("tif", 2), ("npy", 3), ("png", 2)):
        data = shards(tmp / f"{kind}-shards", kind)
        cfg = pretrain_config(kind, data)
        path = write_config(tmp / f"{kind}.json", cfg)
        out = tmp / kind
        head = launcher(ranks)
        r = run_cli([*head, "pretrain/run.py", "--config", str(path), "--output-dir", str(out)])
        assert r.returncode == 0, f"{kind}: {r.stdout[-2000:]}{r.stderr[-3000:]}"
        made[kind] = {"run": out, "data": data, "cfg": cfg, "log": r.stdout + r.stderr}
    return made


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_pretrains_skipping_its_corrupt_sample_with_its_statistics(runs, kind):
    run, chans = runs[kind]["run"], KINDS[kind][2]
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["in_chans"] is None and saved["data"]["channels"] == chans
    assert json.loads((run / "model.json").read_text())["in_chans"] == chans
    section = KINDS[kind][3]
    assert {k: saved["data"][k] for k in section} == section  # as loaded: "auto" stays "auto"
    used = json.loads((run / "data.json").read_text())  # what the run used: "auto" measured
    assert len(used["mean"]) == len(used["std"]) == chans
    assert all(used[k] == v for k, v in section.items() if v != "auto")
    if kind == "tif":
        assert used["value_range"][0] >= 0 and used["value_range"][1] <= 60000
    records = read_metrics(run)
    # the corrupt sample: the others' shards carry it to the loader, which skips and counts it;
    # our writer decodes every image and leaves it out (issue 50 §4)
    skipped = [m for m in records if "loss" in m][-1]["skipped"]
    assert skipped == 0 if KINDS[kind][5] == "ours" else skipped >= 1
    monitored = [m for m in records if "monitor/knn_top1" in m]
    assert [m["step"] for m in monitored] == [0, 4]
    if kind == "npy":  # HPM over MPP's factorised colours: a class per channel
        assert "monitor/masked_acc" in monitored[-1] and "monitor/rank_corr" in monitored[-1]


def real_timm():
    """timm where it imports: it needs torchvision, which has no build for the CPU torch of this
    project's CI, so there the export is read by our timm-compatible ViT only."""
    try:
        import timm
    except Exception:  # ImportError, or torchvision's operator registration failing
        return None
    return timm


def test_fine_tuning_probing_export_and_pictures_at_any_channel_count(runs, tmp_path):
    transformers = pytest.importorskip("transformers")
    for kind in ("tif", "png"):
        run, chans = runs[kind]["run"], KINDS[kind][2]
        cfg = runs[kind]["cfg"]
        ft = {
            "name": "ft",
            "init": str(run),
            "model": cfg["model"],
            "data": {**json.loads((run / "config.json").read_text())["data"], "log_keys": False},
            "finetune": {"mixup": 0.0, "cutmix": 0.0, "randaug_n": 0, "reprob": 0.0},
            "optim": {"lr": 1e-3, "warmup_steps": 1},
            "train": {"batch_size": 12, "max_steps": 2, "ckpt_every": 100},
        }
        path = write_config(tmp_path / f"ft-{kind}.json", ft)
        r = run_cli(
            [
                "python",
                "downstream/finetune.py",
                "--config",
                str(path),
                "--output-dir",
                str(tmp_path / f"ft-{kind}"),
            ]
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert (
            json.loads((tmp_path / f"ft-{kind}" / "results.json").read_text())["last"]["num_val"]
            == VAL
        )
        probe = {"name": "k", "init": str(run), "model": cfg["model"], "data": ft["data"]}
        path = write_config(tmp_path / f"knn-{kind}.json", probe)
        r = run_cli(
            [
                "python",
                "downstream/knn.py",
                "--config",
                str(path),
                "--output-dir",
                str(tmp_path / f"knn-{kind}"),
            ]
        )
        assert r.returncode == 0, r.stderr[-3000:]
        res = json.loads((tmp_path / f"knn-{kind}" / "results.json").read_text())
        assert res["num_train"] == TRAIN and res["num_val"] == VAL
        # exports: timm's in_chans, Hugging Face's num_channels, the measured mean and std
        sd, kwargs = load_pretrained(run)
        ours = create_vit(**kwargs).eval()
        ours.load_state_dict(sd)
        x = torch.randn(2, chans, SIZE, SIZE)
        for fmt in ("timm", "hf"):
            assert (
                export.main([str(run), "--format", fmt, "--out", str(tmp_path / f"{fmt}-{kind}")])
                == 0
            )
        timm_cfg = json.loads((tmp_path / f"timm-{kind}" / "config.json").read_text())
        assert (
            timm_cfg["model_args"]["in_chans"] == chans
            and timm_cfg["pretrained_cfg"]["input_size"][0] == chans
        )
        assert len(timm_cfg["pretrained_cfg"]["mean"]) == chans
        args = {
            k: v for k, v in timm_cfg["model_args"].items() if k not in ("class_token", "fc_norm")
        }
        timm_like = VisionTransformer(**args).eval()
        timm_like.load_state_dict(load_file(tmp_path / f"timm-{kind}" / "model.safetensors"))
        hf = transformers.ViTModel.from_pretrained(
            tmp_path / f"hf-{kind}", add_pooling_layer=False
        ).eval()
        processor = json.loads((tmp_path / f"hf-{kind}" / "preprocessor_config.json").read_text())
        assert hf.config.num_channels == chans and len(processor["image_mean"]) == chans
        with torch.no_grad():
            assert torch.equal(timm_like.forward_features(x), ours.forward_features(x))
            torch.testing.assert_close(
                hf(pixel_values=x).last_hidden_state, ours.forward_features(x), rtol=0, atol=1e-5
            )
            if (timm := real_timm()) is not None:
                real = timm.models.vision_transformer.VisionTransformer(**timm_cfg["model_args"])
                real.load_state_dict(load_file(tmp_path / f"timm-{kind}" / "model.safetensors"))
                torch.testing.assert_close(
                    real.eval().forward_features(x), ours.forward_features(x), rtol=0, atol=1e-5
                )
        # the picture: a composite of three bands, or grey
        r = run_cli(
            [
                "python",
                "-m",
                "mpp.tools.viz",
                "--checkpoint",
                str(run),
                "--images",
                "2",
                "--out",
                str(tmp_path / f"{kind}.png"),
            ]
        )
        assert r.returncode == 0, r.stderr[-2000:]
        assert Image.open(tmp_path / f"{kind}.png").mode == "RGB"


def test_rgb_weights_start_a_four_band_fine_tune_adapted_and_say_so(runs, tmp_path):
    rgb = create_vit("vit_tiny_patch4_16", depth=2, embed_dim=32, num_heads=2)
    save_file(rgb.state_dict(), tmp_path / "rgb.safetensors")
    data = json.loads((runs["tif"]["run"] / "config.json").read_text())["data"]
    ft = {
        "name": "ft",
        "init": str(tmp_path / "rgb.safetensors"),
        "model": runs["tif"]["cfg"]["model"],
        "data": data,
        "finetune": {"mixup": 0.0, "cutmix": 0.0, "randaug_n": 0, "reprob": 0.0},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "train": {"batch_size": 12, "max_steps": 1, "ckpt_every": 100},
    }
    path = write_config(tmp_path / "ft.json", ft)
    r = run_cli(
        [
            "python",
            "downstream/finetune.py",
            "--config",
            str(path),
            "--output-dir",
            str(tmp_path / "ft"),
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RGB patch embedding adapted to 4 channels (tiled and scaled by 3/4)" in r.stderr
    r = run_cli(
        [
            "python",
            "downstream/finetune.py",
            "--config",
            str(path),
            "--set",
            "model.init_chans_policy=error",
            "--output-dir",
            str(tmp_path / "no"),
        ]
    )
    assert r.returncode == 2 and "model.init_chans_policy=adapt adapts RGB weights" in r.stderr


def test_channels_and_in_chans_that_disagree_exit_2_naming_both(tmp_path, runs, capsys):
    cfg = dict(runs["tif"]["cfg"])
    cfg["model"] = {**cfg["model"], "in_chans": 3}
    path = write_config(tmp_path / "c.json", cfg)
    from mpp.commands.pretrain import main

    code = main(["--config", str(path), "--output-dir", str(tmp_path / "x")])
    assert code == 2 and "model.in_chans=3 but data.channels=4" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_grey_16_bit_run_gives_what_it_was_trained_on_to_every_reader(runs, tmp_path):
    """Issue 50 §2: from the 16-bit grey run, k-NN, fine-tuning and mpp.create_model with
    nothing said of its channels, statistics or value range take them from the run (its
    model.json and data.json), as linear_demo's vit_tiny_patch8_32 takes its 16 px and patch 4;
    the readers' config.json stays as loaded. Before, k-NN ended in `patch_embed.proj.weight
    takes 1 channels; only RGB weights are adapted to 3`."""
    import mpp

    run, data = runs["png"]["run"], runs["png"]["data"]
    used = json.loads((run / "data.json").read_text())
    model = {**runs["png"]["cfg"]["model"], "name": "vit_tiny_patch8_32"}
    shards = {"train_shards": data["train"], "val_shards": data["val"], "num_classes": 4}
    knn = {"name": "k", "init": str(run), "model": model, "data": shards}
    ft = {
        **knn,
        "finetune": {"mixup": 0.0, "cutmix": 0.0, "randaug_n": 0, "reprob": 0.0},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "train": {"batch_size": 12, "max_steps": 1, "ckpt_every": 100},
    }
    for tool, cfg in (("knn", knn), ("finetune", ft)):
        path = write_config(tmp_path / f"{tool}.json", cfg)
        out = tmp_path / tool
        r = run_cli(
            ["python", f"downstream/{tool}.py", "--config", str(path), "--output-dir", str(out)]
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads((out / "data.json").read_text()) == used
        built = json.loads((out / "model.json").read_text())
        assert (built["in_chans"], built["img_size"], built["patch_size"]) == (1, SIZE, 4)
        loaded = json.loads((out / "config.json").read_text())["data"]
        assert loaded["channels"] == 3 and loaded["value_range"] is None  # as loaded
    assert json.loads((tmp_path / "knn" / "results.json").read_text())["num_val"] == VAL

    classifier = mpp.create_model("vit_tiny_patch8_32", pretrained=run, num_classes=4)
    assert classifier.pretrained_cfg["input_size"] == (1, SIZE, SIZE)
    assert [list(classifier.pretrained_cfg[k]) for k in ("mean", "std", "value_range")] == [
        used[k] for k in ("mean", "std", "value_range")
    ]
    assert classifier(torch.randn(2, 1, SIZE, SIZE)).shape == (2, 4)

    path = write_config(tmp_path / "rgb.json", {**knn, "data": {**shards, "channels": 3}})
    r = run_cli(
        [
            "python",
            "downstream/knn.py",
            "--config",
            str(path),
            "--output-dir",
            str(tmp_path / "rgb"),
        ]
    )
    assert r.returncode == 2 and "leave data.channels unset to take the init's 1" in r.stderr
