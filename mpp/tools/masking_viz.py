"""Draw a few masks of every strategy over a real image:
``mpp masks --out masks.png [--grid 14] [--ratio 0.75] [--samples 4]``.

One row per strategy, masked patches greyed out. The image is scikit-learn's bundled
``china.jpg`` photo (no download), centre-cropped to a square.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from PIL import Image, ImageDraw

from mpp.masking import MASKING_CONFIGS, build_mask_generator, num_masked
from mpp.objectives.hpm_mask import HardPatchMask
from mpp.ops import patchify

GREY = 128
LABEL_WIDTH = 260


def load_image(size: int) -> np.ndarray:
    """A (size, size, 3) uint8 photo: sklearn's sample image, centre-cropped and resized."""
    from sklearn.datasets import load_sample_image

    img = load_sample_image("china.jpg")
    h, w = img.shape[:2]
    s = min(h, w)
    img = img[(h - s) // 2 : (h - s) // 2 + s, (w - s) // 2 : (w - s) // 2 + s]
    return np.array(Image.fromarray(img).resize((size, size), Image.BICUBIC))


def grey_out(image: np.ndarray, mask: torch.Tensor, grid: int) -> np.ndarray:
    """image (S, S, 3) uint8 with the patches where mask (grid*grid,) is True set to grey."""
    patch = image.shape[0] // grid
    pixel_mask = (
        mask.view(grid, grid).repeat_interleave(patch, 0).repeat_interleave(patch, 1).numpy()
    )
    out = image.copy()
    out[pixel_mask] = GREY
    return out


def patch_scores(image: np.ndarray, grid: int) -> torch.Tensor:
    """A stand-in for HPM's predicted loss: each patch's pixel std (texture is hard)."""
    x = torch.from_numpy(image).float().permute(2, 0, 1)[None]  # (1, 3, S, S)
    return patchify(x, image.shape[0] // grid).std(-1)  # (1, N)


def strategy_rows(grid: int, ratio: float) -> list[tuple[str, str, dict]]:
    """(label, strategy, params) per row; units picks the reachable ratio nearest ``ratio``."""
    unit = 2 if grid % 2 == 0 else 1
    n_units = (grid // unit) ** 2
    unit_ratio = round(ratio * n_units) / n_units
    rows = [
        ("random", "random", {}),
        ("block (BEiT, exact)", "block", {}),
        ("grid (fixed)", "grid", {}),
        ("grid (offset per cell)", "grid", {"offset": "cell"}),
        ("center, jitter 2", "center", {"jitter": 2.0}),
        (
            f"units {unit}x{unit}, ratio {unit_ratio:.3f}",
            "units",
            {"unit_size": unit, "ratio": unit_ratio},
        ),
        ("hpm, hard 0.5 (std scores)", "hpm", {"hard_ratio": 0.5}),
    ]
    return [row for row in rows if row[1] != "grid" or ratio == 0.75]  # grid only does 0.75


def render(
    grid: int = 14, ratio: float = 0.75, samples: int = 4, patch: int = 16, seed: int = 0
) -> Image.Image:
    size = grid * patch
    image = load_image(size)
    scores = patch_scores(image, grid)
    rows = strategy_rows(grid, ratio)
    sheet = Image.new("RGB", (LABEL_WIDTH + samples * (size + 4), len(rows) * (size + 4)), "white")
    draw = ImageDraw.Draw(sheet)
    generator = torch.Generator().manual_seed(seed)
    for r, (label, strategy, params) in enumerate(rows):
        params = dict(params)
        row_ratio = params.pop("ratio", ratio)
        if strategy == "hpm":  # HPM's own policy, fed the stand-in scores
            gen = HardPatchMask((grid, grid), row_ratio, **params)
        else:
            gen = build_mask_generator(strategy, (grid, grid), row_ratio, **params)
        extra = {"scores": scores.expand(samples, -1)} if strategy == "hpm" else {}
        masks = gen(samples, "cpu", generator, **extra)
        y = r * (size + 4)
        count = num_masked(grid * grid, row_ratio)
        draw.text((8, y + size // 2 - 8), f"{label}\n{count}/{grid * grid} masked", fill="black")
        for s in range(samples):
            tile = Image.fromarray(grey_out(image, masks[s], grid))
            sheet.paste(tile, (LABEL_WIDTH + s * (size + 4), y))
    return sheet


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="masks.png", help="PNG file to write")
    parser.add_argument(
        "--grid", type=int, default=14, help="patches per side (14 = ViT-B/16 at 224)"
    )
    parser.add_argument("--ratio", type=float, default=0.75)
    parser.add_argument("--samples", type=int, default=4, help="masks per strategy")
    parser.add_argument("--patch", type=int, default=16, help="pixels per patch in the picture")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    render(args.grid, args.ratio, args.samples, args.patch, args.seed).save(args.out)
    names = [*sorted(MASKING_CONFIGS), "hpm"]
    print(f"wrote {args.out}: {names} on a {args.grid}x{args.grid} grid")


if __name__ == "__main__":
    main()
