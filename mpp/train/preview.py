"""Pictures of the objective while it trains (``train.preview_every`` steps): the panels of
``mpp.train.panels`` on a fixed set of validation images, into TensorBoard and W&B.

The images are drawn once, the masks from a fixed seed in a forked RNG, so every preview shows
the same images under the same masks and training draws exactly what it would without them. A
step without a preview costs one integer comparison: no tensor is touched, nothing waits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mpp.ops import normalize
from mpp.parallel import zero
from mpp.train.hooks import Hook
from mpp.train.panels import objective_panels, panel_grid

NUM_IMAGES = 8
SEED = 1234  # the masks' seed: the same masks at every preview


def caption(objective: Any) -> str:
    """What the picture's columns are, and how the reconstruction was un-normalised."""
    from mpp.objectives.hpm import HardPatchesMining

    columns = "input | mask | reconstruction"
    if isinstance(objective, HardPatchesMining):
        columns = "input | mask (red: hard, chosen by the teacher) | reconstruction | teacher's predicted loss"
        objective = objective.base
    if getattr(objective, "norm_pix_loss", False):
        columns += " (norm_pix_loss: each predicted patch un-normalised with the true patch's mean and variance)"
    elif getattr(objective, "target", None) in ("mean_color", "downsampled"):
        columns += " (each masked patch in its predicted colour)"
    return columns


class Preview:
    """``preview(model, step, reporters)`` after each optimiser step; every rank calls it (under
    ZeRO-3 the parameters are gathered for the preview, a collective); rank 0 writes."""

    def __init__(
        self,
        every: int,
        images: Tensor | None,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        device: torch.device,
        rank: int,
        show: tuple[int, ...] | None = None,
    ) -> None:
        self.every, self.rank, self.mean, self.std, self.show = every, rank, mean, std, show
        # (B, C, H, W)
        self.images = None if images is None else normalize(images, mean, std).to(device)
        self.captioned = False

    def __call__(self, model: Any, step: int, reporters: list) -> None:
        if not self.every or step % self.every or self.images is None:
            return
        devices = [self.images.device] if self.images.device.type == "cuda" else []
        with zero.gathered(list(model.parameters())), torch.random.fork_rng(devices=devices):
            torch.manual_seed(SEED)
            panels = objective_panels(model, self.images, self.mean, self.std, show=self.show)
        if self.rank != 0:
            return
        grid = panel_grid(panels)  # (3, H, W) uint8
        for reporter in reporters:
            reporter.image("preview", grid, step, None if self.captioned else caption(model))
        self.captioned = True


def preview_images(
    shards: str | list[str], img_size: int, allow_pipe: bool = False, pixels: Any = None
) -> Tensor | None:
    """The first ``NUM_IMAGES`` images of ``shards`` (B, C, S, S), uint8 or float32 as the data
    holds them (``pixels``: its ``PixelFormat``), centre-cropped; None if none."""
    from mpp.data import make_eval_loader
    from mpp.data.transforms import RGB

    loader = make_eval_loader(
        shards,
        batch_size=NUM_IMAGES,
        img_size=img_size,
        rank=0,
        world_size=1,
        num_workers=0,
        with_labels=False,
        allow_pipe=allow_pipe,
        pixels=pixels or RGB,
    )
    batch = next(iter(loader), None)
    return None if batch is None else batch["image"]


def build_preview(cfg: Any, plan: Any, objective: Any, device: torch.device, rank: int) -> Preview:
    """The run's previews; one that never draws when off (``train.preview_every`` 0), with nothing
    to report to, or for an objective without masks (fine-tuning). Images: ``preview_shards``."""
    from mpp.train.plan import previews_on

    t, d, px, img_size = cfg.train, cfg.data, plan.pixels, plan.img_size
    if not previews_on(cfg) or not hasattr(
        getattr(objective, "base", objective), "forward_per_patch"
    ):
        return Preview(0, None, px.mean, px.std, device, rank)
    shards = preview_shards(cfg, img_size, plan.train_shards)
    images = preview_images(shards, img_size, d.allow_pipe, px.format)
    return Preview(t.preview_every, images, px.mean, px.std, device, rank, d.display_channels)


def preview_shards(cfg: Any, img_size: int, train: list[str] | None = None) -> Any:
    """What the previews (and ``mpp viz``) draw: the held-out images (``shards`` "val"), else
    the first training shard there: of ``train`` (the plan's, the missing ones left out), else
    of the shards resolved as the plan does (none there: ConfigError naming the key)."""
    from mpp.train.plan import shards

    held = shards(cfg, "val", img_size, look=False)
    if held:
        return held
    return (train if train is not None else shards(cfg, "train", img_size))[:1]


class PreviewHook(Hook):
    """The previews as a ``mpp.train.hooks.Hook``: built when the loop starts, drawn after each
    optimiser step (under the engine's precision)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg, self.preview = cfg, None
        self.every = cfg.train.preview_every

    def start(self, trainer: Any) -> None:
        self.preview = build_preview(
            self.cfg, trainer.plan, trainer.objective, trainer.device, trainer.rank
        )

    def step_end(self, trainer: Any) -> None:
        with trainer.autocast():  # every train.preview_every steps
            self.preview(trainer.objective, trainer.state.step, trainer.metrics.reporters)
