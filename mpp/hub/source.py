"""What an ``init`` is and what its encoder was trained on, in one place: ``weight_source`` (the
kind of source, its weights, the run that wrote them, the architecture and the pixels it states),
read without the tensors (docs/ARCHITECTURE.md §4.9)."""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpp.checkpoint.format import find_checkpoint
from mpp.checkpoint.storage import CheckpointError
from mpp.data.stats import run_pixels
from mpp.hub.encoder_file import MODEL_FILE, encoder_file_metadata
from mpp.hub.hf import model_kwargs_from_hf
from mpp.models.vit import VisionTransformer, full_vit_config, vit_config

RELEASE_SUFFIXES = (".pth", ".pt", ".bin")
ENCODER_FILE = "encoder.safetensors"
PIXEL_FACTS = ("mean", "std", "value_range")
HF_PROCESSOR = "preprocessor_config.json"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightSource:
    """An ``init`` resolved: its ``kind`` ("encoder": a ``.safetensors`` of timm-named weights,
    ours or timm's; "checkpoint": a DeepSpeed checkpoint; "hf" / "timm": a hub folder; "release":
    MAE's / HPM's ``.pth``), the ``path`` its weights are read from (a checkpoint's root, with its
    ``tag``), the ``run_dir`` that wrote it, and what it states: ``model`` (create_vit's kwargs,
    {} when unknown) and ``pixels`` (mean / std / value_range, each only where stated)."""

    init: str
    kind: str
    path: Path
    tag: str | None = None
    run_dir: Path | None = None
    model: dict = field(default_factory=dict)
    pixels: dict = field(default_factory=dict)

    @property
    def architecture(self) -> dict:
        """Every constructor argument it states, its variant's filled in ({} when unknown)."""
        try:
            return full_vit_config(self.model) if "name" in self.model else dict(self.model)
        except ValueError:  # a variant we do not know: what it states, as stated
            return dict(self.model)

    @property
    def channels(self) -> int | None:
        return self.architecture.get("in_chans", 3 if "name" in self.model else None)

    @property
    def img_size(self) -> int | None:
        side = self.architecture.get("img_size")
        return side[0] if isinstance(side, (list, tuple)) else side

    @property
    def facts(self) -> dict:
        """What the encoder was trained on, as the data keys name them: channels, and the
        mean, std and value range it states."""
        out = {"channels": self.channels} if self.channels is not None else {}
        return out | self.pixels


def weight_source(init: str | Path) -> WeightSource:
    """``init`` resolved (``WeightSource``): an exported or timm ``.safetensors``, a Hugging Face
    or timm folder, a release ``.pth``, a pretraining or fine-tuning run directory, or a
    DeepSpeed checkpoint (root or tag). FileNotFoundError / ValueError name what is wrong."""
    path = _existing(init)
    kind, config = folder_kind(path)
    if kind == "hf":
        return WeightSource(
            str(init), kind, path, model=model_kwargs_from_hf(config), pixels=_hf_pixels(path)
        )
    if kind == "timm":
        pixels = _stated(config.get("pretrained_cfg") or {}) | _stated(config, ("value_range",))
        return WeightSource(str(init), kind, path, model=timm_model_kwargs(config), pixels=pixels)
    if (path / ENCODER_FILE).is_file():
        path = path / ENCODER_FILE
    if path.is_file():
        if path.suffix in RELEASE_SUFFIXES:
            return WeightSource(str(init), "release", path)
        try:
            meta = encoder_file_metadata(path)
        except CheckpointError:
            meta = {}  # a damaged file: the load names it
        run = _run_beside(path.parent)
        stated = (_run_pixels(run) if run else {}) or _stated(meta.get("data") or {})
        return WeightSource(str(init), "encoder", path, None, run, meta.get("model", {}), stated)
    found = find_checkpoint(path)
    if found is None:
        raise ValueError(_no_weights(path))
    root = Path(found[0])
    run = root.parent
    model = run_model_kwargs(run)
    return WeightSource(str(init), "checkpoint", root, found[1], run, model, _run_pixels(run))


