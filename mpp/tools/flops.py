"""Model FLOPs of one training step, counted analytically from the modules' sizes.

The convention of MFU figures (PaLM, nanoGPT): only matmuls and convolutions count
(2·M·N·K per matmul), norms / softmax / GELU / the loss do not; a trained forward costs
3× its forward (forward + input gradient + weight gradient), a no-grad forward (HPM's
teacher) 1×. tests/test_benchmarks.py checks the forward counts against a hand count and
against ``torch.utils.flop_counter.FlopCounterMode``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mpp.models.decoder import Decoder, DecoderEmbed
from mpp.models.vit import VisionTransformer
from mpp.objectives.hpm import HardPatchesMining, num_views
from mpp.objectives.mae import MaskedAutoencoder
from mpp.objectives.mpp import MaskedPatchPrediction
from mpp.objectives.simmim import SimMIM

TRAIN_FACTOR = 3  # forward + backward (input and weight gradients) of a trained forward


@dataclass(frozen=True)
class StepFlops:
    """FLOPs per image: ``trained`` forwards (fwd + bwd, x3) and ``no_grad`` forwards (x1)."""

    trained: int  # forward FLOPs of the part that is trained
    no_grad: int  # forward FLOPs of no-grad work (HPM's teacher)
    parts: dict[str, int]  # forward FLOPs by part, for the table

    @property
    def forward(self) -> int:
        return self.trained + self.no_grad

    @property
    def step(self) -> int:
        """Model FLOPs of one training step per image."""
        return TRAIN_FACTOR * self.trained + self.no_grad


def transformer_flops(tokens: int, dim: int, depth: int, mlp_hidden: int) -> int:
    """Forward FLOPs of ``depth`` pre-norm blocks on ``tokens`` tokens of width ``dim``, one image.

    Per block, with L = tokens, D = dim, F = mlp_hidden:
      qkv 2·L·D·3D + QKᵀ 2·L²·D + AV 2·L²·D + proj 2·L·D·D + fc1 2·L·D·F + fc2 2·L·F·D
    (QKᵀ and AV summed over heads: H·2·L²·(D/H) = 2·L²·D each).
    """
    L, D, F = tokens, dim, mlp_hidden
    per_block = 2 * L * D * 3 * D + 2 * 2 * L * L * D + 2 * L * D * D + 2 * 2 * L * D * F
    return depth * per_block


def _linear(tokens: int, layer: nn.Module) -> int:
    return (
        2 * tokens * layer.in_features * layer.out_features if isinstance(layer, nn.Linear) else 0
    )


def _encoder(enc: VisionTransformer, num_patch_tokens: int) -> int:
    """Patch embedding (a stride-P conv: one C·P² -> D matmul per patch, on all N patches)
    plus the blocks on cls + ``num_patch_tokens`` tokens."""
    blk = enc.blocks[0]
    patch = enc.patch_embed
    embed = 2 * enc.num_patches * patch.in_chans * patch.patch_size**2 * enc.embed_dim
    hidden = blk.mlp.fc1.out_features
    return embed + transformer_flops(
        enc.num_prefix_tokens + num_patch_tokens, enc.embed_dim, len(enc.blocks), hidden
    )


def _decoder(dec: Decoder, tokens: int) -> int:
    """[in_proj], blocks, pred on ``tokens`` tokens."""
    depth = len(dec.blocks)
    hidden = dec.blocks[0].mlp.fc1.out_features if depth else 0
    return (
        _linear(tokens, dec.in_proj)
        + transformer_flops(tokens, dec.pred.in_features, depth, hidden)
        + _linear(tokens, dec.pred)
    )


def _decoder_embed(emb: DecoderEmbed, visible: int) -> int:
    return _linear(emb.num_prefix_tokens + visible, emb.proj)


def _teacher(model: HardPatchesMining, predictor: int) -> int:
    """The teacher's no-grad forward per image: one fully visible image (``teacher_view=
    "visible"``), or ``masked_views``' V views, each the base's encoder on its visible tokens
    (an MPP base: all N, the masked ones as mask tokens) [+ decoder_embed] + the predictor."""
    enc, n = model.encoder, model.encoder.num_patches
    mae = isinstance(model.base, MaskedAutoencoder)
    if model.teacher_view == "visible":
        views, visible = 1, n
    else:
        visible, views = n - model.num_masked, num_views(n, model.num_masked)
    per_view = _encoder(enc, visible if mae else n) + predictor
    if mae:
        per_view += _decoder_embed(model.base.decoder_embed, visible)
    return views * per_view


def step_flops(model: nn.Module) -> StepFlops:
    """Model FLOPs per image of one training step of ``model``: a plain classifier
    (``VisionTransformer`` with a head), MPP, MAE, SimMIM or HPM (any of those three as base).

    - plain: encoder on 1 + N tokens + head (D -> classes) on the pooled token.
    - MPP: encoder on 1 + N tokens (all patches, corrupted ones included) + head on the
      n_corrupt corrupted tokens only.
    - MAE: encoder on 1 + N_vis tokens; decoder_embed proj on 1 + N_vis; decoder blocks and
      pixel head on 1 + N tokens.
    - SimMIM: encoder on 1 + N tokens (the masked ones as mask tokens) + the linear head on all
      N tokens (the loss reads the masked ones only, the head runs on every patch).
    - HPM: its base + the loss-predictor decoder on 1 + N tokens, all trained; the teacher
      (no grad, only when it runs: k > 0) = the base's encoder on all 1 + N tokens
      [+ decoder_embed] + the predictor decoder, once per view (``_teacher``: V masked views
      with ``teacher_view="masked"``). The teacher's pixel decoder never runs.
    """
    if isinstance(model, VisionTransformer):
        enc = _encoder(model, model.num_patches)
        head = _linear(1, model.head)
        return StepFlops(enc + head, 0, {"encoder": enc, "head": head})
    if isinstance(model, MaskedPatchPrediction):
        enc = _encoder(model.encoder, model.encoder.num_patches)
        head = _linear(model.num_corrupt, model.head)
        return StepFlops(enc + head, 0, {"encoder": enc, "head": head})
    if isinstance(model, SimMIM):
        enc = _encoder(model.encoder, model.encoder.num_patches)
        head = _linear(model.encoder.num_patches, model.head)
        return StepFlops(enc + head, 0, {"encoder": enc, "head": head})
    if isinstance(model, MaskedAutoencoder):
        n = model.encoder.num_patches
        visible = n - model.num_masked
        enc = _encoder(model.encoder, visible)
        dec = _decoder_embed(model.decoder_embed, visible) + _decoder(
            model.decoder, model.encoder.num_prefix_tokens + n
        )
        return StepFlops(enc + dec, 0, {"encoder": enc, "decoder": dec})
    if isinstance(model, HardPatchesMining):
        base = step_flops(model.base)
        enc = model.encoder
        tokens = enc.num_prefix_tokens + enc.num_patches
        predictor = _decoder(model.predictor, tokens)
        teacher = 0
        if model.num_hard > 0:  # k = 0 skips the teacher (plain random masking)
            teacher = _teacher(model, predictor)
        parts = {**base.parts, "predictor": predictor, "teacher": teacher}
        return StepFlops(base.trained + predictor, teacher, parts)
    raise TypeError(f"no FLOP formula for {type(model).__name__}")
