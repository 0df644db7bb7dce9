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
    folder, MAE's release ``.pth``): its width, depth and heads as the weights state them (a run's
    ``vit_tiny`` of depth 4 stays that), the position embedding resampled to the size, RGB
    weights adapted to ``in_chans``, a fresh head. In eval mode."""
    from mpp.hub.pretrained import load_into, read_model_kwargs
    from mpp.models.vit import create_vit

    stated = read_model_kwargs(pretrained) if pretrained is not None else {}
    head = {"name", "img_size", "num_classes", "global_pool", "in_chans", "drop_path_rate"}
    architecture = {k: v for k, v in stated.items() if k not in head}
    model = create_vit(name, **{**architecture, **overrides})
    if pretrained is not None:
        load_into(model, pretrained)
    return model.eval()


def load_encoder(source: str | Path) -> nn.Module:
    """The encoder ``source`` holds, built as the file states it (a pretraining or fine-tuning
    run, its checkpoints, an exported ``.safetensors``, a timm or Hugging Face folder): a ready
    ``VisionTransformer`` with ``forward_features``, its head if it was fine-tuned, in eval mode."""
    from mpp.hub.pretrained import load_pretrained
    from mpp.models.vit import create_vit

    weights, kwargs = load_pretrained(source)
    if "name" not in kwargs:
        raise ValueError(
            f"{source}: its weights state no architecture; use create_model(name, pretrained=...)"
        )
    model = create_vit(**kwargs)
    model.load_state_dict(weights)
    return model.eval()


def _argv(
    config: str | Path,
    output_dir: str | Path | None,
    overrides: dict[str, Any] | list[str] | None,
    sections: dict[str, dict[str, Any]],
) -> list[str]:
    """The CLI's arguments: ``--set`` from ``overrides`` ({"train.max_steps": 50} or
    ["train.max_steps=50"]) and from whole sections (``train={"max_steps": 50}``)."""
    items = list(overrides) if isinstance(overrides, list) else []
    flat = dict(overrides) if isinstance(overrides, dict) else {}
    for section, values in sections.items():
        if not isinstance(values, dict):
            raise TypeError(
                f"{section}=...: a section's keys as a dict (e.g. train={{'max_steps': 50}})"
            )
        flat |= {f"{section}.{k}": v for k, v in values.items()}
    items += [f"{k}={json.dumps(v)}" for k, v in flat.items()]
    argv = ["--config", str(config), *[a for item in items for a in ("--set", item)]]
    return argv + (["--output-dir", str(output_dir)] if output_dir is not None else [])


def _run_dir(argv: list[str], kind: type) -> Path:
    from mpp.cli import run_dir_of
    from mpp.config import load_config

    config, sets = argv[1], [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    cfg = load_config(config, sets, cls=kind)
    if "--output-dir" in argv:
        return Path(argv[argv.index("--output-dir") + 1])
    return run_dir_of(cfg)


def pretrain(
    config: str | Path,
    output_dir: str | Path | None = None,
    *,
    resume: str | None = None,
    restart: bool = False,
    overrides: dict[str, Any] | list[str] | None = None,
    **sections: dict[str, Any],
) -> Path:
    """Pretrain in this process (``pretrain/run.py`` without a launcher): a config name or file,
    overrides, and the run directory it returns (``encoder.safetensors``, ``metrics.jsonl``).
    A bad config raises ``mpp.config.ConfigError`` naming the key; a failed run RuntimeError."""
    from mpp.commands.pretrain import main
    from mpp.config import Config

    argv = _argv(config, output_dir, overrides, sections) + _start(resume, restart)
    run_dir = _run_dir(argv, Config)
    _check(main(argv), "pretrain", run_dir)
    return run_dir


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
    """Fine-tune in this process (``downstream/finetune.py`` without a launcher) from ``init`` (a
    run, a file, or "scratch"; default: the config's); its ``results.json`` (top-1 of the last
    evaluation, ``max_top1``, ...) with ``run_dir``."""
    from mpp.commands.finetune import main
    from mpp.config import FinetuneConfig

    extra = {"init": str(init)} if init is not None else {}
    if isinstance(overrides, list):
        overrides = [*overrides, *[f"{k}={json.dumps(v)}" for k, v in extra.items()]]
    else:
        overrides = {**(overrides or {}), **extra}
    argv = _argv(config, output_dir, overrides, sections) + _start(resume, restart)
    run_dir = _run_dir(argv, FinetuneConfig)
    _check(main(argv), "finetune", run_dir)
    return {**json.loads((run_dir / "results.json").read_text()), "run_dir": str(run_dir)}


def _start(resume: str | None, restart: bool) -> list[str]:
    """The CLI's flags for where a run starts: by default a run directory that holds a
    checkpoint goes on from it; ``restart`` moves what is there aside and starts over."""
    if resume and restart:
        raise ValueError("resume and restart: choose one (restart moves the earlier run aside)")
    return (["--resume", resume] if resume else []) + (["--restart"] if restart else [])


def _check(code: int, what: str, run_dir: Path) -> None:
    from mpp.config import ConfigError

    if code == 2:
        raise ConfigError(
            f"{what}: the config or its data was refused (the error above); nothing ran in {run_dir}"
        )
    if code != 0:
        raise RuntimeError(f"{what} stopped with exit status {code}; see {run_dir}")