def folder_kind(path: Path) -> tuple[str | None, dict]:
    """("hf", its config) for a ``save_pretrained`` folder of a Hugging Face ViT, ("timm", its
    config) for a timm hub folder (``config.json`` with ``architecture`` + ``model.safetensors``,
    as ``mpp export --format timm`` writes), else (None, {}): one of our run directories too."""
    cfg = path / "config.json"
    config = json.loads(cfg.read_text()) if cfg.is_file() else {}
    if config.get("model_type") == "vit":
        return "hf", config
    if "architecture" in config and (path / "model.safetensors").is_file():
        return "timm", config
    return None, {}


def _existing(init: str | Path) -> Path:
    path = Path(init)
    if not path.exists():
        raise FileNotFoundError(f"{init}: no such file or directory")
    if path.is_file() and path.suffix not in RELEASE_SUFFIXES + (".safetensors",):
        raise ValueError(
            f"{init}: unknown kind (expected .safetensors, .pth, a run directory, a Hugging Face "
            "or timm folder, or a DeepSpeed checkpoint)"
        )
    return path


def _no_weights(path: Path) -> str:
    results = path / "results.json"
    if results.is_file() and "eval" in (done := json.loads(results.read_text())):
        return (
            f"{path}: a {done['eval']} evaluation run keeps no weights (it read {done.get('init')})"
        )
    return f"{path}: neither encoder.safetensors nor a DeepSpeed checkpoint found there"


def _run_beside(folder: Path) -> Path | None:
    """The run directory an encoder file sits in (its config.json, not a hub folder's)."""
    if (folder / "config.json").is_file() and folder_kind(folder)[0] is None:
        return folder
    return None


def _run_pixels(run_dir: Path) -> dict:
    """What a run states it trained on: its data.json, else its config.json's numbers."""
    return _stated(run_pixels(run_dir) or {})


def _stated(record: dict, keys: tuple[str, ...] = PIXEL_FACTS) -> dict:
    """The pixel facts ``record`` holds, as the data section types them (tuples)."""
    out = {}
    for key in keys:
        if key in record:
            value = record[key]
            out[key] = tuple(float(v) for v in value) if isinstance(value, list) else value
    return out


def _hf_pixels(folder: Path) -> dict:
    """A Hugging Face folder's ``preprocessor_config.json``: its mean and std, and the value range
    its rescale factor maps to [0, 1] (none for 8-bit's 1/255)."""
    path = folder / HF_PROCESSOR
    processor = json.loads(path.read_text()) if path.is_file() else {}
    pixels = {}
    if processor.get("do_normalize", True) and "image_mean" in processor:
        pixels = _stated({"mean": processor["image_mean"], "std": processor["image_std"]})
    factor = processor.get("rescale_factor", 1 / 255) if processor.get("do_rescale", True) else 0
    if factor and not math.isclose(factor, 1 / 255):
        pixels["value_range"] = (0.0, round(1 / factor, 6))
    return pixels


def run_model_kwargs(run_dir: Path) -> dict:
    """The encoder a run built: its model.json, else (a run from before model.json) its
    config.json's model section; {} when it has neither."""
    if (run_dir / MODEL_FILE).is_file():
        model = json.loads((run_dir / MODEL_FILE).read_text())
    elif (run_dir / "config.json").is_file():
        model = json.loads((run_dir / "config.json").read_text()).get("model", {})
    else:
        return {}
    # not init, grad_checkpointing
    architecture = {"name", *inspect.signature(VisionTransformer).parameters}
    return {k: v for k, v in model.items() if v is not None and k in architecture}


# timm VisionTransformer arguments that only change training (dropout rates), and those whose
# timm default is the only value our ViT has
_TIMM_TRAINING_ARGS = (
    "drop_rate",
    "pos_drop_rate",
    "patch_drop_rate",
    "proj_drop_rate",
    "attn_drop_rate",
    "drop_path_rate",
)
_TIMM_FIXED_ARGS = {
    "class_token": True,
    "reg_tokens": 0,
    "no_embed_class": False,
    "pre_norm": False,
    "qk_norm": False,
    "init_values": None,
    "dynamic_img_size": False,
    "act_layer": None,
    "norm_layer": None,
}


