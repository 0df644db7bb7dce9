"""CPU transforms and the device normalise (mpp/data/transforms.py)."""

import io
import math
import random

import numpy as np
import pytest
import torch
from PIL import Image

from mpp.data.transforms import (
    Augmentation,
    center_crop_box,
    collate,
    crop_resize,
    eval_transform,
    random_resized_crop_box,
    train_transform,
)
from mpp.ops import IMAGENET_MEAN, IMAGENET_STD, normalize


def smooth_image(w: int, h: int, seed: int = 0) -> Image.Image:
    coarse = np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC)


def encode(img: Image.Image, fmt: str = "JPEG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def test_random_resized_crop_box_respects_scale_and_ratio():
    rng = random.Random(0)
    scale, ratio = (0.2, 1.0), (3 / 4, 4 / 3)
    areas = []
    for _ in range(2000):
        left, top, right, bottom = random_resized_crop_box(500, 375, rng, scale, ratio)
        w, h = right - left, bottom - top
        assert 0 <= left and 0 <= top and right <= 500 and bottom <= 375
        areas.append(w * h / (500 * 375))
        assert 0.19 <= areas[-1] <= 1.0 and 3 / 4 - 0.02 <= w / h <= 4 / 3 + 0.02
    assert (
        0.45 < np.mean(areas) < 0.6
    )  # uniform in [0.2, 1] (mean 0.6) minus rejected large, off-aspect crops
    # a very wide image falls back to the widest allowed center crop
    assert random_resized_crop_box(1000, 10, random.Random(0), (0.99, 1.0), (1.0, 1.0)) == (
        495,
        0,
        505,
        10,
    )


def test_center_crop_box_matches_resize_then_crop():
    # 500x375 at 224: short side -> 256, width -> 341, crop 224 from offset round(58.5) = 58
    left, top, right, bottom = center_crop_box(500, 375, 224)
    factor = 375 / 256
    assert math.isclose(bottom - top, 224 * factor, rel_tol=1e-3) and math.isclose(
        left, 58 * 500 / 341
    )
    img = smooth_image(500, 375)
    two_step = img.resize((341, 256), Image.Resampling.BICUBIC).crop((58, 16, 282, 240))
    one_step = eval_transform(encode(img, "PNG"), 224)
    assert one_step.shape == (224, 224, 3)
    assert np.abs(one_step.astype(int) - np.asarray(two_step, dtype=int)).mean() < 1.5


def test_jpeg_draft_matches_full_decode():
    img = smooth_image(1600, 1200)
    data = encode(img)
    small = crop_resize(
        Image.open(io.BytesIO(data)), (0, 0, 1600, 1200), 32
    )  # decoded at 1/8 scale
    full = np.asarray(img.resize((32, 32), Image.Resampling.BICUBIC))
    assert small.shape == (32, 32, 3) and np.abs(small.astype(int) - full.astype(int)).mean() < 4


def test_flip_mirrors_the_same_crop():
    data = encode(smooth_image(64, 48))
    plain = train_transform(data, 16, random.Random(3), Augmentation(hflip=0.0))
    flipped = train_transform(data, 16, random.Random(3), Augmentation(hflip=1.0))
    assert np.array_equal(flipped, plain[:, ::-1]) and not np.array_equal(flipped, plain)


@pytest.mark.parametrize(
    "mode, fmt", [("L", "JPEG"), ("P", "PNG"), ("RGBA", "PNG"), ("RGB", "WEBP")]
)
def test_any_mode_becomes_rgb(mode, fmt):
    data = encode(smooth_image(40, 30).convert(mode), fmt)
    assert train_transform(data, 16, random.Random(0)).shape == (16, 16, 3)
    assert eval_transform(data, 16).shape == (16, 16, 3)


def test_collate_builds_contiguous_nchw_uint8():
    arrays = [np.full((4, 4, 3), i, np.uint8) for i in range(3)]
    arrays[1][:, 0] = [7, 8, 9]
    batch = collate([(a, i, f"k{i}") for i, a in enumerate(arrays)], with_keys=True)
    assert batch["image"].shape == (3, 3, 4, 4) and batch["image"].is_contiguous()
    assert batch["image"][1, :, 2, 0].tolist() == [7, 8, 9] and batch["label"].tolist() == [0, 1, 2]
    assert batch["key"] == ["k0", "k1", "k2"]


def test_normalize_formula_and_input_untouched():
    images = torch.tensor([0, 128, 255], dtype=torch.uint8).view(1, 3, 1, 1).expand(2, 3, 2, 2)
    out = normalize(images)
    expected = [
        (v / 255 - m) / s
        for v, m, s in zip([0, 128, 255], IMAGENET_MEAN, IMAGENET_STD, strict=True)
    ]
    assert out.dtype == torch.float32 and torch.allclose(
        out[0, :, 0, 0], torch.tensor(expected), atol=1e-6
    )
    floats = torch.rand(1, 3, 2, 2) * 255
    before = floats.clone()
    normalize(floats, mean=(0.5,) * 3, std=(0.5,) * 3)
    assert torch.equal(floats, before)
    assert normalize(images, dtype=torch.bfloat16).dtype == torch.bfloat16
