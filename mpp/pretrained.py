"""Pretrained weights in: an encoder (timm names) from an exported ``encoder.safetensors``,
a pretraining run directory or a DeepSpeed checkpoint of any ZeRO stage, loaded into a ViT
with its position embedding resampled to the new grid. Never unpickles arbitrary objects."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mpp.checkpoint import find_checkpoint, load_encoder_file, zero_to_fp32
from mpp.models.vit import VisionTransformer, resample_abs_pos_embed


def load_pretrained(init: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(encoder state dict with timm names, model kwargs if known) from ``init``: an exported
    ``.safetensors``, a pretrain run directory, or a DeepSpeed checkpoint (root or tag) of any
    ZeRO stage. Never unpickles arbitrary objects."""
    path = Path(init)
    if not path.exists():
        raise FileNotFoundError(f"{init}: no such file or directory")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"{init}: unknown kind (expected .safetensors, a run directory or a DeepSpeed checkpoint)")
        return load_encoder_file(path)
    if (path / "encoder.safetensors").is_file():
        return load_encoder_file(path / "encoder.safetensors")
    found = find_checkpoint(path)
    if found is None:
        raise ValueError(f"{init}: neither encoder.safetensors nor a DeepSpeed checkpoint found there")
    sd = zero_to_fp32(*found)
    # the encoder inside any objective: keys ending in a ViT parameter, under '...encoder.'
    prefixes = sorted({k[: k.index("encoder.") + len("encoder.")] for k in sd if "encoder." in k}, key=len)
    prefixes = [p for p in prefixes if not p.startswith("teacher")]
    if not prefixes:
        raise ValueError(f"{init}: the checkpoint holds no encoder weights")
    prefix = prefixes[0]
    kwargs: dict = {}
    cfg_file = found[0].parent / "config.json"
    if cfg_file.is_file():
        model = json.loads(cfg_file.read_text()).get("model", {})
        kwargs = {k: v for k, v in model.items() if v is not None}
    return {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}, kwargs


def load_into(model: VisionTransformer, init: str | Path) -> dict[str, list[str]]:
    """Load pretrained encoder weights into ``model``: the head is left fresh, the position
    embedding resampled to the model's grid; any other shape mismatch is an error naming it.
    Returns the keys left at their initialisation (e.g. head, fc_norm)."""
    sd, _ = load_pretrained(init)
    own = model.state_dict()
    if "pos_embed" in sd and sd["pos_embed"].shape != own["pos_embed"].shape:
        sd["pos_embed"] = resample_abs_pos_embed(sd["pos_embed"], model.grid_size, num_prefix_tokens=model.num_prefix_tokens)
    sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
    if model.global_pool == "avg":
        sd = {k: v for k, v in sd.items() if not k.startswith("norm.")}  # MAE: pooled features get a fresh fc_norm
    for k, v in sd.items():
        if k not in own:
            raise ValueError(f"init {init}: {k} is not a parameter of the model (a different architecture?)")
        if v.shape != own[k].shape:
            raise ValueError(f"init {init}: {k} has shape {tuple(v.shape)}, the model expects {tuple(own[k].shape)}")
    missing = [k for k in own if k not in sd]
    unexpected_missing = [k for k in missing if not k.startswith(("head.", "fc_norm.", "norm."))]
    if unexpected_missing:
        raise ValueError(f"init {init}: missing {len(unexpected_missing)} encoder weights, e.g. {unexpected_missing[:3]} (a different depth or size?)")
    model.load_state_dict(sd, strict=False)
    return {"initialised": missing}