def timm_model_kwargs(config: dict) -> dict:
    """A timm hub ``config.json`` (``mpp.hub.export``'s or timm's) -> our model kwargs: the
    variant from ``architecture`` and its ``model_args``; an argument our ViT cannot follow is an
    error naming it."""
    args = dict(config.get("model_args") or {})
    for key, value in args.items():
        if key in _TIMM_FIXED_ARGS and value != _TIMM_FIXED_ARGS[key]:
            raise ValueError(
                f"timm model_args {key}={value!r}: our ViT supports only {_TIMM_FIXED_ARGS[key]!r}"
            )
    if args.pop("fc_norm", None) not in (None, args.get("global_pool") == "avg"):
        raise ValueError(
            f"timm model_args fc_norm={config['model_args']['fc_norm']!r} with global_pool="
            f"{args.get('global_pool')!r}: ours normalises after pooling exactly when it averages"
        )
    kwargs = {
        k: v for k, v in args.items() if k not in _TIMM_FIXED_ARGS and k not in _TIMM_TRAINING_ARGS
    }
    name = str(config.get("architecture", "")).split(".")[0]  # "vit_base_patch16_224.augreg_in21k"
    try:
        vit_config(name)
    except ValueError:
        if not {"img_size", "patch_size"} <= kwargs.keys():
            return {}
        side = kwargs["img_size"] if isinstance(kwargs["img_size"], int) else kwargs["img_size"][0]
        name = f"vit_base_patch{kwargs['patch_size']}_{side}"
    if not kwargs.get("num_classes"):
        kwargs.pop("num_classes", None), kwargs.pop("global_pool", None)
    return {"name": name, **kwargs}


def differs(a: Any, b: Any) -> bool:
    """Two stated values (numbers, tuples of numbers, None) that are not the same."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(differs(x, y) for x, y in zip(a, b, strict=True))
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    return not math.isclose(a, b, rel_tol=1e-9) if numbers else a != b


def adopt_architecture(
    source: WeightSource, name: str, given: dict, keys: tuple[str, ...], setting: str | None
) -> dict:
    """The ``keys`` of the architecture ``source`` states (its variant's included) where
    ``given`` (what the caller set) leaves them unset; where the variant ``name`` implies another
    image or patch size, one line says so (``setting``: what the caller calls the key,
    ``"model.{key}"``; None: quiet)."""
    try:
        implied = vit_config(name)
    except ValueError:  # named by create_vit, as a model error
        implied = {}
    adopted, architecture = {}, source.architecture
    for key in keys:
        if given.get(key) is not None or architecture.get(key) is None:
            continue
        adopted[key] = stated = architecture[key]
        said = setting is not None and os.environ.get("RANK", "0") == "0"
        if said and key in ("img_size", "patch_size") and differs(implied.get(key, stated), stated):
            set_as = setting.format(key=key)
            log.info(
                "%s %s from %s (%s implies %s; set %s to choose)",
                set_as,
                stated,
                source.init,
                name,
                implied[key],
                set_as,
            )
    return adopted


def pretrained_cfg(source: WeightSource, model: VisionTransformer) -> dict:
    """What ``model``, built from ``source``, expects as input, as timm's ``pretrained_cfg``
    names it: ``input_size`` (C, H, W), and the ``mean``, ``std`` (and ``value_range``, ours:
    what maps to [0, 1]) its weights were trained on, where ``source`` states them and the model
    takes the channels they describe."""
    chans, (h, w) = model.patch_embed.in_chans, model.patch_embed.img_size
    cfg = {"input_size": (chans, h, w), "interpolation": "bicubic"}
    if source.channels in (None, chans):
        cfg |= {k: v for k, v in source.pixels.items() if v is not None}
    return cfg
