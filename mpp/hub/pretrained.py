"""Pretrained weights in, from any source ``mpp.hub.source.weight_source`` names, into a ViT with
its position embedding resampled to the new grid; what the file states about the computation must
agree with the model, never silently (docs/ARCHITECTURE.md §4.9). Never unpickles arbitrary
objects."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

from mpp.checkpoint.format import MARKER, complete_tags, zero_to_fp32
from mpp.checkpoint.storage import CheckpointError
from mpp.hub.encoder_file import load_encoder_file
from mpp.hub.hf import read_hf_folder
from mpp.hub.source import differs, weight_source
from mpp.models.vit import VisionTransformer, full_vit_config, resample_abs_pos_embed

log = logging.getLogger(__name__)

# the encoder's keys in timm's (and MAE's, and our) naming
ENCODER_KEYS = ("cls_token", "pos_embed", "patch_embed.", "blocks.", "norm.", "fc_norm.", "head.")
# what the tensors' shapes say, and what only a file's metadata / config says (the image size is
# neither: a new resolution resamples pos_embed)
SHAPE_FACTS = ("patch_size", "in_chans", "embed_dim", "depth", "mlp_ratio", "qkv_bias")
STATED_FACTS = ("num_heads", "norm_eps")
# compared by name; the other shape facts show as a weight's shape, which the load names
NAMED_FACTS = ("qkv_bias", *STATED_FACTS)
# the constructor's values, which a file whose metadata leaves them out was built with (ours, timm's)
FACT_DEFAULTS = {"in_chans": 3, "mlp_ratio": 4.0, "qkv_bias": True, "norm_eps": 1e-6}


def load_pretrained(init: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(encoder state dict with timm names, model kwargs if known) from ``init``: an exported or
    timm ``.safetensors``, a Hugging Face or timm folder, a checkpoint in MAE's / HPM's release
    format (``{"model": state_dict}``, ``.pth``), a pretrain run directory, or a DeepSpeed
    checkpoint (root or tag) of any ZeRO stage (``weight_source``). Never unpickles arbitrary
    objects."""
    source = weight_source(init)
    if source.kind == "hf":
        return read_hf_folder(source.path)
    if source.kind == "timm":
        return load_encoder_file(source.path / "model.safetensors")[0], source.model
    if source.kind == "release":
        sd = read_release_file(source.path)
        return {k: v for k, v in sd.items() if k.startswith(ENCODER_KEYS)}, {}
    if source.kind == "encoder":
        return load_encoder_file(source.path)
    sd = zero_to_fp32(str(source.path), source.tag)
    # the encoder inside any objective (not a teacher's): the shortest '...encoder.' prefix
    prefixes = {k[: k.index("encoder.") + len("encoder.")] for k in sd if "encoder." in k}
    prefix = min((p for p in prefixes if not p.startswith("teacher")), key=len, default=None)
    if prefix is None:
        raise ValueError(f"{init}: the checkpoint holds no encoder weights")
    encoder = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
    kwargs = dict(source.model)
    # a fine-tuning run's classifier (an older run's config.json leaves the head out)
    if "head.weight" in encoder:
        pool = "avg" if "fc_norm.weight" in encoder else "token"
        kwargs.update(num_classes=encoder["head.weight"].shape[0], global_pool=pool)
    return encoder, kwargs


def init_record(init: str | Path) -> dict:
    """What a downstream run read from ``init``, as its results.json records it: the file or
    checkpoint, and for a pretraining run's directory the step and whether that run finished
    (its encoder exported, no stop recorded)."""
    if init == "scratch":
        return {}
    path, source = Path(init), weight_source(init)
    if source.kind not in ("encoder", "checkpoint") or not path.is_dir():  # a file, a hub folder
        return {"init_read": str(path)}
    root = source.path if source.kind == "checkpoint" else path / "checkpoints"
    tags = complete_tags(root)
    if source.kind == "encoder":  # the checkpoints written before it
        made = source.path.stat().st_mtime
        before = [t for t in tags if (root / t / MARKER).stat().st_mtime <= made]
        record = {"init_read": str(source.path)}
        finished = before == tags and not (path / "preempted.json").is_file()
        tags = before
    else:
        record = {"init_read": str(root / source.tag) if source.tag else str(path)}
        finished = False
    if tags:
        record["init_step"] = int(tags[-1].removeprefix("step"))
    if (path / "config.json").is_file():  # a run's directory: did it finish?
        record["init_finished"] = finished
    return record


def tensor_facts(sd: dict[str, torch.Tensor]) -> dict:
    """What the encoder weights' shapes say about the architecture."""
    if "patch_embed.proj.weight" not in sd or "blocks.0.mlp.fc1.weight" not in sd:
        return {}
    dim, chans, patch, _ = sd["patch_embed.proj.weight"].shape
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    mlp_ratio = sd["blocks.0.mlp.fc1.weight"].shape[0] / dim
    return dict(
        patch_size=patch,
        in_chans=chans,
        embed_dim=dim,
        depth=depth,
        mlp_ratio=mlp_ratio,
        qkv_bias="blocks.0.attn.qkv.bias" in sd,
    )


