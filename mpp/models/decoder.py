"""MAE's light decoder, split at the point HPM's loss predictor branches off: ``DecoderEmbed``, its
input tokens, and ``Decoder``, the stack (docs/ARCHITECTURE.md §4.3, §4.4)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mpp.models.vit import Block, init_linear_and_norm, run_blocks, sincos_pos_embed


class DecoderEmbed(nn.Module):
    """Encoder tokens (B, 1 + N_vis, D) -> decoder input (B, 1 + N, decoder_dim) in patch order."""

    def __init__(
        self,
        embed_dim: int,
        decoder_dim: int,
        grid_size: tuple[int, int],
        num_prefix_tokens: int = 1,
    ) -> None:
        super().__init__()
        self.decoder_dim = decoder_dim
        self.num_prefix_tokens = num_prefix_tokens
        self.num_patches = grid_size[0] * grid_size[1]
        self.proj = nn.Linear(embed_dim, decoder_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_dim))
        # fixed sin-cos, kept a frozen Parameter like the encoder's (and MAE's)
        self.pos_embed = nn.Parameter(
            sincos_pos_embed(decoder_dim, grid_size).unsqueeze(0), requires_grad=False
        )
        init_linear_and_norm(self)
        nn.init.normal_(self.mask_token, std=0.02)

    def forward(self, latent: Tensor, visible_idx: Tensor | None = None) -> Tensor:
        """``visible_idx`` (B, N_vis) says where the encoder's patch tokens sit; None = all visible."""
        x = self.proj(latent)  # (B, 1 + N_vis, Dd)
        prefix, patches = x[:, : self.num_prefix_tokens], x[:, self.num_prefix_tokens :]
        if visible_idx is not None:
            # MAE's "unshuffle": mask tokens everywhere, the visible tokens scattered back in place
            B, _, Dd = patches.shape
            full = self.mask_token.to(patches.dtype).expand(B, self.num_patches, Dd)
            idx = visible_idx.unsqueeze(-1).expand(-1, -1, Dd)
            patches = full.scatter(1, idx, patches)  # (B, N, Dd)
        return torch.cat([prefix, patches], dim=1) + self.pos_embed.to(x.dtype)


class Decoder(nn.Module):
    """Tokens (B, L, in_dim) -> (B, L, out_dim): [Linear in_dim -> dim], blocks, LayerNorm, Linear."""

    def __init__(
        self,
        dim: int = 512,
        depth: int = 8,
        num_heads: int = 16,
        out_dim: int = 768,
        in_dim: int | None = None,
        mlp_ratio: float = 4.0,
        attn_backend: str = "auto",
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if depth < 0 or dim < 1 or out_dim < 1:
            raise ValueError(
                f"decoder needs depth >= 0, dim >= 1, out_dim >= 1; got {depth}, {dim}, {out_dim}"
            )
        self.in_proj = nn.Identity() if in_dim in (None, dim) else nn.Linear(in_dim, dim)
        block = dict(qkv_bias=True, attn_backend=attn_backend, norm_eps=norm_eps)
        self.blocks = nn.Sequential(
            *[Block(dim, num_heads, mlp_ratio, **block) for _ in range(depth)]
        )
        self.norm = nn.LayerNorm(dim, eps=norm_eps)
        self.pred = nn.Linear(dim, out_dim)
        self.grad_checkpointing = False
        init_linear_and_norm(self)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def forward(self, x: Tensor) -> Tensor:
        return self.pred(
            self.norm(run_blocks(self.blocks, self.in_proj(x), self.grad_checkpointing))
        )
