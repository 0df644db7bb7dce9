"""A real, tiny, offline dataset for the demo and tests: scikit-learn's 1,797 8x8 handwritten digits
upscaled to ``img_size``, 3-channel PNG shards split once with a fixed seed into 1,497 train /
300 val (8 and 4 shards), cached under ``$MPP_CACHE/digits-<size>`` (docs/ARCHITECTURE.md §8.5)."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from .sources import SIZES_FILE, _read_json
from .writer import WriterOptions, from_arrays, shard_spec, write_shards

NUM_VAL, TRAIN_SHARDS, VAL_SHARDS, SPLIT_SEED = 300, 8, 4, 0
CLASS_NAMES = [str(d) for d in range(10)]


def default_cache_root() -> Path:
    return Path(os.environ.get("MPP_CACHE") or "~/.cache/mpp").expanduser()


def _digit_images(img_size: int, resample: str) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    filt = {"bicubic": Image.Resampling.BICUBIC, "nearest": Image.Resampling.NEAREST}[resample]
    grey = np.round(digits.images * (255 / 16)).astype(np.uint8)  # values are 0..16
    images = np.stack(
        [
            np.asarray(Image.fromarray(g).resize((img_size, img_size), filt).convert("RGB"))
            for g in grey
        ]
    )  # (1797, S, S, 3)
    return images, digits.target


def _is_complete(folder: Path) -> bool:
    counts = (_read_json(str(folder / SIZES_FILE)) or {}).get("shards", {})
    return (
        sum(v for k, v in counts.items() if k.startswith("val-")) == NUM_VAL
        and len(counts) == TRAIN_SHARDS + VAL_SHARDS
        and all((folder / name).is_file() for name in counts)
    )


def _build(folder: Path, img_size: int, resample: str) -> None:
    images, labels = _digit_images(img_size, resample)
    order = np.random.RandomState(SPLIT_SEED).permutation(len(images))
    splits = {"val": (order[:NUM_VAL], VAL_SHARDS), "train": (order[NUM_VAL:], TRAIN_SHARDS)}
    for prefix, (idx, num_shards) in splits.items():
        write_shards(
            from_arrays(images[idx], labels[idx]),
            folder,
            prefix,
            options=WriterOptions(
                max_count=math.ceil(len(idx) / num_shards), seed=SPLIT_SEED, progress=False
            ),
            class_names=CLASS_NAMES,
        )


def digits_shards(
    img_size: int = 32, cache_dir: str | os.PathLike | None = None, resample: str = "bicubic"
) -> dict:
    """Build (once) and describe the digits shards: {"train": spec, "val": spec, "num_classes", ...}.

    `cache_dir` (or $MPP_CACHE) is the cache root; `resample` is "bicubic" or "nearest".
    """
    if resample not in ("bicubic", "nearest"):
        raise ValueError(f"resample must be 'bicubic' or 'nearest', got {resample!r}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    folder = root / (f"digits-{img_size}" + ("" if resample == "bicubic" else f"-{resample}"))
    if not _is_complete(folder):
        if folder.exists():
            raise RuntimeError(
                f"{folder} exists but is not a complete digits cache: delete it to rebuild"
            )
        root.mkdir(parents=True, exist_ok=True)
        # Build in a private temp folder and rename it into place: rename is atomic, so a second
        # process starting at the same time either wins the rename or finds a complete folder.
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=root))
        try:
            _build(tmp, img_size, resample)
            os.rename(tmp, folder)
        except OSError:
            if not _is_complete(folder):
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    sizes = json.loads((folder / SIZES_FILE).read_text())["shards"]
    num_val = sum(v for k, v in sizes.items() if k.startswith("val-"))
    return {
        "train": shard_spec(folder, "train", TRAIN_SHARDS),
        "val": shard_spec(folder, "val", VAL_SHARDS),
        "num_classes": len(CLASS_NAMES),
        "class_names": CLASS_NAMES,
        "num_train": sum(sizes.values()) - num_val,
        "num_val": num_val,
        "img_size": img_size,
        "dir": str(folder),
    }