def check_pooling(model: VisionTransformer, sd: dict[str, torch.Tensor], init: str | Path) -> None:
    """A mean-pooled classifier's weights (fc_norm, no final norm) fit only a mean-pooling model."""
    if "fc_norm.weight" in sd and "norm.weight" not in sd and model.global_pool != "avg":
        raise ValueError(
            f"init {init}: its weights pool global_pool='avg' (fc_norm after the mean, no final norm: a "
            f"fine-tuned classifier), the model pools {model.global_pool!r}; fine-tune it with "
            "finetune.global_pool=avg, or start from its pretraining run"
        )


def check_shapes(
    model: VisionTransformer, sd: dict[str, torch.Tensor], init: str | Path
) -> list[str]:
    """Every weight a parameter of the model with its shape, every encoder parameter there;
    returns the model's keys left at their initialisation."""
    own = model.state_dict()
    for k, v in sd.items():
        if k not in own:
            raise ValueError(
                f"init {init}: {k} is not a parameter of the model (a different architecture?)"
            )
        if v.shape != own[k].shape:
            hint = ""
            if k == "patch_embed.proj.weight":
                hint = (
                    f" (patch_size {v.shape[-1]}, the model's {own[k].shape[-1]}: model.patch_size)"
                )
            raise ValueError(
                f"init {init}: {k} has shape {tuple(v.shape)}, the model expects {tuple(own[k].shape)}{hint}"
            )
    missing = [k for k in own if k not in sd]
    unexpected_missing = [k for k in missing if not k.startswith(("head.", "fc_norm.", "norm."))]
    if unexpected_missing:
        raise ValueError(
            f"init {init}: missing {len(unexpected_missing)} encoder weights, e.g. {unexpected_missing[:3]} (a different depth or size?)"
        )
    return missing


def check_stated_facts(
    model: VisionTransformer, sd: dict[str, torch.Tensor], model_kwargs: dict, init: str | Path
) -> None:
    """The qkv bias the file's shapes show, and the heads and LayerNorm eps its metadata /
    config.json states (when that metadata describes these tensors at all), must be the model's;
    a difference is an error naming the key and both values."""
    stated = tensor_facts(sd)
    if "name" in model_kwargs and stated:
        meta = {**FACT_DEFAULTS, **full_vit_config(model_kwargs)}
        if differ := [k for k in SHAPE_FACTS if k in meta and differs(meta[k], stated[k])]:
            log.warning(
                "%s: its metadata does not describe its tensors (%s): num_heads and norm_eps not checked",
                init,
                ", ".join(f"{k} {meta[k]} vs {stated[k]}" for k in differ),
            )
        else:
            stated.update({k: meta[k] for k in STATED_FACTS})
    ours = model.architecture()
    for key, theirs in ((k, stated[k]) for k in NAMED_FACTS if k in stated):
        if differs(theirs, ours[key]):
            raise ValueError(
                f"init {init}: its weights state {key}={theirs!r}, the config's model has "
                f"{key}={ours[key]!r} (model.{key}): they must agree"
            )


def adapt_input_channels(weight: torch.Tensor, chans: int) -> torch.Tensor:
    """An RGB patch embedding (D, 3, P, P) for ``chans`` input channels, as timm's
    ``adapt_input_conv``: one channel gets the three summed (a grey image's response stays the
    same); more tile the RGB kernels and scale them by 3 / C (the summed response stays the same)."""
    if weight.shape[1] != 3:
        raise ValueError(
            f"patch_embed.proj.weight takes {weight.shape[1]} channels; only RGB weights are "
            f"adapted to {chans}"
        )
    w = weight.float()
    if chans == 1:
        return w.sum(dim=1, keepdim=True).to(weight.dtype)
    tiled = w.repeat(1, math.ceil(chans / 3), 1, 1)[:, :chans] * (3 / chans)
    return tiled.to(weight.dtype)


# what the messages call the model's channels and size: a config's keys, or create_model's
CONFIG_KEYS = {"channels": "data.channels", "img_size": "model.img_size"}


