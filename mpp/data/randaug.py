"""RandAugment on PIL images for fine-tuning (Cubuk et al. 2019; timm's ``rand-m9-mstd0.5`` op set),
no torchvision (docs/ARCHITECTURE.md §3.4)."""

from __future__ import annotations

import random

from PIL import Image, ImageEnhance, ImageOps

_MAX_LEVEL = 10.0
_FILL = (128, 128, 128)


def _signed(v: float, rng: random.Random) -> float:
    return -v if rng.random() < 0.5 else v


def _affine(slot: int, amount: float, axis: int | None = None):
    """Shear or translate: coefficient ``slot`` of the identity (1, 0, 0, 0, 1, 0) set to
    +-``amount`` m, a fraction of the image's size along ``axis`` when given (timm's translate_rel)."""

    def op(img, m, rng):
        coeffs = [1, 0, 0, 0, 1, 0]
        coeffs[slot] = _signed(amount * m, rng) * (1 if axis is None else img.size[axis])
        return img.transform(img.size, Image.Transform.AFFINE, tuple(coeffs), fillcolor=_FILL)

    return op


def _rotate(img, m, rng):
    return img.rotate(_signed(30.0 * m, rng), resample=Image.Resampling.BILINEAR, fillcolor=_FILL)


def _enhance(cls):
    def op(img, m, rng):  # factor 1 +- 0.9 m, as timm's "increasing" enhance ops
        return cls(img).enhance(max(0.1, 1.0 + _signed(0.9 * m, rng)))

    return op


def _posterize(img, m, rng):
    return ImageOps.posterize(img, max(1, 8 - int(4 * m)))


def _solarize(img, m, rng):
    return ImageOps.solarize(img, 256 - int(256 * m))


def _solarize_add(img, m, rng):
    add = int(110 * m)
    lut = [min(255, i + add) if i < 128 else i for i in range(256)] * len(img.getbands())
    return img.point(lut)


RAND_OPS = {
    "AutoContrast": lambda img, m, rng: ImageOps.autocontrast(img),
    "Equalize": lambda img, m, rng: ImageOps.equalize(img),
    "Invert": lambda img, m, rng: ImageOps.invert(img),
    "Rotate": _rotate,
    "Posterize": _posterize,
    "Solarize": _solarize,
    "SolarizeAdd": _solarize_add,
    "Color": _enhance(ImageEnhance.Color),
    "Contrast": _enhance(ImageEnhance.Contrast),
    "Brightness": _enhance(ImageEnhance.Brightness),
    "Sharpness": _enhance(ImageEnhance.Sharpness),
    "ShearX": _affine(1, 0.3),
    "ShearY": _affine(3, 0.3),
    "TranslateX": _affine(2, 0.45, axis=0),
    "TranslateY": _affine(5, 0.45, axis=1),
}


def rand_augment(
    img: Image.Image, rng: random.Random, num_ops: int = 2, magnitude: int = 9, std: float = 0.5
) -> Image.Image:
    """Apply ``num_ops`` ops drawn uniformly (with replacement), each at magnitude
    N(m, std) clipped to [0, 10] (timm's mstd0.5), each applied with probability 0.5."""
    names = list(RAND_OPS)
    for _ in range(num_ops):
        name = names[rng.randrange(len(names))]
        if rng.random() > 0.5:
            continue
        level = min(_MAX_LEVEL, max(0.0, rng.gauss(magnitude, std))) / _MAX_LEVEL
        img = RAND_OPS[name](img, level, rng)
    return img
