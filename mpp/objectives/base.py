"""What the training engine may call on an objective, and nothing more (STYLE.md: the engine
knows nothing objective-specific)."""

from __future__ import annotations

from torch import Tensor, nn


class Objective(nn.Module):
    """An ``nn.Module`` with ``forward(images) -> (loss, metrics)``.

    ``images`` are normalised floats (B, C, H, W) already on the device; ``metrics`` maps
    names to detached 0-dim tensors (the engine turns them into numbers only at log time,
    so the step has no host sync).
    """

    def forward(self, images: Tensor) -> tuple[Tensor, dict[str, Tensor]]:  # pragma: no cover
        raise NotImplementedError

    def inputs(self, batch: dict[str, Tensor]) -> tuple[Tensor, ...]:
        """What ``forward`` takes from a batch on the device (``image``: normalised (B, C, H, W),
        ``label`` (B,) where the stream has labels). Self-supervised objectives: the images."""
        return (batch["image"],)

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