def load_into(
    model: VisionTransformer,
    init: str | Path,
    chans_policy: str = "adapt",
    keys: dict[str, str] = CONFIG_KEYS,
) -> dict[str, list[str]]:
    """Load pretrained encoder weights into ``model``: the head is left fresh, the position
    embedding resampled to the model's grid, RGB weights adapted to another channel count
    (``chans_policy`` "adapt": ``adapt_input_channels``, said in one line; "error": refused); an
    architecture fact or a shape that differs is an error naming it (``keys``: what the caller
    calls the channels and the size). Returns the keys left at their initialisation (e.g. head,
    fc_norm)."""
    sd, kwargs = load_pretrained(init)
    # first: its fc_norm would read as "not a parameter of the model"
    check_pooling(model, sd, init)
    resampled = None  # said once the weights are in: a refusal below is the only line then
    if "pos_embed" in sd and sd["pos_embed"].shape != model.pos_embed.shape:
        resampled = math.isqrt(sd["pos_embed"].shape[1] - model.num_prefix_tokens)
        sd["pos_embed"] = resample_abs_pos_embed(
            sd["pos_embed"], model.grid_size, num_prefix_tokens=model.num_prefix_tokens
        )
    proj, chans = sd.get("patch_embed.proj.weight"), model.patch_embed.in_chans
    if proj is not None and proj.shape[1] != chans:
        theirs, key = proj.shape[1], keys["channels"]
        if theirs != 3:
            raise ValueError(
                f"init {init}: its patch embedding takes {theirs} channel(s), the model {chans} "
                f"({key}={chans}): only RGB weights are adapted to another count; leave {key} "
                f"unset to take the init's {theirs} with its statistics"
            )
        if chans_policy != "adapt":
            raise ValueError(
                f"init {init}: its patch embedding takes {theirs} channels, the model "
                f"{chans} ({key}); model.init_chans_policy=adapt adapts RGB weights"
            )
        sd["patch_embed.proj.weight"] = adapt_input_channels(proj, chans)
        how = "summed" if chans == 1 else f"tiled and scaled by 3/{chans}"
        log.info("init %s: RGB patch embedding adapted to %d channels (%s)", init, chans, how)
    check_stated_facts(model, sd, kwargs, init)  # the file's own keys, head and final norm too
    # the head left fresh; MAE: pooled features get a fresh fc_norm, no final norm
    aside = ("head.", "norm.") if model.global_pool == "avg" else ("head.",)
    sd = {k: v for k, v in sd.items() if not k.startswith(aside)}
    missing = check_shapes(model, sd, init)
    model.load_state_dict(sd, strict=False)
    if resampled and os.environ.get("RANK", "0") == "0":
        log.warning(
            "init %s: position embeddings resampled from its %dx%d patches to the model's %dx%d "
            "(%s %d)",
            init,
            resampled,
            resampled,
            *model.grid_size,
            keys["img_size"],
            model.patch_embed.img_size[0],
        )
    return {"initialised": missing}


def read_release_file(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict of a ``torch.save``d checkpoint in MAE's / HPM's / DeiT's release format
    (``{"model": ...}``, ``{"state_dict": ...}`` or the dict itself), read with
    ``weights_only=True``: a pickled payload is refused, never run."""
    import pickle

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"{path}: refused: not a plain weights file ({str(e).splitlines()[0]})"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:  # a truncated or damaged copy
        raise CheckpointError(
            f"{path}: not a readable weights file ({str(e).splitlines()[0]})"
        ) from None
    for key in ("model", "state_dict", "module"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(
            f"{path}: no state dict found (expected {{'model': state_dict}} or a state dict)"
        )
    return {k.removeprefix("module."): v for k, v in obj.items()}


# MAE's decoder names (models_mae.py) -> ours (mpp.objectives.mae: decoder_embed.*, decoder.*)
_MAE_DECODER = (
    ("decoder_embed.", "decoder_embed.proj."),
    ("mask_token", "decoder_embed.mask_token"),
    ("decoder_pos_embed", "decoder_embed.pos_embed"),
    ("decoder_blocks.", "decoder.blocks."),
    ("decoder_norm.", "decoder.norm."),
    ("decoder_pred.", "decoder.pred."),
)


def mae_decoder_weights(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MAE decoder in a release checkpoint (``mae_pretrain_vit_base_full.pth``), in our names."""
    out = {}
    for k, v in sd.items():
        for theirs, ours in _MAE_DECODER:
            if k == theirs or (theirs.endswith(".") and k.startswith(theirs)):
                out[ours + k[len(theirs) :]] = v
                break
    return out


def init_objective(
    objective: torch.nn.Module, init: str | Path, chans_policy: str = "adapt"
) -> dict[str, list[str]]:
    """Continue pretraining from published weights (``model.init``): the encoder from any source
    ``load_pretrained`` reads (RGB weights adapted to another channel count by ``chans_policy``);
    a release file's MAE decoder (``_full`` checkpoints) into an MAE / HPM objective's pixel
    decoder too, its pixel head left fresh when the channels differ. Shape mismatches are errors
    naming the key; what stays at its initialisation is returned."""
    load_into(objective.encoder, init, chans_policy)
    loaded = ["encoder"]
    mae = getattr(objective, "base", objective)  # hpm wraps its base objective
    source = weight_source(init)
    if source.kind == "release" and hasattr(mae, "decoder_embed"):
        decoder = mae_decoder_weights(read_release_file(source.path))
        own = mae.state_dict()
        pred = "decoder.pred.weight"
        if pred in decoder and pred in own and decoder[pred].shape != own[pred].shape:
            log.info("init %s: its pixel head predicts other channels: left fresh", init)
            decoder = {k: v for k, v in decoder.items() if not k.startswith("decoder.pred.")}
        for k, v in decoder.items():
            if k not in own or own[k].shape != v.shape:
                got = tuple(v.shape)
                raise ValueError(
                    f"init {init}: decoder weight {k} {got} does not fit the objective "
                    f"({tuple(own[k].shape) if k in own else 'no such parameter'})"
                )
        if decoder:
            mae.load_state_dict(decoder, strict=False)
            loaded.append("decoder")
    objective.weights_loaded()
    return {"loaded": loaded}
