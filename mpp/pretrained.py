"""Pretrained weights in: an encoder (timm names) from an exported ``encoder.safetensors``,
a pretraining run directory or a DeepSpeed checkpoint of any ZeRO stage, loaded into a ViT
with its position embedding resampled to the new grid. Never unpickles arbitrary objects."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mpp.checkpoint import find_checkpoint, load_encoder_file, zero_to_fp32
from mpp.models.vit import VisionTransformer, resample_abs_pos_embed

# the encoder's keys in timm's (and MAE's, and our) naming
ENCODER_KEYS = ("cls_token", "pos_embed", "patch_embed.", "blocks.", "norm.", "fc_norm.", "head.")
RELEASE_SUFFIXES = (".pth", ".pt", ".bin")


def load_pretrained(init: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(encoder state dict with timm names, model kwargs if known) from ``init``: an exported or
    timm ``.safetensors``, a Hugging Face ViT folder, a checkpoint in MAE's / HPM's release format
    (``{"model": state_dict}``, ``.pth``), a pretrain run directory, or a DeepSpeed checkpoint
    (root or tag) of any ZeRO stage. Never unpickles arbitrary objects."""
    path = Path(init)
    if not path.exists():
        raise FileNotFoundError(f"{init}: no such file or directory")
    if path.is_file():
        if path.suffix in RELEASE_SUFFIXES:
            sd = read_release_file(path)
            return {k: v for k, v in sd.items() if k.startswith(ENCODER_KEYS)}, {}
        if path.suffix != ".safetensors":
            raise ValueError(f"{init}: unknown kind (expected .safetensors, .pth, a run directory, a Hugging Face "
                             "folder or a DeepSpeed checkpoint)")  # fmt: skip
        return load_encoder_file(path)
    if is_hf_folder(path):
        from mpp.hf import read_hf_folder

        return read_hf_folder(path)
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


def is_hf_folder(path: Path) -> bool:
    """A ``save_pretrained`` folder of a Hugging Face ViT (not one of our run directories)."""
    cfg = path / "config.json"
    return cfg.is_file() and json.loads(cfg.read_text()).get("model_type") == "vit"


def read_release_file(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict of a ``torch.save``d checkpoint in MAE's / HPM's / DeiT's release format
    (``{"model": ...}``, ``{"state_dict": ...}`` or the dict itself), read with
    ``weights_only=True``: a pickled payload is refused, never run."""
    import pickle

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as e:
        raise ValueError(f"{path}: refused: not a plain weights file ({str(e).splitlines()[0]})") from None
    for key in ("model", "state_dict", "module"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path}: no state dict found (expected {{'model': state_dict}} or a state dict)")
    return {k.removeprefix("module."): v for k, v in obj.items()}


# MAE's decoder names (models_mae.py) -> ours (mpp.objectives.mae: decoder_embed.*, decoder.*)
_MAE_DECODER = (("decoder_embed.", "decoder_embed.proj."), ("mask_token", "decoder_embed.mask_token"),
                ("decoder_pos_embed", "decoder_embed.pos_embed"), ("decoder_blocks.", "decoder.blocks."),
                ("decoder_norm.", "decoder.norm."), ("decoder_pred.", "decoder.pred."))  # fmt: skip


def mae_decoder_weights(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MAE decoder in a release checkpoint (``mae_pretrain_vit_base_full.pth``), in our names."""
    out = {}
    for k, v in sd.items():
        for theirs, ours in _MAE_DECODER:
            if k == theirs or (theirs.endswith(".") and k.startswith(theirs)):
                out[ours + k[len(theirs) :]] = v
                break
    return out


def init_objective(objective: torch.nn.Module, init: str | Path) -> dict[str, list[str]]:
    """Continue pretraining from published weights (``model.init``): the encoder from any source
    ``load_pretrained`` reads; a release file's MAE decoder (``_full`` checkpoints) into an MAE /
    HPM objective's pixel decoder too. Shape mismatches are errors naming the key; what stays at
    its initialisation is returned."""
    load_into(objective.encoder, init)
    loaded = ["encoder"]
    path = Path(init)
    mae = getattr(objective, "base", objective)  # hpm wraps its base objective
    if path.is_file() and path.suffix in RELEASE_SUFFIXES and hasattr(mae, "decoder_embed"):
        decoder = mae_decoder_weights(read_release_file(path))
        own = mae.state_dict()
        for k, v in decoder.items():
            if k not in own or own[k].shape != v.shape:
                got = tuple(v.shape)
                raise ValueError(f"init {init}: decoder weight {k} {got} does not fit the objective "
                                 f"({tuple(own[k].shape) if k in own else 'no such parameter'})")  # fmt: skip
        if decoder:
            mae.load_state_dict(decoder, strict=False)
            loaded.append("decoder")
    objective.weights_loaded()
    return {"loaded": loaded}
