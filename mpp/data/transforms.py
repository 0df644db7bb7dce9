"""CPU image transforms in PIL (no torchvision): decode with JPEG draft, RandomResizedCrop, flip,
eval resize + center crop; uint8 collation (normalised on the device: ``mpp.ops.normalize``).
"""

from __future__ import annotations

import io
import math
import random

import numpy as np
import torch
from PIL import Image

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
EVAL_CROP_PCT = (
    0.875  # resize the short side to img_size / 0.875, then center crop (timm's default)
)

Box = tuple[float, float, float, float]  # (left, upper, right, lower) in source pixels


def open_image(data: bytes) -> Image.Image:
    """Parse the header only; pixels are decoded later, after `draft`."""
    return Image.open(io.BytesIO(data))


def random_resized_crop_box(
    width: int, height: int, rng: random.Random, scale=(0.2, 1.0), ratio=(3 / 4, 4 / 3)
) -> Box:
    """torchvision's RandomResizedCrop.get_params: 10 tries at a random area/aspect, else center."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = rng.randint(0, height - h)
            left = rng.randint(0, width - w)
            return (left, top, left + w, top + h)
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        w, h = round(height * max(ratio)), height
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return (left, top, left + w, top + h)


def center_crop_box(width: int, height: int, img_size: int, crop_pct: float = EVAL_CROP_PCT) -> Box:
    """The source region that resize(short side -> img_size / crop_pct) + center crop keeps."""
    short = math.floor(img_size / crop_pct)
    factor = short / min(width, height)  # resized pixels per source pixel
    new_w, new_h = round(width * factor), round(height * factor)
    left, top = (new_w - img_size) / 2, (new_h - img_size) / 2
    # round the crop offset in resized pixels as torchvision's CenterCrop does, then map back
    left, top = round(left), round(top)
    sx, sy = width / new_w, height / new_h
    return (left * sx, top * sy, (left + img_size) * sx, (top + img_size) * sy)


def crop_resize(img: Image.Image, box: Box, img_size: int) -> np.ndarray:
    """Decode only as much as needed (JPEG draft), then one bicubic resize of `box` -> (S, S, 3)."""
    width, height = img.size
    crop_w, crop_h = box[2] - box[0], box[3] - box[1]
    if img.format == "JPEG":
        # DCT-domain downscale by 1/2, 1/4 or 1/8 while the crop stays >= img_size: decode cost
        # drops with the square of the factor and the result is at least as sharp.
        want = (math.ceil(width * img_size / crop_w), math.ceil(height * img_size / crop_h))
        img.draft("RGB", want)
        if img.size != (width, height):
            sx, sy = img.size[0] / width, img.size[1] / height
            box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    if img.mode not in ("RGB", "L"):
        img = img.convert("RGB")
    out = img.resize((img_size, img_size), Image.Resampling.BICUBIC, box=box)
    if out.mode == "L":
        out = out.convert("RGB")  # after the resize: a third of the pixels to resample
    return np.asarray(out)


def train_transform(
    data: bytes,
    img_size: int,
    rng: random.Random,
    scale=(0.2, 1.0),
    ratio=(3 / 4, 4 / 3),
    hflip: float = 0.5,
    randaug: tuple[int, int] | None = None,
) -> np.ndarray:
    """Encoded bytes -> RandomResizedCrop (bicubic) + horizontal flip [+ RandAugment(n, m)]
    -> (S, S, 3) uint8 view."""
    img = open_image(data)
    box = random_resized_crop_box(*img.size, rng, scale, ratio)
    flip = rng.random() < hflip
    array = crop_resize(img, box, img_size)
    if randaug is not None and randaug[0] > 0:
        from .randaug import rand_augment

        array = np.asarray(
            rand_augment(Image.fromarray(np.ascontiguousarray(array)), rng, *randaug)
        )
    return array[:, ::-1] if flip else array  # a view: the copy into the batch does the flip


def eval_transform(data: bytes, img_size: int, rng: random.Random | None = None) -> np.ndarray:
    """Encoded bytes -> resize short side to img_size / 0.875 (bicubic) + center crop -> (S, S, 3)."""
    img = open_image(data)
    return crop_resize(img, center_crop_box(*img.size, img_size), img_size)


def collate(samples: list[tuple[np.ndarray, int | None, str]], with_keys: bool = False) -> dict:
    """List of (HWC uint8 array, label, key) -> {"image": (B,3,H,W) uint8 contiguous, "label": (B,)}."""
    h, w, _ = samples[0][0].shape
    images = torch.empty((len(samples), 3, h, w), dtype=torch.uint8)
    out = images.numpy()
    for i, (array, _, _) in enumerate(samples):
        out[i] = array.transpose(2, 0, 1)  # the one copy per image: HWC (maybe flipped) -> CHW
    batch = {"image": images}
    if samples[0][1] is not None:
        batch["label"] = torch.tensor([s[1] for s in samples], dtype=torch.int64)
    if with_keys:
        batch["key"] = [s[2] for s in samples]
    return batch
