"""The public functions behind ``import mpp`` (``mpp.__init__`` lists them): a model by name with
pretrained weights, an encoder from a run or a file, and pretraining or fine-tuning in this
process (a notebook, a script), the way ``lightly_train.train()`` runs: the same code as the
CLIs, one process, no launcher."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn


def create_model(name: str, pretrained: str | Path | None = None, **overrides: Any) -> nn.Module:
    """timm's ``create_model``: the ViT variant ``name`` (``vit_base_patch16_224``, ...) with
    ``overrides`` (``img_size``, ``in_chans``, ``num_classes``, ``global_pool``, ...), and with
    ``pretrained`` weights loaded (a run, an exported ``.safetensors``, a timm or Hugging Face
    folder, MAE's release ``.pth``): its architecture as the weights state it (a run's
    ``vit_tiny`` of depth 4 and 64 px stays that, a grey run's stays one channel), an override
    winning (the position embedding resampled to its size, RGB weights adapted to its
    ``in_chans``), a fresh head. ``model.pretrained_cfg`` says what it expects as timm's does:
    ``input_size`` and the ``mean``, ``std`` (and ``value_range``) it was trained on. In eval
    mode."""
    from mpp.hub.pretrained import load_into
    from mpp.hub.source import adopt_architecture, pretrained_cfg, weight_source
    from mpp.models.vit import create_vit

    if pretrained is None:
        return create_vit(name, **overrides).eval()
    source = weight_source(pretrained)
    fresh = {"name", "num_classes", "drop_path_rate"}  # a new head, training's own choice
    keys = tuple(k for k in source.architecture if k not in fresh)
    stated = adopt_architecture(source, name, overrides, keys, "create_model's {key}")
    model = create_vit(name, **{**stated, **overrides})
    load_into(model, pretrained, keys={"channels": "in_chans", "img_size": "img_size"})
    model.pretrained_cfg = pretrained_cfg(source, model)
    return model.eval()


def load_encoder(source: str | Path) -> nn.Module:
    """The encoder ``source`` holds, built as the file states it (a pretraining or fine-tuning
    run, its checkpoints, an exported ``.safetensors``, a timm or Hugging Face folder): a ready
    ``VisionTransformer`` with ``forward_features``, its head if it was fine-tuned, in eval mode,
    its ``pretrained_cfg`` as ``create_model``'s."""
    from mpp.hub.pretrained import load_pretrained
    from mpp.hub.source import pretrained_cfg, weight_source
    from mpp.models.vit import create_vit

    weights, kwargs = load_pretrained(source)
    if "name" not in kwargs:
        raise ValueError(
            f"{source}: its weights state no architecture; use create_model(name, pretrained=...)"
        )
    model = create_vit(**kwargs)
    model.load_state_dict(weights)
    model.pretrained_cfg = pretrained_cfg(weight_source(source), model)
    return model.eval()


def _config(
    config: str | Path,
    kind: type,
    overrides: dict[str, Any] | list[str] | None,
    sections: dict[str, dict[str, Any]],
    given: dict[str, str | Path | None],
) -> Any:
    """The loaded config: ``overrides`` ({"train.max_steps": 50} or ["train.max_steps=50"]) and
    whole sections (``train={"max_steps": 50}``) over the file, and over them the keys ``given``
    by name (``output_dir``, ``init``) where they are not None."""
    from mpp.config import as_overrides, read_config

    flat = dict(overrides) if isinstance(overrides, dict) else {}
    for section, values in sections.items():
        if not isinstance(values, dict):
            raise TypeError(
                f"{section}=...: a section's keys as a dict (e.g. train={{'max_steps': 50}})"
            )
        flat |= {f"{section}.{k}": v for k, v in values.items()}
    flat |= {key: str(value) for key, value in given.items() if value is not None}
    items = list(overrides) if isinstance(overrides, list) else []
    return read_config(config, items + as_overrides(flat), cls=kind, given="api")


def pretrain(
    config: str | Path,
    output_dir: str | Path | None = None,
    *,
    resume: str | None = None,
    restart: bool = False,
    overrides: dict[str, Any] | list[str] | None = None,
    **sections: dict[str, Any],
) -> Path:
    """Pretrain in this process (``mpp.jobs.run_pretrain``, no launcher): a config name or file,
    overrides, and the run directory it returns (``encoder.safetensors``, ``metrics.jsonl``).
    A refused config or data raises ``mpp.config.ConfigError`` naming the key and the file; a run
    that stops raises its own error (``mpp.jobs`` lists them). The process group the run makes
    is gone when it returns; DeepSpeed's chatter stays off stdout unless MPP_VERBOSE=1."""
    from mpp.config import Config
    from mpp.jobs import run_pretrain
    from mpp.parallel.distributed import process_group_of_this_call

    cfg = _config(config, Config, overrides, sections, {"train.output_dir": output_dir})
    with process_group_of_this_call():
        return run_pretrain(cfg, resume, restart).run_dir


def finetune(
    config: str | Path,
    init: str | Path | None = None,
    output_dir: str | Path | None = None,
    *,
    resume: str | None = None,
    restart: bool = False,
    overrides: dict[str, Any] | list[str] | None = None,
    **sections: dict[str, Any],
) -> dict[str, Any]:
    """Fine-tune in this process (``mpp.jobs.run_finetune``) from ``init`` (a run, a file, or
    "scratch"; default: the config's); its ``results.json`` (top-1 of the last evaluation,
    ``max_top1``, ...) with ``run_dir``. Errors as ``pretrain``'s."""
    from mpp.config import FinetuneConfig
    from mpp.jobs import run_finetune
    from mpp.parallel.distributed import process_group_of_this_call

    given = {"init": init, "train.output_dir": output_dir}
    cfg = _config(config, FinetuneConfig, overrides, sections, given)
    with process_group_of_this_call():
        done = run_finetune(cfg, resume, restart)
    return {**json.loads((done.run_dir / "results.json").read_text()), "run_dir": str(done.run_dir)}
