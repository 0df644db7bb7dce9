"""What a pretraining objective sees, drawn from a run or a checkpoint (``mpp.train.panels``): one row
per image (PIL only, no plotting library).

HPM: input | mask (grey: masked at random, red: masked as hard by the teacher) |
reconstruction (visible patches from the input, masked ones predicted) | teacher's predicted loss.
MAE / MPP: input | mask (grey) | reconstruction (MPP: each masked patch in its predicted colour).

  mpp viz --images 8 --out grid.png                       # random init, digits
  mpp viz --checkpoint runs/hpm_demo --out grid.png       # a pretraining run: its config.json and data
  mpp viz --config hpm_demo --checkpoint runs/x/checkpoints --out grid.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from mpp.checkpoint.format import find_checkpoint, weights_only_loads, zero_to_fp32
from mpp.checkpoint.storage import CheckpointError
from mpp.config import Config, load_config, resolve_config_path
from mpp.hub.encoder_file import load_encoder_file
from mpp.objectives import create_objective
from mpp.objectives.base import Objective
from mpp.objectives.hpm import HardPatchesMining, hpm_bases
from mpp.quiet import add_verbose_argument
from mpp.train.panels import objective_panels, save_picture

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


def load_weights(objective: Objective, checkpoint: str) -> None:
    """A state dict file (DeepSpeed's ``mp_rank_00_model_states.pt`` too), a DeepSpeed checkpoint
    folder or a run directory, or an exported encoder (.pt or .safetensors; into HPM's student
    and teacher encoders)."""
    path = Path(checkpoint)
    if path.is_dir():  # a checkpoint root (``latest`` names the tag) or a tag
        found = find_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"{path}: no DeepSpeed checkpoint there")
        # the module's fp32 weights at any stage (frozen ones such as the teacher's too)
        state = zero_to_fp32(*found)
    elif path.suffix == ".safetensors":
        state = load_encoder_file(path)[0]
    else:
        with weights_only_loads():  # a checkpoint is untrusted input: no arbitrary unpickling
            state = torch.load(path, map_location="cpu", weights_only=True)
        state = state.get("module", state.get("state_dict", state))  # DeepSpeed's model states
    if "patch_embed.proj.weight" in state:  # an encoder alone: decoders and predictor stay as built
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
        hpm = isinstance(objective, HardPatchesMining)
        for encoder in (
            (objective.encoder, objective.teacher["base"].encoder) if hpm else (objective.encoder,)
        ):
            encoder.load_state_dict(state)
        return
    missing, unexpected = objective.load_state_dict(state, strict=False)
    # frozen sin-cos tables may be left out of a consolidated checkpoint: they are rebuilt anyway
    missing = [k for k in missing if not k.endswith("pos_embed")]
    if missing or unexpected:
        raise ValueError(
            f"{checkpoint} does not fit the objective: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def run_config(checkpoint: str) -> Path | None:
    """The config.json of the run ``checkpoint`` belongs to (the run, its checkpoints/, a tag, a
    file in the run); None when there is none (a Hugging Face or timm folder has another kind)."""
    path = Path(checkpoint)
    for folder in (path, path.parent, path.parent.parent):
        cfg = folder / "config.json"
        if cfg.is_file() and {"model", "data"} <= json.loads(cfg.read_text()).keys():
            return cfg
    return None


def pretraining_config(path: str | Path) -> Config:
    """A pretraining config (a file, a name in configs/ or a run's config.json); the other kinds
    of run are refused with the reason."""
    raw = json.loads(resolve_config_path(path).read_text())
    if "finetune" in raw:
        raise ValueError(
            f"{path}: a fine-tuning run (a classifier, no masked-patch objective to draw); "
            f"draw the pretraining run it started from ({raw.get('init')})"
        )
    if "probe" in raw:
        raise ValueError(f"{path}: a k-NN / linear probe run keeps no weights to draw")
    sets = ["model.init=null"]  # the weights come from --checkpoint
    if Path(path).name == "config.json":  # a run's: what its init stated, from its model.json
        from mpp.build import FILE_FACTS
        from mpp.hub.source import run_model_kwargs

        built, model = run_model_kwargs(Path(path).parent), raw.get("model") or {}
        if isinstance(built.get("img_size"), list):
            raise ValueError(
                f"{path}: the run's model.json states a non-square image size "
                f"{built['img_size']}; viz draws square images only"
            )
        sets += [
            f"model.{k}={json.dumps(built[k])}"
            for k in FILE_FACTS
            if model.get(k) is None and built.get(k) is not None
        ]
    return load_config(path, sets)


def used_pixels(cfg: Config, config: Path, objective: Objective) -> tuple:
    """(mean, std, format) of the run's data: what a run's data.json says it used, else the
    config's, its "auto" ones measured (``mpp.train.plan.measure_pixels``)."""
    from mpp.data.stats import run_pixels
    from mpp.data.transforms import PixelFormat
    from mpp.train.plan import measure_pixels, shards

    d = cfg.data
    used = run_pixels(config.parent) if config.name == "config.json" else None
    if used is None:
        img_size = objective.encoder.patch_embed.img_size[0]
        pixels = measure_pixels(cfg, shards(cfg, "train", img_size, warn=True))
        return pixels.mean, pixels.std, pixels.format
    vr = used.get("value_range")
    fmt = PixelFormat(d.channels, d.layout, tuple(vr) if vr else None)
    return tuple(used["mean"]), tuple(used["std"]), fmt


def build_for(args: argparse.Namespace) -> tuple[Objective, Config | None, tuple | None]:
    """(the objective, its run's config, its data's ``used_pixels``): from --config, else the
    checkpoint's run, else an HPM objective from the flags (no config)."""
    config = args.config or (run_config(args.checkpoint) if args.checkpoint else None)
    if config:
        from mpp.build import build_objective

        cfg = pretraining_config(config)
        objective = build_objective(cfg)
        pixels = used_pixels(cfg, Path(config), objective)
        objective.set_pixel_stats(*pixels[:2])
        return objective, cfg, pixels
    from mpp.models.vit import create_vit

    objective = create_objective(
        "hpm",
        create_vit(args.model, pos_embed="sincos"),
        base=args.base,
        decoder_dim=args.decoder_dim,
        decoder_depth=args.decoder_depth,
        decoder_heads=args.decoder_heads,
    )
    return objective, None, None


def run_images(cfg: Config, pixels: tuple, count: int, img_size: int) -> Tensor:
    """``count`` normalised images of the run's own data, the previews' (its val shards, else its
    first training shard there), as the data holds them: any channel count and bit depth."""
    from mpp.ops import normalize
    from mpp.train.preview import preview_images, preview_shards

    d = cfg.data
    shards = preview_shards(cfg, img_size)  # the previews' images: a missing shard left out
    mean, std, fmt = pixels
    images = preview_images(shards, img_size, d.allow_pipe, fmt)
    if images is None:
        raise ValueError(f"{shards}: no image of {d.channels} channel(s) to show")
    return normalize(images[:count], mean, std)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mpp viz",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", required=True, help="PNG file to write")
    ap.add_argument("--images", type=int, default=8, help="how many images (rows)")
    ap.add_argument(
        "--config",
        help="a pretraining config; default: the checkpoint's run's, else the flags below",
    )
    ap.add_argument(
        "--checkpoint",
        help="a pretraining run, DeepSpeed checkpoint folder, state dict file, or exported encoder",
    )
    ap.add_argument(
        "--image-dir",
        help="folder of images to show (default: the run's own data, its validation shards, else "
        "its training shards; without a run, scikit-learn's digits)",
    )
    ap.add_argument("--model", default="vit_tiny_patch4_32")
    ap.add_argument("--base", default="mae", choices=sorted(hpm_bases()))
    ap.add_argument("--decoder-dim", type=int, default=128)
    ap.add_argument("--decoder-depth", type=int, default=2)
    ap.add_argument("--decoder-heads", type=int, default=4)
    ap.add_argument(
        "--hard-ratio",
        type=float,
        help="HPM: share of the mask chosen as hard (default: the objective's)",
    )
    ap.add_argument("--scale", type=int, help="enlarge each panel by this factor")
    ap.add_argument("--seed", type=int, default=0)
    add_verbose_argument(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.manual_seed(args.seed)
    try:
        objective, cfg, pixels = build_for(args)
        if args.checkpoint:
            load_weights(objective, args.checkpoint)
        mean, std = pixels[:2] if cfg else (objective.mean, objective.std)
        size = objective.encoder.patch_embed.img_size[0]
        if cfg is not None and not args.image_dir:  # the run's own data, any channel count
            images = run_images(cfg, pixels, args.images, size)
        else:
            images = load_images(args.images, size, mean, std, args.image_dir)
    except (ValueError, FileNotFoundError, CheckpointError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    hpm = isinstance(objective, HardPatchesMining)
    k = None if args.hard_ratio is None or not hpm else int(objective.num_masked * args.hard_ratio)
    show = cfg.data.display_channels if cfg else None
    panels = objective_panels(objective, images, mean, std, k, show)
    pic = save_picture(panels, args.out, args.scale)
    print(f"wrote {args.out} ({pic.width}x{pic.height}, {images.shape[0]} images)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
