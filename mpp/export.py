"""Export a pretrained encoder for the ecosystem.

    python -m mpp.export RUN_DIR|CKPT_DIR|FILE.safetensors --format safetensors|timm [--out PATH]

``safetensors``: ``encoder.safetensors``, fp32, timm names, the architecture in its metadata
(what ``downstream/finetune.py --set init=...`` takes).
``timm``: a folder with ``model.safetensors`` + ``config.json`` in timm's hub layout:
``timm.models.VisionTransformer(**config["model_args"]).load_state_dict(load_file(...))``
(or ``timm.create_model(arch, pretrained=True, pretrained_cfg_overlay={"file": ...})`` for a
standard variant) loads it with ``strict=True`` and gives the same features.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mpp.checkpoint import save_weights
from mpp.models.vit import vit_config
from mpp.ops import IMAGENET_MEAN, IMAGENET_STD
from mpp.pretrained import load_pretrained

# model kwargs of ours that are timm VisionTransformer constructor arguments
_TIMM_ARGS = ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias", "drop_path_rate")


def timm_model_args(model_kwargs: dict) -> dict:
    """Our architecture -> timm VisionTransformer kwargs for a headless, cls-token encoder."""
    full = {**vit_config(model_kwargs["name"]), **{k: v for k, v in model_kwargs.items() if k != "name"}}
    args = {k: full[k] for k in _TIMM_ARGS if k in full}
    args.pop("drop_path_rate", None)  # a training choice, not the architecture
    return {**args, "num_classes": 0, "global_pool": "token", "class_token": True}


def export(source: str | Path, fmt: str, out: str | Path | None = None) -> Path:
    sd, kwargs = load_pretrained(source)
    if "name" not in kwargs:
        raise ValueError(f"{source}: the architecture is unknown (no metadata or config.json beside it)")
    sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
    src = Path(source)
    base = src if src.is_dir() else src.parent
    if fmt == "safetensors":
        path = Path(out) if out else base / "encoder.safetensors"
        save_weights(sd, path, {"format": "mpp-encoder", "model": kwargs})
        return path
    folder = Path(out) if out else base / "timm"
    folder.mkdir(parents=True, exist_ok=True)
    args = timm_model_args(kwargs)
    save_weights(sd, folder / "model.safetensors")
    config = {
        "architecture": kwargs["name"],
        "num_classes": 0,
        "num_features": args["embed_dim"],
        "global_pool": "token",
        "model_args": args,
        "pretrained_cfg": {
            "input_size": [args.get("in_chans", 3), args["img_size"], args["img_size"]],
            "interpolation": "bicubic",
            "crop_pct": 0.875,
            "mean": list(IMAGENET_MEAN),
            "std": list(IMAGENET_STD),
            "num_classes": 0,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
        },
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a pretrain run directory, a DeepSpeed checkpoint, or an encoder .safetensors")
    p.add_argument("--format", choices=("safetensors", "timm"), default="safetensors")
    p.add_argument("--out", help="output file (safetensors) or folder (timm)")
    args = p.parse_args(argv)
    try:
        path = export(args.source, args.format, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
