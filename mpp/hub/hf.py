"""Hugging Face ``transformers`` ViT <-> our encoder: the config and the state dict, both ways,
exactly; what HF's ViT cannot express is refused with the reason (docs/ARCHITECTURE.md §4.9)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from mpp.models.vit import full_vit_config


def hf_config(model_kwargs: dict, id2label: dict[int, str] | None = None) -> dict:
    """Our architecture (``encoder.safetensors`` metadata) -> a ``transformers.ViTConfig`` dict."""
    full = full_vit_config(model_kwargs)
    num_classes = int(full.get("num_classes", 0) or 0)
    if num_classes and full.get("global_pool", "token") != "token":
        raise ValueError(
            f"global_pool={full['global_pool']!r}: Hugging Face's ViTForImageClassification "
            "classifies the cls token after the final LayerNorm; a mean-pooled head with fc_norm "
            "(MAE's fine-tuning recipe: finetune.global_pool's default, every shipped fine-tuning "
            "config's) has no counterpart there. Export this run with --format timm (timm's "
            "VisionTransformer takes it as it is), fine-tune with --set finetune.global_pool=token "
            "for an HF classifier, or export the pretraining run it started from with --format hf "
            "(an encoder for ViTModel)"
        )
    dim, mlp_ratio = full["embed_dim"], full.get("mlp_ratio", 4.0)
    if float(dim * mlp_ratio) != int(dim * mlp_ratio):
        raise ValueError(
            f"mlp_ratio {mlp_ratio} x embed_dim {dim} is not a whole intermediate size"
        )
    config = {
        "model_type": "vit",
        "architectures": ["ViTForImageClassification" if num_classes else "ViTModel"],
        "image_size": full["img_size"],
        "patch_size": full["patch_size"],
        "num_channels": full.get("in_chans", 3),
        "hidden_size": dim,
        "num_hidden_layers": full["depth"],
        "num_attention_heads": full["num_heads"],
        "intermediate_size": int(dim * mlp_ratio),
        "hidden_act": "gelu",  # exact (erf) GELU, as nn.GELU()
        "layer_norm_eps": full.get("norm_eps", 1e-6),
        "qkv_bias": full.get("qkv_bias", True),
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "initializer_range": 0.02,
        "encoder_stride": full["patch_size"],
    }
    if num_classes:
        labels = id2label or {i: str(i) for i in range(num_classes)}
        config["id2label"] = {str(i): labels[i] for i in range(num_classes)}
        config["label2id"] = {v: i for i, v in enumerate(config["id2label"].values())}
    return config


def to_hf(state_dict: dict[str, Tensor], depth: int, classifier: bool) -> dict[str, Tensor]:
    """Our (timm-named) encoder weights -> HF ViTModel / ViTForImageClassification weights."""
    p = "vit." if classifier else ""
    sd = state_dict
    out = {
        f"{p}embeddings.cls_token": sd["cls_token"],
        f"{p}embeddings.position_embeddings": sd["pos_embed"],
        f"{p}embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
        f"{p}embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
        f"{p}layernorm.weight": sd["norm.weight"],
        f"{p}layernorm.bias": sd["norm.bias"],
    }
    for i in range(depth):
        src, dst = f"blocks.{i}.", f"{p}encoder.layer.{i}."
        # qkv_bias=False: no bias
        for kind in ("weight", "bias") if f"{src}attn.qkv.bias" in sd else ("weight",):
            for name, t in zip(_QKV, sd[f"{src}attn.qkv.{kind}"].chunk(3), strict=True):
                out[f"{dst}attention.attention.{name}.{kind}"] = t
        for ours, theirs in _BLOCK_NAMES:
            for kind in ("weight", "bias"):
                out[f"{dst}{theirs}.{kind}"] = sd[f"{src}{ours}.{kind}"]
    if classifier:
        out["classifier.weight"], out["classifier.bias"] = sd["head.weight"], sd["head.bias"]
    return {k: v.contiguous() for k, v in out.items()}


_QKV = ("query", "key", "value")  # HF's split of the fused qkv, in its order
_BLOCK_NAMES = (
    ("attn.proj", "attention.output.dense"),
    ("norm1", "layernorm_before"),
    ("norm2", "layernorm_after"),
    ("mlp.fc1", "intermediate.dense"),
    ("mlp.fc2", "output.dense"),
)


# transformers 5 names the block's modules like this; its from_pretrained still reads the
# names above (the Hub's checkpoints), which is what we write
_V5_NAMES = {
    "attention.q_proj": "attention.attention.query",
    "attention.k_proj": "attention.attention.key",
    "attention.v_proj": "attention.attention.value",
    "attention.o_proj": "attention.output.dense",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
}


def _legacy_name(key: str) -> str:
    if not key.startswith("layers."):
        return key
    _, i, rest = key.split(".", 2)
    for new, old in _V5_NAMES.items():
        if rest.startswith(new + "."):
            rest = old + rest[len(new) :]
    return f"encoder.layer.{i}.{rest}"


def from_hf(state_dict: dict[str, Tensor], depth: int) -> dict[str, Tensor]:
    """HF ViT weights (ViTModel, ViTForImageClassification, ViTForMaskedImageModeling: the ``vit.``
    prefix is optional; transformers 4's or 5's module names) -> our timm-named encoder weights;
    the inverse of ``to_hf``."""
    sd = {_legacy_name(k.removeprefix("vit.")): v for k, v in state_dict.items()}
    out = {
        "cls_token": sd["embeddings.cls_token"],
        "pos_embed": sd["embeddings.position_embeddings"],
        "patch_embed.proj.weight": sd["embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": sd["embeddings.patch_embeddings.projection.bias"],
    }
    if "layernorm.weight" in sd:
        out["norm.weight"], out["norm.bias"] = sd["layernorm.weight"], sd["layernorm.bias"]
    for i in range(depth):
        src, dst = f"encoder.layer.{i}.attention.attention.", f"blocks.{i}."
        # qkv_bias=False: no bias
        for kind in ("weight", "bias") if f"{src}query.bias" in sd else ("weight",):
            out[f"{dst}attn.qkv.{kind}"] = torch.cat([sd[f"{src}{n}.{kind}"] for n in _QKV])
        for ours, theirs in _BLOCK_NAMES:
            for kind in ("weight", "bias"):
                out[f"{dst}{ours}.{kind}"] = sd[f"encoder.layer.{i}.{theirs}.{kind}"]
    if "classifier.weight" in sd:
        out["head.weight"], out["head.bias"] = sd["classifier.weight"], sd["classifier.bias"]
    return out


def model_kwargs_from_hf(config: dict) -> dict:
    """A ``transformers.ViTConfig`` dict -> our architecture (name + overrides)."""
    img, patch = config.get("image_size", 224), config.get("patch_size", 16)
    side = img if isinstance(img, int) else img[0]
    patch_side = patch if isinstance(patch, int) else patch[0]
    if config.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"hidden_act {config['hidden_act']!r}: our ViT uses the exact GELU only")
    return {
        "name": f"vit_base_patch{patch_side}_{side}",
        "img_size": img,
        "patch_size": patch_side,
        "in_chans": config.get("num_channels", 3),
        "embed_dim": config["hidden_size"],
        "depth": config["num_hidden_layers"],
        "num_heads": config["num_attention_heads"],
        "mlp_ratio": config["intermediate_size"] / config["hidden_size"],
        "qkv_bias": config.get("qkv_bias", True),
        "norm_eps": config.get("layer_norm_eps", 1e-12),
    }


def read_hf_folder(folder: str | Path) -> tuple[dict[str, Tensor], dict]:
    """(our encoder state dict, our model kwargs) from a ``save_pretrained`` folder
    (``config.json`` + ``model.safetensors``; pickled ``pytorch_model.bin`` is refused)."""
    from mpp.hub.encoder_file import load_encoder_file

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "vit":
        raise ValueError(f"{folder}: model_type {config.get('model_type')!r}, expected 'vit'")
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise ValueError(
            f"{folder}: no model.safetensors (a pickled pytorch_model.bin is not loaded)"
        )
    kwargs = model_kwargs_from_hf(config)
    return from_hf(load_encoder_file(weights)[0], kwargs["depth"]), kwargs
