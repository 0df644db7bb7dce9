"""Config -> modules: the encoder, the mask generator and the objective, in one place.

The ``objective`` section is typed (``mpp.objectives.configs``: pydantic names a bad key when
the config loads) and builds its objective, and so is ``masking`` (``mpp.masking``), which
builds the mask generator.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from mpp.checkpoint.storage import CheckpointError
from mpp.config import Config, ConfigError, source_of
from mpp.hub.pretrained import init_objective, init_record, load_into
from mpp.hub.source import PIXEL_FACTS, WeightSource, adopt_architecture, differs, weight_source
from mpp.masking import MaskGenerator
from mpp.models.vit import VisionTransformer, create_vit
from mpp.objectives import Objective
from mpp.objectives.hpm import HPMConfig

log = logging.getLogger(__name__)

# how a weights file is refused: missing, of another shape or kind, damaged (CheckpointError names it)
WEIGHTS_ERRORS = (FileNotFoundError, ValueError, CheckpointError)


def build_encoder(cfg: Any, **overrides: Any) -> VisionTransformer:
    """``cfg.model``'s encoder (plus ``overrides``, e.g. a classification head) as
    ``encoder_args`` plans it; for downstream configs with an ``init`` other than "scratch",
    its pretrained weights loaded (``mpp.hub.pretrained.load_into``). Errors are ConfigError
    naming the file and the key."""
    kwargs = encoder_args(cfg)
    try:
        encoder = create_vit(**kwargs, **overrides)
    except ValueError as e:
        raise ConfigError(f"{getattr(cfg, '_source', '<config>')}: model: {e}") from None
    encoder.set_grad_checkpointing(cfg.model.grad_checkpointing)
    init = getattr(cfg, "init", "scratch")
    if init != "scratch":
        try:
            load_into(encoder, init, cfg.model.init_chans_policy)
            read = init_record(init)
        except WEIGHTS_ERRORS as e:
            raise ConfigError(f"{source_of(cfg, 'init')}: init: {e}") from None
        if read.get("init_finished") is False and os.environ.get("RANK", "0") == "0":
            log.warning(
                "init %s: that pretraining run did not finish: this run starts from %s (step %s)",
                init,
                read["init_read"],
                read.get("init_step", "?"),
            )
    return encoder


# what a weights file can state that a variant name does not (a 64-px run of a 32-px variant); the
# others come with model.name
FILE_FACTS = ("img_size", "patch_size", "norm_eps", "qkv_bias")


def encoder_args(cfg: Any, quiet: bool = False) -> dict:
    """``create_vit``'s arguments for ``cfg``'s encoder: ``model`` as set, and where it leaves
    them unset the image and patch size, LayerNorm eps and qkv bias the weights it starts from
    state (``init``, ``model.init``; a variant that implies another size said in one line), and
    their channels unless ``data.channels`` is set (``with_init_facts``). The run's model.json
    and exported encoder state them; the config stays as loaded. A config that sets another image
    size gets the position embeddings resampled (one log line, ``load_into``); another value of
    the others fails naming both. ``quiet``: no line."""
    found = init_source(cfg)
    stated = {}
    if found is not None:
        stated = adopt_architecture(
            found[1],
            cfg.model.name,
            cfg.model.vit_kwargs(),
            FILE_FACTS,
            None if quiet else "model.{key}",
        )
    channels = with_init_facts(cfg, quiet=True).data.channels
    return {"name": cfg.model.name, "in_chans": channels, **stated, **cfg.model.vit_kwargs()}


def init_source(cfg: Any) -> tuple[str, WeightSource] | None:
    """The weights ``cfg``'s run starts from (``weight_source``) with the key that names them: a
    downstream run's ``init``, pretraining's ``model.init``; None from scratch. ConfigError names
    the key."""
    init = getattr(cfg, "init", "scratch")
    if hasattr(cfg, "init") and cfg.model.init:
        raise ConfigError(
            f"{source_of(cfg, 'model.init')}: model.init: pretraining's key; a downstream run "
            "starts from `init`"
        )
    key, weights = ("init", init) if init != "scratch" else ("model.init", cfg.model.init)
    if not weights:
        return None
    try:
        return key, weight_source(weights)
    except WEIGHTS_ERRORS as e:
        raise ConfigError(f"{source_of(cfg, key)}: {key}: {e}") from None


def with_init_facts(cfg: Any, quiet: bool = False) -> Any:
    """``cfg`` as the run reads its data: the data keys it leaves unset (``channels``, ``mean``,
    ``std``, ``value_range``) as the weights it starts from were trained on (``init_source``;
    the statistics only where the channels are the weights' own), a key it sets kept, with one
    line where the weights state another value (not ``quiet``). The config as loaded (its
    config.json) is not changed. ConfigError when a mean or std does not fit the channels."""
    found = init_source(cfg)
    if found is None:
        return cfg
    key, source = found
    d, given, stated = cfg.data, cfg.data.model_fields_set, source.facts
    update = {}
    if "channels" not in given and stated.get("channels", d.channels) != d.channels:
        update["channels"] = stated["channels"]
    channels = update.get("channels", d.channels)
    kept = []  # (key, the config's, the init's)
    for name in PIXEL_FACTS if channels == stated.get("channels") else ():
        if name not in stated or not differs(getattr(d, name), stated[name]):
            continue
        if name in given:
            kept.append((f"data.{name}", getattr(d, name), stated[name]))
        else:
            update[name] = stated[name]
    if kept and not quiet and _rank0():
        log.warning(
            "%s %s was trained with %s; this run keeps %s as set (%s); unset, they are the init's",
            key,
            source.init,
            ", ".join(f"{k} {_shown(theirs)}" for k, _, theirs in kept),
            ", ".join(f"{k} {_shown(ours)}" for k, ours, _ in kept),
            source_of(cfg, kept[0][0]),
        )
    data = d.model_copy(update=update)
    _fit_channels(cfg, data, key, source)
    return cfg.model_copy(update={"data": data}) if update else cfg


def _fit_channels(cfg: Any, data: Any, key: str, source: WeightSource) -> None:
    """The mean and std fit the channels (taken from the weights where the config leaves them
    unset); ConfigError naming the fix."""
    for name in ("mean", "std"):
        value, channels = getattr(data, name), data.channels
        if value == "auto" or len(value) == channels:
            continue
        where = f"data.channels is {channels}"
        if "channels" not in cfg.data.model_fields_set:
            where = f"{key} {source.init} takes {channels} channel(s) (data.channels unset)"
        if name not in cfg.data.model_fields_set:
            fix = "it states no statistics: set data.mean and data.std"
            fix += f' ({channels} values each, or "auto")'
        elif name in source.pixels:
            fix = f"give {channels} value(s), or leave it unset to take the init's"
        else:
            fix = f'give {channels} value(s) or "auto"'
        where_set = source_of(cfg, f"data.{name}")
        raise ConfigError(f"{where_set}: data.{name}: {len(value)} values, but {where}: {fix}")


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(f"{v:.6g}" if abs(v) >= 1 else f"{v:.4g}" for v in value) + "]"
    return "unset (8-bit)" if value is None else repr(value)


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def build_objective(cfg: Config) -> Objective:
    """The objective the trainer trains, from a validated config (``model.init`` loaded if set)."""
    source = getattr(cfg, "_source", "<config>")
    encoder = build_encoder(cfg)
    try:
        stats = pixel_stats(with_init_facts(cfg, quiet=True))
        objective = cfg.objective.build(encoder, mask_generator(cfg, encoder), stats)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except (ValueError, TypeError) as e:  # a combination only the constructor checks
        raise ConfigError(f"{source}: objective: {e}") from None
    if cfg.model.init:
        try:
            init_objective(objective, cfg.model.init, cfg.model.init_chans_policy)
        except WEIGHTS_ERRORS as e:
            raise ConfigError(f"{source_of(cfg, 'model.init')}: model.init: {e}") from None
    # the decoders too (HPM's teacher runs no-grad)
    set_grad_checkpointing(objective, cfg.model.grad_checkpointing)
    return objective


def pixel_stats(cfg: Config) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The data's mean and std; "auto" ones, measured later with the plan (``mpp.data.stats``),
    stand in as 0.5 / 0.25 per channel until ``Objective.set_pixel_stats`` gives them."""
    c = cfg.data.channels
    mean = cfg.data.mean if cfg.data.mean != "auto" else (0.5,) * c
    std = cfg.data.std if cfg.data.std != "auto" else (0.25,) * c
    return tuple(mean), tuple(std)


def mask_generator(cfg: Config, encoder: VisionTransformer) -> MaskGenerator | None:
    """``masking``'s generator at the objective's ratio; None for HPM, whose teacher masks
    (mpp.config refuses a masking section beside it)."""
    if isinstance(cfg.objective, HPMConfig):
        return None
    try:
        return cfg.masking.build(encoder.grid_size, cfg.objective.mask_ratio)
    except ValueError as e:  # what only the generator checks: grid's 0.75, units that divide
        raise ConfigError(f"masking: {e}") from None


def set_grad_checkpointing(module: Any, enable: bool) -> None:
    """``model.grad_checkpointing`` on every part of ``module`` that has the switch (timm's)."""
    for part in module.modules():
        if hasattr(part, "set_grad_checkpointing"):
            part.set_grad_checkpointing(enable)
