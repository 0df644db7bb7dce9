"""Export a trained encoder (or a fine-tuned classifier) for the ecosystem.

    mpp export RUN_DIR|CKPT_DIR|FILE.safetensors --format safetensors|timm|hf [--out PATH]

``safetensors``: ``encoder.safetensors``, fp32, timm names, the architecture in its metadata
(what ``mpp finetune --set init=...`` takes).
``timm``: a folder with ``model.safetensors`` + ``config.json`` in timm's hub layout:
``timm.models.VisionTransformer(**config["model_args"]).load_state_dict(load_file(...))``
loads it with ``strict=True`` and gives the same features, or for a fine-tuned run the same
logits (head, ``fc_norm`` and ``global_pool`` carried; the run's mean/std in ``pretrained_cfg``).
``hf``: a ``save_pretrained`` folder for ``transformers``: ``ViTModel.from_pretrained(DIR)``
(a pretrained encoder) or ``ViTForImageClassification`` (a fine-tuned run, ``id2label`` from the
shards' class names), with a ``preprocessor_config.json`` carrying the run's size, mean and std.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mpp.checkpoint.storage import CheckpointError
from mpp.hub.encoder_file import encoder_metadata, save_weights
from mpp.hub.hf import hf_config, to_hf
from mpp.hub.pretrained import load_pretrained
from mpp.hub.source import weight_source
from mpp.models.vit import full_vit_config
from mpp.ops import IMAGENET_MEAN, IMAGENET_STD, to_2tuple
from mpp.quiet import add_verbose_argument

# model kwargs of ours that are timm VisionTransformer constructor arguments
_TIMM_ARGS = (
    "img_size",
    "patch_size",
    "in_chans",
    "embed_dim",
    "depth",
    "num_heads",
    "mlp_ratio",
    "qkv_bias",
    "drop_path_rate",
)
FORMATS = ("safetensors", "timm", "hf")
TIMM_NORM_EPS = 1e-6  # timm's ViT: norm_layer = partial(nn.LayerNorm, eps=1e-6)


def timm_model_args(model_kwargs: dict) -> dict:
    """Our architecture -> timm VisionTransformer kwargs: a headless cls-token encoder, or a
    classifier with its head and pooling (``fc_norm`` after an average pool, as timm and MAE do)."""
    full = full_vit_config(model_kwargs)
    if full.get("norm_eps", TIMM_NORM_EPS) != TIMM_NORM_EPS:
        raise ValueError(
            f"norm_eps={full['norm_eps']}: timm's VisionTransformer builds its LayerNorms with eps "
            f"{TIMM_NORM_EPS} and its model_args cannot state another; export with --format hf or safetensors"
        )
    args = {k: full[k] for k in _TIMM_ARGS if k in full}
    args.pop("drop_path_rate", None)  # a training choice, not the architecture
    num_classes = int(full.get("num_classes", 0) or 0)
    pool = full.get("global_pool", "token") if num_classes else "token"
    return {
        **args,
        "num_classes": num_classes,
        "global_pool": pool,
        "class_token": True,
        "fc_norm": pool == "avg",
    }


def run_info(source: str | Path) -> dict:
    """What the encoder ``source`` holds was trained on (``weight_source``): its mean, std and
    value range (ImageNet's statistics and 8-bit when it states none), and its run's shards' class
    names (its config.json; None when there is no run beside it)."""
    from mpp.data import digits_shards, expand_shards, read_sizes

    found = weight_source(source)
    info = {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "value_range": None}
    info |= {k: list(v) if v else v for k, v in found.pixels.items()}
    info["class_names"] = None
    run = found.run_dir
    if run is None or not (run / "config.json").is_file():
        return info
    data = json.loads((run / "config.json").read_text()).get("data") or {}
    if not found.pixels and "auto" in (data.get("mean"), data.get("std")):
        raise ValueError(
            f'{run / "config.json"}: data.mean/std "auto", and no data.json beside it says what '
            "the run measured (copy the run's data.json and model.json with its config.json)"
        )
    try:
        spec = data.get("train_shards") or digits_shards(found.img_size)["train"]
        info["class_names"] = (read_sizes(expand_shards(spec)) or {}).get("class_names")
    except (KeyError, ValueError, OSError, TypeError):
        pass  # no class names: HF labels stay "0", "1", ...
    return info


def export(source: str | Path, fmt: str, out: str | Path | None = None) -> Path:
    """``source``'s encoder (or fine-tuned classifier) as ``fmt``; the path written."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; allowed: {FORMATS}")
    sd, kwargs = load_pretrained(source)
    if "name" not in kwargs:
        raise ValueError(
            f"{source}: the architecture is unknown (no metadata, model.json or config.json "
            "beside it)"
        )
    classifier = int(kwargs.get("num_classes", 0) or 0) > 0 and "head.weight" in sd
    if not classifier:
        sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
        kwargs = {k: v for k, v in kwargs.items() if k not in ("num_classes", "global_pool")}
    elif fmt == "hf":
        hf_config(kwargs)  # refused before anything is written: what HF cannot express
    src = Path(source)
    base = src if src.is_dir() else src.parent
    if fmt == "safetensors":  # with what the source states it was trained on, as it states it
        path = Path(out) if out else base / "encoder.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        pixels = {k: list(v) if v else v for k, v in weight_source(source).pixels.items()}
        save_weights(sd, path, encoder_metadata(kwargs, pixels))
        return path
    folder = Path(out) if out else base / fmt
    write = write_timm if fmt == "timm" else write_hf
    write(sd, kwargs, run_info(source), folder)
    return folder


def write_timm(sd: dict, kwargs: dict, info: dict, folder: Path) -> None:
    args = timm_model_args(kwargs)
    folder.mkdir(parents=True, exist_ok=True)
    save_weights(sd, folder / "model.safetensors")
    size = args["img_size"] if isinstance(args["img_size"], int) else args["img_size"][0]
    config = {
        "architecture": kwargs["name"],
        "num_classes": args["num_classes"],
        "num_features": args["embed_dim"],
        "global_pool": args["global_pool"],
        "model_args": args,
        "pretrained_cfg": {
            "input_size": [args.get("in_chans", 3), size, size],
            "interpolation": "bicubic",
            "crop_pct": 0.875,
            "mean": info["mean"],
            "std": info["std"],
            "num_classes": args["num_classes"],
            "first_conv": "patch_embed.proj",
            "classifier": "head",
        },
    }
    if info["class_names"] and args["num_classes"]:
        config["label_names"] = info["class_names"]
    if info["value_range"]:  # not 8-bit: what maps to [0, 1] (timm's own readers assume 255)
        config["value_range"] = info["value_range"]
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_hf(sd: dict, kwargs: dict, info: dict, folder: Path) -> None:
    full = full_vit_config(kwargs)
    num_classes = int(full.get("num_classes", 0) or 0)
    names = (
        info["class_names"]
        if info["class_names"] and len(info["class_names"]) == num_classes
        else None
    )
    # refuses what HF cannot express
    config = hf_config(kwargs, dict(enumerate(names)) if names else None)
    folder.mkdir(parents=True, exist_ok=True)
    save_weights(
        to_hf(sd, full["depth"], classifier=num_classes > 0),
        folder / "model.safetensors",
        {"format": "pt"},
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    h, w = to_2tuple(full["img_size"], "img_size")
    # the value range to [0, 1]: HF rescales by a factor only, so a low end other than 0 moves
    # into the mean ((x / span - low / span) - mean == x / span - (mean + low / span))
    low, high = info["value_range"] or (0, 255)
    span = high - low
    processor = {
        "image_processor_type": "ViTImageProcessor",
        "do_resize": True,
        "size": {"height": h, "width": w},
        "resample": 3,  # PIL bicubic
        "do_rescale": True,
        "rescale_factor": 1 / span,
        "do_normalize": True,
        "image_mean": [m + low / span for m in info["mean"]],
        "image_std": info["std"],
    }
    (folder / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "source", help="a run directory, a DeepSpeed checkpoint, or an encoder .safetensors"
    )
    p.add_argument("--format", choices=FORMATS, default="safetensors")
    p.add_argument("--out", help="output file (safetensors) or folder (timm, hf)")
    add_verbose_argument(p)
    args = p.parse_args(argv)
    try:
        path = export(args.source, args.format, args.out)
    except (FileNotFoundError, ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)  # CheckpointError: a damaged file, named
        return 2
    print(path)
    if args.format == "hf":
        print(hf_loading(path), file=sys.stderr)
    return 0


def hf_loading(folder: Path) -> str:
    """How transformers loads the folder: an encoder as ``ViTModel`` without the pooler it would
    otherwise add untrained (and list as MISSING in its load report)."""
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    if arch == "ViTModel":
        return (
            f"load it with transformers.ViTModel.from_pretrained('{folder}', "
            "add_pooling_layer=False): the encoder has no pooler (ViTModel would add an untrained "
            "one, listed as MISSING in its load report); last_hidden_state is our forward_features"
        )
    return f"load it with transformers.{arch}.from_pretrained('{folder}')"


if __name__ == "__main__":
    sys.exit(main())
