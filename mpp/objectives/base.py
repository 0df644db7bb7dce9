"""What the training engine may call on an objective, and nothing more (docs/ARCHITECTURE.md
§3.1: the engine knows nothing objective-specific), and the one registry of objectives: a name
-> (its typed config section, its class), filled by ``@register(Section)`` where each is defined."""

from __future__ import annotations

from typing import Any, ClassVar, TypedDict

from pydantic import BaseModel, ConfigDict
from torch import Tensor, nn

from mpp.masking import MaskGenerator, RandomMask

Pixels = tuple[tuple[float, ...], tuple[float, ...]]  # the data's (mean, std)


class Section(BaseModel):
    """An objective's typed config section (``objective`` of a config): unknown keys refused, each
    field's docstring what ``mpp config --explain`` prints; ``name`` its registry name."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str

    def build(
        self, encoder: nn.Module, mask_generator: MaskGenerator | None, pixels: Pixels
    ) -> Objective:
        """The registered objective of this section around ``encoder``."""
        return REGISTRY[self.name][1].from_config(self, encoder, mask_generator, pixels)


# name -> (section, class); mpp.objectives.configs imports every module of the package, so the
# union of a config's ``objective`` is built from it (a new objective: one file, one ``@register``)
REGISTRY: dict[str, tuple[type[Section], type[Objective]]] = {}


def register(section: type[Section], *, as_base: type[Section] | None = None) -> Any:
    """Class decorator: the objective ``cls`` is built from ``section`` under ``section``'s name.
    ``as_base``: the form HPM nests when it wraps ``cls`` (MAE's: without the decoder's size,
    which is HPM's); default ``section``."""

    def add(cls: Any) -> Any:
        REGISTRY[section.model_fields["name"].default] = (section, cls)
        cls.base_section = as_base or section
        return cls

    return add


class Objective(nn.Module):
    """An ``nn.Module`` with ``forward(images) -> (loss, metrics)``.

    ``images`` are normalised floats (B, C, H, W) already on the device; ``metrics`` maps
    names to detached 0-dim tensors (the engine turns them into numbers only at log time,
    so the step has no host sync). A registered one is built by ``from_config``.
    """

    base_section: ClassVar[type[Section]]  # what HPM nests when it wraps this (``register``)

    @classmethod
    def from_config(
        cls, cfg: Any, encoder: nn.Module, mask_generator: MaskGenerator | None, pixels: Pixels
    ) -> Objective:
        """The objective of section ``cfg`` around ``encoder``; ``pixels``: the data's
        (mean, std). Default: ``cls(encoder, mask_generator, cfg, pixels)``."""
        return cls(encoder, mask_generator, cfg, pixels)

    def forward(self, images: Tensor) -> tuple[Tensor, dict[str, Tensor]]:  # pragma: no cover
        raise NotImplementedError

    def inputs(self, batch: dict[str, Tensor]) -> tuple[Tensor, ...]:
        """What ``forward`` takes from a batch on the device (``image``: normalised (B, C, H, W),
        ``label`` (B,) where the stream has labels). Self-supervised objectives: the images."""
        return (batch["image"],)

    def held_out_metrics(self, images: Tensor) -> dict[str, Tensor]:
        """The objective's own signal on held-out images (the training monitor,
        ``mpp.train.monitor``): name -> one value per image (B,), so the monitor can average
        them exactly over chunks and ranks. Called under ``no_grad``, in eval mode, with the RNG
        forked and seeded (the same masks at every monitor). Default: none."""
        return {}

    def set_pixel_stats(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        """The data's per-channel mean and std, once measured (``data.mean="auto"``,
        ``mpp.data.stats``), for an objective that un-normalises its inputs (MPP's colour
        targets, the pictures). Default: nothing to set."""

    def set_progress(self, epoch: float, total_epochs: float) -> None:
        """Called by the engine before every micro-step: ``epoch`` counts completed epochs
        fractionally (step / steps_per_epoch). Schedules (HPM's easy-to-hard alpha, the
        teacher momentum) read it; the default does nothing."""

    def after_optimizer_step(self) -> None:
        """Called by the engine after every optimiser step (not after accumulation
        micro-steps), on every rank: HPM updates its EMA teacher here."""

    def weights_loaded(self) -> None:
        """Called after published weights were loaded into the module (``model.init``), before
        training: HPM starts its teacher from them. Default: nothing."""

    def no_weight_decay(self) -> set[str]:
        """Full parameter names exempt from weight decay besides biases and norms."""
        return set()

    def rank_state(self) -> dict[str, Tensor]:
        """State outside the parameters and buffers that an exact resume needs (HPM: its fp32
        EMA under bf16). Saved beside each checkpoint, per rank; state every rank holds alike
        is returned by rank 0 only and read back by every rank. Default: none."""
        return {}

    def load_rank_state(self, state: dict[str, Tensor]) -> None:
        """Restore what ``rank_state`` returned; called after the engine loaded the checkpoint."""


class PerPatch(TypedDict):
    """What ``forward_per_patch`` returns: the step up to per-patch losses (an objective may add
    its own keys: MPP's ``correct`` and ``kind``)."""

    loss: Tensor  # (B, n): the loss of each masked (MPP: corrupted) patch, not reduced
    idx: Tensor  # (B, n): those patches' indices in the (B, N) grid
    mask: Tensor  # (B, N) bool: the mask the step used
    tokens: Tensor  # (B, 1 + N, token_dim): what HPM's loss predictor reads
    pred: Tensor  # (B, n or N, out): the objective's predictions


class PerPatchObjective(Objective):
    """An objective with a per-patch loss, which HPM can wrap (``mpp.objectives.hpm``): MAE's
    reconstruction MSE, MPP's cross-entropy. Its constructor takes ``mask_generator`` (HPM sets
    the masks through it) and it holds:

    - ``token_dim``: the width of ``tokens`` (MAE: the decoder's input; MPP: the encoder's);
    - ``mask_generator``: the one it masks with, ``num_masked`` patches per image;
    - ``predictor_tokens(images, mask=None)``: ``tokens`` of the fully visible image, or of the
      image under ``mask`` (B, N) as ``forward_per_patch`` builds them (what HPM's teacher scores);
    - ``forward_per_patch(images, mask=None) -> PerPatch``: the step up to per-patch losses,
      with ``mask`` (B, N) given by HPM or drawn by ``mask_generator`` when None.
    """

    token_dim: int

    # pragma: no cover
    def predictor_tokens(self, images: Tensor, mask: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    # pragma: no cover
    def forward_per_patch(self, images: Tensor, mask: Tensor | None = None) -> PerPatch:
        raise NotImplementedError

    def use_masks(
        self, encoder: nn.Module, given: MaskGenerator | None, ratio: float, some_visible=True
    ) -> None:
        """``mask_generator``: ``given`` (HPM's, a config's strategy) or random patches at
        ``ratio``, over ``encoder``'s patches; ``num_masked`` its count, 1..N-1 when
        ``some_visible``. ValueError otherwise."""
        self.mask_generator = given or RandomMask(encoder.grid_size, ratio)
        n, self.num_masked = encoder.num_patches, self.mask_generator.num_masked
        if self.mask_generator.num_patches != n:
            raise ValueError(
                f"mask generator covers {self.mask_generator.num_patches} patches, encoder has {n}"
            )
        if some_visible and not 0 < self.num_masked < n:
            raise ValueError(
                f"mask_ratio {ratio} masks {self.num_masked} of {n} patches; need 1..N-1"
            )

    def per_image_metrics(self, out: PerPatch) -> dict[str, Tensor]:
        """What ``forward_per_patch`` says of each image (B,): its masked patches' mean loss."""
        return {"loss": out["loss"].mean(1)}

    def forward(self, images: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The mean of the masked patches' losses (MPP adds its own metrics)."""
        loss = self.forward_per_patch(images)["loss"].mean()
        return loss, {"loss": loss.detach()}

    def held_out_metrics(self, images: Tensor) -> dict[str, Tensor]:
        return self.per_image_metrics(self.forward_per_patch(images))
