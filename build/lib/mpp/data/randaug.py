"""RandAugment on PIL images (Cubuk et al. 2019; timm's ``rand-m9-mstd0.5`` op set), for
fine-tuning. No torchvision: every op is PIL's ImageOps / ImageEnhance / affine transform."""

from __future__ import annotations

import random

from PIL import Image, ImageEnhance, ImageOps

_MAX_LEVEL = 10.0
_FILL = (128, 128, 128)


def _signed(v: float, rng: random.Random) -> float:
    return -v if rng.random() < 0.5 else v


def _shear_x(img, m, rng):
    return img.transform(
        img.size, Image.Transform.AFFINE, (1, _signed(0.3 * m, rng), 0, 0, 1, 0), fillcolor=_FILL
    )


def _shear_y(img, m, rng):
    return img.transform(
        img.size, Image.Transform.AFFINE, (1, 0, 0, _signed(0.3 * m, rng), 1, 0), fillcolor=_FILL
    )


def _translate_x(img, m, rng):  # fraction of the width, as timm's translate_rel
    return img.transform(
        img.size,
        Image.Transform.AFFINE,
        (1, 0, _signed(0.45 * m, rng) * img.size[0], 0, 1, 0),
        fillcolor=_FILL,
    )


def _translate_y(img, m, rng):
    return img.transform(
        img.size,
        Image.Transform.AFFINE,
        (1, 0, 0, 0, 1, _signed(0.45 * m, rng) * img.size[1]),
        fillcolor=_FILL,
    )


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
    "ShearX": _shear_x,
    "ShearY": _shear_y,
    "TranslateX": _translate_x,
    "TranslateY": _translate_y,
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
