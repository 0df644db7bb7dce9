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
from mpp.config import Config, ConfigError, ModelConfig
from mpp.hub.pretrained import init_objective, init_record, load_into, read_model_kwargs
from mpp.masking import MaskGenerator
from mpp.models.vit import VisionTransformer, create_vit, vit_config
from mpp.objectives import Objective
from mpp.objectives.configs import HPMConfig

log = logging.getLogger(__name__)

# how a weights file is refused: missing, of another shape or kind, damaged (CheckpointError names it)
WEIGHTS_ERRORS = (FileNotFoundError, ValueError, CheckpointError)


def build_encoder(cfg: Any, **overrides: Any) -> VisionTransformer:
    """``cfg.model``'s encoder (plus ``overrides``, e.g. a classification head); for downstream
    configs with an ``init`` other than "scratch", its pretrained weights loaded
    (``mpp.hub.pretrained.load_into``). Errors are ConfigError naming the file and the key."""
    source = getattr(cfg, "_source", "<config>")
    init = getattr(cfg, "init", "scratch")
    if hasattr(cfg, "init") and cfg.model.init:
        raise ConfigError(
            f"{source}: model.init: pretraining's key; a downstream run starts from `init`"
        )
    key, weights = ("init", init) if init != "scratch" else ("model.init", cfg.model.init)
    stated = {}
    if weights:
        try:
            stated = stated_architecture(cfg.model, weights)
        except WEIGHTS_ERRORS as e:
            raise ConfigError(f"{source}: {key}: {e}") from None
    try:
        kwargs = {"in_chans": cfg.data.channels, **stated, **cfg.model.vit_kwargs()}
        encoder = create_vit(cfg.model.name, **kwargs, **overrides)
    except ValueError as e:
        raise ConfigError(f"{source}: model: {e}") from None
    encoder.set_grad_checkpointing(cfg.model.grad_checkpointing)
    if init != "scratch":
        try:
            load_into(encoder, init, cfg.model.init_chans_policy)
            read = init_record(init)
        except WEIGHTS_ERRORS as e:
            raise ConfigError(f"{source}: init: {e}") from None
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


def stated_architecture(model: ModelConfig, weights: str) -> dict:
    """The image and patch size, LayerNorm eps and qkv bias ``weights`` states (a run's
    model.json or metadata, a Hugging Face folder's layer_norm_eps) where the config leaves them
    unset: the encoder is built with them, and the run's model.json and exported encoder state
    them; the config stays as loaded. A config that sets another image size gets the position
    embeddings resampled (one log line, ``load_into``); another value of the others fails naming
    both."""
    stated = read_model_kwargs(weights)
    try:
        implied = vit_config(model.name)
    except ValueError:  # named by create_vit, as a model error
        implied = {}
    adopted = {}
    for key in FILE_FACTS:
        if getattr(model, key) is None and stated.get(key) is not None:
            adopted[key] = stated[key]
            if (
                key in implied
                and implied[key] != stated[key]
                and os.environ.get("RANK", "0") == "0"
            ):
                log.info(
                    "model.%s %s from %s (%s implies %s; set model.%s to choose)",
                    key,
                    stated[key],
                    weights,
                    model.name,
                    implied[key],
                    key,
                )
    return adopted


def build_objective(cfg: Config) -> Objective:
    """The objective the trainer trains, from a validated config (``model.init`` loaded if set)."""
    source = getattr(cfg, "_source", "<config>")
    encoder = build_encoder(cfg)
    try:
        objective = cfg.objective.build(encoder, mask_generator(cfg, encoder), pixel_stats(cfg))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except (ValueError, TypeError) as e:  # a combination only the constructor checks
        raise ConfigError(f"{source}: objective: {e}") from None
    if cfg.model.init:
        try:
            init_objective(objective, cfg.model.init, cfg.model.init_chans_policy)
        except WEIGHTS_ERRORS as e:
            raise ConfigError(f"{source}: model.init: {e}") from None
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
