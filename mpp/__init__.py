"""mpp: masked-patch pretraining of Vision Transformers (BERT-style MPP, MAE, HPM, SimMIM) under DeepSpeed
ZeRO, from WebDataset shards. The command line is ``mpp`` (``mpp --help``); the library's public
names are these, and they stay put (``tests/test_api.py`` holds them)::

    import mpp

    run = mpp.pretrain("mae_demo", output_dir="runs/mae", train={"max_steps": 50})
    encoder = mpp.load_encoder(run)                   # an nn.Module with forward_features
    tokens = encoder.forward_features(images)         # (B, 1 + N, D)
    model = mpp.create_model("vit_tiny_patch4_32", pretrained=run, num_classes=10)
    result = mpp.finetune("finetune_few_demo", init=run, output_dir="runs/ft")
    cfg = mpp.load_config("mae_b16", ["train.epochs=400"])
    objective = mpp.create_objective("hpm", mpp.create_model("vit_base_patch16_224"), base="mae")

Everything else is importable from its module (``mpp.data``, ``mpp.models``, ...) but may move.
Importing ``mpp`` is cheap: the names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mpp.quiet import hush_deepspeed_log

# before anything imports DeepSpeed: its chatter stays off stdout unless asked (mpp.quiet)
hush_deepspeed_log()

__version__ = "0.1.0"
__all__ = [
    "create_model",
    "load_encoder",
    "create_objective",
    "load_config",
    "pretrain",
    "finetune",
    "__version__",
]

# public name -> the module that defines it
_HOMES = {
    "create_model": "mpp.api",
    "load_encoder": "mpp.api",
    "pretrain": "mpp.api",
    "finetune": "mpp.api",
    "create_objective": "mpp.objectives",
    "load_config": "mpp.config",
}

if TYPE_CHECKING:
    from mpp.api import create_model, finetune, load_encoder, pretrain
    from mpp.config import load_config
    from mpp.objectives import create_objective


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mpp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
