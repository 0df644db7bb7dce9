"""What HPM sees: one row per image, four panels (PIL only, no plotting library).

input | mask (grey: masked at random, red: masked as hard by the teacher) |
reconstruction (visible patches from the input, masked ones predicted) | teacher's predicted loss

  python -m mpp.viz --images 8 --out grid.png                       # random init, digits
  python -m mpp.viz --config configs/hpm_demo.json --checkpoint runs/x/ckpt --out grid.png
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from PIL import Image
from torch import Tensor

from mpp.checkpoint import find_checkpoint, weights_only_loads, zero_to_fp32
from mpp.masking import hard_patch_mask
from mpp.objectives.hpm import HardPatchesMining
from mpp.objectives.mae import MaskedAutoencoder
from mpp.ops import gather_tokens, patchify, unnormalize, unpatchify

RANDOM_COLOR = (0.5, 0.5, 0.5)
HARD_COLOR = (1.0, 0.15, 0.1)
GAP = 2  # pixels between panels


def _patch_colors(classes: Tensor, bits: int) -> Tensor:
    """Colour classes (...) -> the centres of their bins (..., 3) in [0, 1]."""
    levels = 2**bits
    rgb = torch.stack([classes // levels**2, classes // levels % levels, classes % levels], dim=-1)
    return (rgb.float() + 0.5) / levels


def predicted_patches(
    base, images: Tensor, out: dict[str, Tensor], mean: tuple[float, ...], std: tuple[float, ...]
) -> Tensor:
    """The base's predictions for the masked patches (B, N_mask, P*P*C), as raw pixels in [0, 1]."""
    P = base.encoder.patch_size
    if isinstance(base, MaskedAutoencoder):
        pred = gather_tokens(out["pred"].float(), out["idx"])
        if base.norm_pix_loss:  # undo the per-patch standardisation with the true patch's stats
            true = gather_tokens(patchify(images, P).float(), out["idx"])
            mean_p, var_p = true.mean(dim=-1, keepdim=True), true.var(dim=-1, keepdim=True)
            pred = pred * (var_p + 1e-6) ** 0.5 + mean_p
        pred = rearrange(pred, "b n (pq c) -> b n pq c", c=images.shape[1])
        return (pred * images.new_tensor(std) + images.new_tensor(mean)).clamp(0, 1).flatten(2)
    if base.target == "pixel":
        return out["pred"].float().clamp(0, 1)
    num_classes = 2 ** (3 * base.bits)
    cells = 1 if base.target == "mean_color" else base.cells
    logits = out["pred"].float().reshape(*out["idx"].shape, cells, cells, num_classes)
    colors = _patch_colors(logits.argmax(-1), base.bits)  # (B, n, cells, cells, 3)
    pixels = repeat(colors, "b n i j c -> b n (i p) (j q) c", p=P // cells, q=P // cells)
    return pixels.flatten(2)


def heat_colors(values: Tensor) -> Tensor:
    """Per-row min-max scaled scores (B, N) -> black-red-yellow colours (B, N, 3)."""
    lo, hi = values.min(dim=1, keepdim=True).values, values.max(dim=1, keepdim=True).values
    v = (values - lo) / (hi - lo).clamp(min=1e-12)
    return torch.stack([(2 * v).clamp(0, 1), (2 * v - 1).clamp(0, 1), 0.15 * (1 - v)], dim=-1)


@torch.no_grad()
def hpm_panels(
    objective: HardPatchesMining, images: Tensor, num_hard: int | None = None
) -> list[Tensor]:
    """The four panels, each (B, 3, H, W) in [0, 1]. ``num_hard`` overrides the objective's k."""
    k = objective.num_hard if num_hard is None else num_hard
    base, enc = objective.base, objective.encoder
    P, grid = enc.patch_size, enc.grid_size
    scores = objective.teacher_scores(images)  # (B, N)
    mask, hard = hard_patch_mask(scores, objective.num_masked, k)
    out = base.forward_per_patch(images, mask)
    raw = unnormalize(images.float(), objective.mean, objective.std)  # (B, 3, H, W) in [0, 1]
    raw_patches = patchify(raw, P)  # (B, N, P*P*3)

    def tint(color: tuple[float, ...]) -> Tensor:  # the patches, 75 % covered by a colour
        return 0.25 * raw_patches + 0.75 * raw_patches.new_tensor(color).repeat(P * P)

    shown = torch.where(mask.unsqueeze(-1), tint(RANDOM_COLOR), raw_patches)
    shown = torch.where(hard.unsqueeze(-1), tint(HARD_COLOR), shown)
    # (B, N_mask, P*P*3)
    predicted = predicted_patches(base, images, out, objective.mean, objective.std)
    idx = out["idx"].unsqueeze(-1).expand(-1, -1, raw_patches.shape[-1])
    recon = raw_patches.scatter(1, idx, predicted)  # visible patches as they are, masked predicted
    heat = heat_colors(scores).repeat(1, 1, P * P)  # (B, N, P*P*3)
    return [raw] + [unpatchify(x, grid, P) for x in (shown, recon, heat)]


def picture_size(
    num_images: int, height: int, width: int, scale: int, panels: int = 4
) -> tuple[int, int]:
    """(width, height) in pixels of the grid ``hpm_picture`` writes."""
    grid_width = panels * width * scale + (panels + 1) * GAP
    grid_height = num_images * height * scale + (num_images + 1) * GAP
    return grid_width, grid_height


def hpm_picture(
    objective: HardPatchesMining,
    images: Tensor,
    path: str | Path,
    scale: int | None = None,
    num_hard: int | None = None,
) -> Image.Image:
    """Write the picture grid of ``images`` (B, 3, H, W, normalised) to ``path`` (PNG); returns it.
    ``scale`` enlarges each panel (default: to at least 96 px); ``num_hard`` overrides k."""
    was_training = objective.training
    objective.eval()
    try:
        panels = hpm_panels(objective, images, num_hard)
    finally:
        objective.train(was_training)
    B, _, H, W = images.shape
    scale = scale or max(1, math.ceil(96 / max(H, W)))
    size = picture_size(B, H, W, scale, len(panels))
    canvas = Image.new("RGB", size, "white")
    for col, panel in enumerate(panels):
        panel = F.interpolate(panel.float().cpu(), scale_factor=scale, mode="nearest")
        tiles = (panel.clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).numpy()
        for row in range(B):
            canvas.paste(
                Image.fromarray(tiles[row]),
                (GAP + col * (W * scale + GAP), GAP + row * (H * scale + GAP)),
            )
    canvas.save(path, format="PNG")
    return canvas


# ---- command line ---------------------------------------------------------------------------


def load_images(
    count: int,
    img_size: int,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    image_dir: str | None,
) -> Tensor:
    """``count`` normalised images (B, 3, S, S): the files of ``image_dir``, or scikit-learn's digits."""
    if image_dir:
        suffixes = {".png", ".jpg", ".jpeg", ".webp"}
        files = sorted(p for p in Path(image_dir).iterdir() if p.suffix.lower() in suffixes)[:count]
        if not files:
            raise SystemExit(f"no {'/'.join(sorted(suffixes))} images in {image_dir}")
        size, bicubic = (img_size, img_size), Image.Resampling.BICUBIC
        pics = [np.asarray(Image.open(f).convert("RGB").resize(size, bicubic)) for f in files]
        x = torch.from_numpy(np.stack(pics)).permute(0, 3, 1, 2).float() / 255
    else:
        from sklearn.datasets import load_digits

        digits = torch.tensor(load_digits().images[:count], dtype=torch.float32) / 16  # (B, 8, 8)
        x = F.interpolate(digits[:, None], size=img_size, mode="bicubic", align_corners=False)
        x = x.clamp(0, 1).expand(-1, 3, -1, -1)
    return (x - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)


def deepspeed_weights(folder: Path) -> dict[str, Tensor]:
    """The module's weights in a DeepSpeed checkpoint folder: the root (``latest`` names the
    tag) or one tag folder, in fp32 (``mpp.checkpoint.zero_to_fp32``: ZeRO 1-3 consolidated
    from the optimiser shards, frozen parameters such as the teacher's included)."""
    found = find_checkpoint(folder)
    if found is None:
        raise FileNotFoundError(f"{folder}: no DeepSpeed checkpoint there")
    return zero_to_fp32(*found)  # any stage, under weights_only loads


def load_weights(objective: HardPatchesMining, checkpoint: str) -> None:
    """A state dict file (DeepSpeed's ``mp_rank_00_model_states.pt`` too), a DeepSpeed checkpoint
    folder, or an exported encoder (.pt or .safetensors; into student and teacher encoders)."""
    path = Path(checkpoint)
    if path.is_dir():
        state = deepspeed_weights(path)
    elif path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        with weights_only_loads():  # a checkpoint is untrusted input: no arbitrary unpickling
            state = torch.load(path, map_location="cpu", weights_only=True)
        state = state.get("module", state.get("state_dict", state))  # DeepSpeed's model states
    if "patch_embed.proj.weight" in state:  # an encoder alone: decoders and predictor stay as built
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
        for encoder in (objective.base.encoder, objective.teacher["base"].encoder):
            encoder.load_state_dict(state)
        return
    missing, unexpected = objective.load_state_dict(state, strict=False)
    # frozen sin-cos tables may be left out of a consolidated checkpoint: they are rebuilt anyway
    missing = [k for k in missing if not k.endswith("pos_embed")]
    if missing or unexpected:
        raise ValueError(f"{checkpoint} does not fit the objective: missing {missing[:5]}, unexpected {unexpected[:5]}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m mpp.viz",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", required=True, help="PNG file to write")
    ap.add_argument("--images", type=int, default=8, help="how many images (rows)")
    ap.add_argument(
        "--config", help="a pretraining config (objective hpm); else the flags below build one"
    )
    ap.add_argument(
        "--checkpoint", help="state dict file, DeepSpeed checkpoint folder, or exported encoder"
    )
    ap.add_argument("--image-dir", help="folder of images to show (default: scikit-learn's digits)")
    ap.add_argument("--model", default="vit_tiny_patch4_32")
    ap.add_argument("--base", default="mae", choices=["mae", "mpp"])
    ap.add_argument("--decoder-dim", type=int, default=128)
    ap.add_argument("--decoder-depth", type=int, default=2)
    ap.add_argument("--decoder-heads", type=int, default=4)
    ap.add_argument(
        "--hard-ratio",
        type=float,
        help="share of the mask chosen as hard (default: the objective's)",
    )
    ap.add_argument("--scale", type=int, help="enlarge each panel by this factor")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    if args.config:
        from mpp.build import build_objective
        from mpp.config import load_config

        objective = build_objective(load_config(args.config))
    else:
        from mpp.models.vit import create_vit

        objective = HardPatchesMining(
            create_vit(args.model, pos_embed="sincos"),
            base=args.base,
            decoder_dim=args.decoder_dim,
            decoder_depth=args.decoder_depth,
            decoder_heads=args.decoder_heads,
        )
    if not isinstance(objective, HardPatchesMining):
        raise SystemExit(
            f"mpp.viz draws HPM objectives, the config builds {type(objective).__name__}"
        )
    if args.checkpoint:
        load_weights(objective, args.checkpoint)
    enc = objective.encoder
    images = load_images(
        args.images, enc.patch_embed.img_size[0], objective.mean, objective.std, args.image_dir
    )
    k = None if args.hard_ratio is None else int(objective.num_masked * args.hard_ratio)
    pic = hpm_picture(objective, images, args.out, scale=args.scale, num_hard=k)
    print(f"wrote {args.out} ({pic.width}x{pic.height}, {images.shape[0]} images)")


if __name__ == "__main__":
    main()
