"""decode: what one decode worker feeds, per JPEG size and path (issue 36 §3).

Per-worker images/s of the training transform on one core (RandomResizedCrop to 224 + flip, as a
loader worker runs it) for 256-px and ~500 x 375 JPEGs (ImageNet's typical size): the CPU path
(PIL, with its JPEG draft: big crops decoded at 1/2..1/8 scale), PIL without the draft (what the
draft saves), simplejpeg where installed, and the worker's share under ``data.decode=gpu`` (the
header parsed, the box drawn: no pixels). With CUDA, the training process's side too: torchvision's
batched nvJPEG decode and the crops of a 256-image batch, in images/s and GPU ms per batch.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

from benchmarks.common import format_table, median, num_threads

IMG_SIZE = 224
SOURCES = {"256px": (256, 256), "500x375": (500, 375)}
SETTINGS = {
    "full": dict(images=64, rounds=5, batch=256),
    "quick": dict(images=8, rounds=2, batch=8),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--img-size", type=int, default=IMG_SIZE, help="the crop's side (default 224)")


def photos(size: tuple[int, int], n: int) -> list[bytes]:
    """``n`` photo-like JPEGs at ``size`` (the data suite's: smooth colour fields plus grain)."""
    from benchmarks.data_timing import synthetic_jpegs

    return synthetic_jpegs(n, *size)


def paths(img_size: int) -> dict[str, Callable[[bytes, random.Random], Any]]:
    """Each way a worker can turn one encoded image into the training crop (or its deferral)."""
    from mpp.data.transforms import (
        Augmentation,
        open_image,
        random_resized_crop_box,
        train_transform,
    )

    aug = Augmentation()

    def no_draft(data: bytes, rng: random.Random) -> np.ndarray:
        img = open_image(data)
        box = random_resized_crop_box(*img.size, rng, aug.scale, aug.ratio)
        out = np.asarray(img.convert("RGB").resize((img_size,) * 2, Image.BICUBIC, box=box))
        return out[:, ::-1] if rng.random() < aug.hflip else out

    ways: dict[str, Callable] = {
        "cpu (PIL, draft)": lambda data, rng: train_transform(data, img_size, rng),
        "cpu (PIL, no draft)": no_draft,
        "gpu: worker's share": lambda data, rng: train_transform(
            data, img_size, rng, defer_jpeg=True
        ),
    }
    try:
        import simplejpeg
    except ImportError:
        return ways

    def simple(data: bytes, rng: random.Random) -> np.ndarray:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        box = random_resized_crop_box(width, height, rng, aug.scale, aug.ratio)
        # a full decode (its DCT downscale, min_height/min_width, is not asked for)
        array = simplejpeg.decode_jpeg(data, colorspace="RGB")
        out = np.asarray(Image.fromarray(array).resize((img_size,) * 2, Image.BICUBIC, box=box))
        return out[:, ::-1] if rng.random() < aug.hflip else out

    ways["cpu (simplejpeg)"] = simple
    return ways


def worker_rates(files: list[bytes], rounds: int, img_size: int) -> dict[str, float]:
    """Images/s of each path on one thread: median over ``rounds`` passes, interleaved."""
    ways = paths(img_size)
    times: dict[str, list[float]] = {name: [] for name in ways}
    with num_threads(1):
        for r in range(rounds + 1):
            for name, fn in ways.items():
                start = time.perf_counter()
                for i, data in enumerate(files):
                    fn(data, random.Random(i))
                if r:  # the first pass warms the caches
                    times[name].append(time.perf_counter() - start)
    return {name: len(files) / median(ts) for name, ts in times.items()}


def gpu_rates(files: list[bytes], batch: int, rounds: int, img_size: int) -> dict[str, float]:
    """The training process's side of ``data.decode=gpu`` on CUDA: one batch's nvJPEG decode and
    crops, GPU-synchronised, median of ``rounds``."""
    from mpp.data import device_decode
    from mpp.data.transforms import collate, train_transform

    device = torch.device("cuda")
    why_not = device_decode.nvjpeg_refusal(device)
    if why_not:
        return {"refused": why_not}
    samples = [
        train_transform(files[i % len(files)], img_size, random.Random(i), defer_jpeg=True)
        for i in range(batch)
    ]
    cpu_batch = collate([(s, None, "") for s in samples], img_size=img_size)
    decode = device_decode.nvjpeg(device)
    times = []
    for r in range(rounds + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        device_decode.fill_deferred(None, cpu_batch["deferred"], decode, device)
        torch.cuda.synchronize()
        if r:
            times.append(time.perf_counter() - start)
    t = median(times)
    return {"imgs_per_sec": batch / t, "ms_per_batch": 1e3 * t, "batch": batch}


def run(quick: bool = False, img_size: int = IMG_SIZE) -> dict[str, Any]:
    s = SETTINGS["quick" if quick else "full"]
    rows = []
    for source, size in SOURCES.items():
        files = photos(size, s["images"])
        kib = sum(len(f) for f in files) / len(files) / 1024
        row: dict[str, Any] = {"source": source, "kib": kib}
        row.update(worker_rates(files, s["rounds"], img_size))
        if torch.cuda.is_available():
            row["gpu"] = gpu_rates(files, s["batch"], s["rounds"], img_size)
        rows.append(row)
    setting = {**s, "img_size": img_size, "cuda": torch.cuda.is_available()}
    return {"setting": setting, "rows": rows}


def render(result: dict[str, Any]) -> str:
    rows = result["rows"]
    ways = [k for k in rows[0] if k not in ("source", "kib", "gpu")]
    table = format_table(
        rows,
        [("source", "JPEG", ""), ("kib", "KiB", ".0f")] + [(w, f"{w} img/s", ".0f") for w in ways],
    )
    head = f"per decode worker (one thread), RandomResizedCrop to {result['setting']['img_size']}"
    gpu = [r for r in rows if "gpu" in r]
    if not gpu:
        return head + "\n" + table
    gpu_rows = [{"source": r["source"], **r["gpu"]} for r in gpu]
    keys = sorted({k for r in gpu_rows for k in r} - {"source"})
    return (
        head
        + "\n"
        + table
        + "\n\nnvJPEG in the training process (data.decode=gpu)\n"
        + format_table(gpu_rows, [("source", "JPEG", "")] + [(k, k, "") for k in keys])
    )
