"""The exported encoder file, ``encoder.safetensors`` (fp32, timm names, the architecture in its
metadata), and the atomic safetensors writer the other weight files share (docs/ARCHITECTURE.md
§4.9)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mpp.checkpoint.storage import CheckpointError
from mpp.data.stats import run_pixels

# in a run directory, beside config.json (which stays as loaded): the encoder the run built, as
# this file's metadata states it (mpp.checkpoint.manager.encoder_kwargs)
MODEL_FILE = "model.json"


def export_encoder(
    state_dict: dict[str, torch.Tensor],
    model_kwargs: dict,
    path: str | Path,
    prefix: str = "encoder.",
) -> None:
    """The encoder's fp32 weights with their architecture, and the pixels of the run it is
    written into (its data.json), so the file alone says what it was trained on."""
    enc = {k[len(prefix) :]: v.float() for k, v in state_dict.items() if k.startswith(prefix)}
    if not enc:
        raise ValueError(f"no '{prefix}*' weights in the state dict")
    save_weights(enc, path, encoder_metadata(model_kwargs, run_pixels(Path(path).parent)))


def encoder_metadata(model_kwargs: dict, pixels: dict | None) -> dict:
    """An ``encoder.safetensors``'s metadata: the architecture, and the mean, std and value
    range it was trained on when known (as timm's ``pretrained_cfg`` carries them)."""
    meta = {"format": "mpp-encoder", "model": model_kwargs}
    return meta | ({"data": pixels} if pixels else {})


def encoder_file_metadata(path: str | Path) -> dict:
    """An exported ``encoder.safetensors``'s metadata, each value decoded ({"model": ..., "data":
    ...}; {} for a file that states none), read without its tensors."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:  # a truncated copy, or not a weights file
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    out = {}
    for key in ("model", "data"):
        try:
            out[key] = json.loads(meta[key]) if key in meta else {}
        except ValueError:
            out[key] = {}  # another tool's metadata under the same name
    return out


def load_encoder_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, model kwargs) from an exported ``encoder.safetensors`` (no unpickling)."""
    from safetensors import SafetensorError

    kwargs = encoder_file_metadata(path)["model"]
    try:
        return load_file(str(path)), kwargs
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def user_umask() -> int:
    """This process's umask, read without setting it (a set would race other threads' files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def save_weights(
    state_dict: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None
) -> None:
    """A safetensors file written atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    meta = {k: json.dumps(v) for k, v in (metadata or {}).items()}
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp), metadata=meta)
    os.chmod(tmp, 0o666 & ~user_umask())  # safetensors writes 0600: the user's usual mode
    os.replace(tmp, path)
