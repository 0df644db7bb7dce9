"""The one ViT encoder, with timm's parameter names and shapes; it also runs on a subset of patch
tokens and on patch embeddings the caller edited (docs/ARCHITECTURE.md §4.1)."""

from __future__ import annotations

import math
import re

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from mpp.models.attention import Attention, resolve_backend
from mpp.ops import to_2tuple

# name: (embed_dim, depth, num_heads); MLP is 4x wide everywhere.
VIT_SIZES = {
    "tiny": (192, 12, 3),
    "small": (384, 12, 6),
    "base": (768, 12, 12),
    "large": (1024, 24, 16),
    "huge": (1280, 32, 16),
}
POS_EMBEDS = ("learned", "sincos")
GLOBAL_POOLS = ("token", "avg", "")


class PatchEmbed(nn.Module):
    """Image (B, C, H, W) -> patch embeddings (B, N, D) by a stride-P convolution."""

    def __init__(
        self, img_size: int | tuple[int, int], patch_size: int, in_chans: int, embed_dim: int
    ) -> None:
        super().__init__()
        self.img_size = to_2tuple(img_size, "img_size")
        self.patch_size = patch_size
        for side in self.img_size:
            if side % patch_size:
                raise ValueError(
                    f"img_size {self.img_size} is not divisible by patch_size {patch_size}; "
                    f"allowed: sizes that are multiples of {patch_size}"
                )
        self.grid_size = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.in_chans = in_chans
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim != 4 or x.shape[1] != self.in_chans:
            raise ValueError(
                f"expected images (B, {self.in_chans}, H, W), got shape {tuple(x.shape)}"
            )
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(f"expected {self.img_size} images, got {tuple(x.shape[-2:])}")
        # fp32 images in, the model's own dtype from here: the objectives compute their targets
        # from the exact fp32 pixels (a bf16 image flips MPP's colour bins, shifts MAE's targets)
        return self.proj(x.to(self.proj.weight.dtype)).flatten(2).transpose(1, 2)  # (B, N, D)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DropPath(nn.Module):
    """Stochastic depth: drop the residual branch per sample, scale survivors by 1/keep."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: Tensor) -> Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        return x * x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep).div_(keep)


class Block(nn.Module):
    """Pre-norm transformer block: x + Attn(LN(x)); x + MLP(LN(x))."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path: float = 0.0,
        attn_backend: str = "auto",
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, attn_backend=attn_backend)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.drop_path = DropPath(drop_path)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


def run_blocks(blocks: nn.Sequential, x: Tensor, checkpointing: bool) -> Tensor:
    """``blocks(x)``; with ``checkpointing`` (and grad enabled) each block's activations are
    recomputed in the backward instead of kept: ~1/3 more compute, activations of one block
    instead of all. Non-reentrant checkpointing replays drop path's RNG state exactly."""
    if not (checkpointing and torch.is_grad_enabled()):
        return blocks(x)
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return x


def sincos_pos_embed(embed_dim: int, grid_size: tuple[int, int], cls_token: bool = True) -> Tensor:
    """Fixed 2-D sin-cos position embedding (MAE): (1 + H*W, D), zeros for the cls position."""
    if embed_dim % 4:
        raise ValueError(
            f"sincos position embedding needs embed_dim divisible by 4, got {embed_dim}"
        )
    gh, gw = grid_size
    # MAE's convention: grid = meshgrid(w, h); the first half of D encodes w, the second h.
    grid_w, grid_h = np.meshgrid(np.arange(gw, dtype=np.float64), np.arange(gh, dtype=np.float64))
    omega = 1.0 / 10000 ** (np.arange(embed_dim // 4, dtype=np.float64) / (embed_dim / 4.0))

    def _1d(pos: np.ndarray) -> np.ndarray:
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    emb = np.concatenate([_1d(grid_w), _1d(grid_h)], axis=1)  # (H*W, D)
    if cls_token:
        emb = np.concatenate([np.zeros((1, embed_dim)), emb], axis=0)
    return torch.from_numpy(emb).float()


def resample_abs_pos_embed(
    pos_embed: Tensor,
    new_size: tuple[int, int],
    old_size: tuple[int, int] | None = None,
    num_prefix_tokens: int = 1,
    mode: str = "bicubic",
) -> Tensor:
    """Resample a (1, prefix + H*W, D) position embedding to a new patch grid: the prefix (cls)
    part kept, the patch part interpolated in 2-D (bicubic by default, as timm and MAE's
    fine-tuning do)."""
    num_patches = pos_embed.shape[1] - num_prefix_tokens
    if old_size is None:
        side = math.isqrt(num_patches)
        if side * side != num_patches:
            raise ValueError(
                f"cannot infer the grid of {num_patches} position embeddings; pass old_size"
            )
        old_size = (side, side)
    new_size = to_2tuple(new_size, "new_size")
    if tuple(old_size) == new_size:
        return pos_embed
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    dim = pos_embed.shape[-1]
    grid = grid.reshape(1, old_size[0], old_size[1], dim).permute(0, 3, 1, 2).float()
    grid = F.interpolate(
        grid, size=new_size, mode=mode, align_corners=False, antialias=mode != "nearest"
    )
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_size[0] * new_size[1], dim).to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)


def init_linear_and_norm(module: nn.Module) -> None:
    """MAE's initialisation: xavier-uniform linears with zero bias, LayerNorm at (1, 0)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class VisionTransformer(nn.Module):
    """ViT encoder with timm's names: cls_token, pos_embed, patch_embed.proj, blocks.i.{norm1,
    attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}, norm, fc_norm, head."""

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 0,
        global_pool: str = "token",
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path_rate: float = 0.0,
        pos_embed: str = "learned",
        attn_backend: str = "auto",
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if pos_embed not in POS_EMBEDS:
            raise ValueError(f"unknown pos_embed {pos_embed!r}; allowed: {POS_EMBEDS}")
        if global_pool not in GLOBAL_POOLS:
            raise ValueError(f"unknown global_pool {global_pool!r}; allowed: {GLOBAL_POOLS}")
        if in_chans < 1:
            raise ValueError(f"in_chans must be >= 1, got {in_chans}")
        if not 0.0 <= drop_path_rate < 1.0:
            raise ValueError(f"drop_path_rate must be in [0, 1), got {drop_path_rate}")
        self.embed_dim = self.num_features = embed_dim
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_prefix_tokens = 1
        self.pos_embed_type = pos_embed
        self.grad_checkpointing = False

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        # sin-cos stays a (frozen) Parameter so the state dict is timm's either way
        self.pos_embed = nn.Parameter(
            torch.zeros(1, self.num_prefix_tokens + self.patch_embed.num_patches, embed_dim),
            requires_grad=pos_embed == "learned",
        )
        # stochastic depth, linear 0 -> rate
        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.Sequential(
            *[
                Block(embed_dim, num_heads, mlp_ratio, qkv_bias, dpr[i], attn_backend, norm_eps)
                for i in range(depth)
            ]
        )
        # timm: global-average-pooled models normalise after pooling (fc_norm), token models before
        use_fc_norm = global_pool == "avg"
        self.norm = nn.Identity() if use_fc_norm else nn.LayerNorm(embed_dim, eps=norm_eps)
        self.fc_norm = nn.LayerNorm(embed_dim, eps=norm_eps) if use_fc_norm else nn.Identity()
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights()

    def attention_backend(self, device: torch.device) -> str:
        """The kernel this encoder's attention runs on ``device`` (``attn_backend`` resolved)."""
        return resolve_backend(self.blocks[0].attn.attn_backend, device)

    def architecture(self) -> dict:
        """The constructor arguments this model's shapes and computation follow from (what a run's
        model.json and an exported encoder's metadata state); the head only on a classifier."""
        block, (h, w) = self.blocks[0], self.patch_embed.img_size
        arch = dict(
            img_size=h if h == w else [h, w],
            patch_size=self.patch_size,
            in_chans=self.patch_embed.in_chans,
            embed_dim=self.embed_dim,
            depth=len(self.blocks),
            num_heads=block.attn.num_heads,
            mlp_ratio=block.mlp.fc1.out_features / self.embed_dim,
            qkv_bias=block.attn.qkv.bias is not None,
            norm_eps=block.norm1.eps,
            pos_embed=self.pos_embed_type,
        )
        if self.num_classes > 0:
            arch.update(num_classes=self.num_classes, global_pool=self.global_pool)
        return arch

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.patch_embed.grid_size

    @property
    def num_patches(self) -> int:
        return self.patch_embed.num_patches

    @property
    def patch_size(self) -> int:
        return self.patch_embed.patch_size

    def init_weights(self) -> None:
        """MAE's initialisation: xavier-uniform linears and patch projection, N(0, .02) tokens."""
        if self.pos_embed_type == "sincos":
            self.pos_embed.data.copy_(sincos_pos_embed(self.embed_dim, self.grid_size).unsqueeze(0))
        else:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        w = self.patch_embed.proj.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.normal_(self.cls_token, std=0.02)
        init_linear_and_norm(self)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """timm's switch: activation checkpointing per block (``run_blocks``)."""
        self.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        """Parameter names exempt from weight decay beyond biases and norms (timm's hook)."""
        return {"pos_embed", "cls_token"}

    def encode(self, patch_tokens: Tensor, visible_idx: Tensor | None = None) -> Tensor:
        """Patch embeddings (B, N, D) -> normed tokens (B, 1 + n, D); n = N, or N_vis when
        ``visible_idx`` (B, N_vis) selects which patch tokens the blocks see."""
        x = patch_tokens + self.pos_embed[:, self.num_prefix_tokens :]
        if visible_idx is not None:
            # (B, N_vis, D)
            x = torch.gather(x, 1, visible_idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        cls = (self.cls_token + self.pos_embed[:, : self.num_prefix_tokens]).expand(
            x.shape[0], -1, -1
        )
        x = torch.cat([cls, x], dim=1)
        x = run_blocks(self.blocks, x, self.grad_checkpointing)
        return self.norm(x)

    def forward_features(self, images: Tensor, visible_idx: Tensor | None = None) -> Tensor:
        """Images (B, C, H, W) -> tokens (B, 1 + n, D)."""
        return self.encode(self.patch_embed(images), visible_idx)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Tokens (B, 1 + n, D) -> pooled features (B, D) or logits (B, num_classes)."""
        if self.global_pool == "avg":
            x = x[:, self.num_prefix_tokens :].mean(dim=1)
        elif self.global_pool == "token":
            x = x[:, 0]
        x = self.fc_norm(x)
        return x if pre_logits else self.head(x)

    def forward(self, images: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(images))


_NAME_RE = re.compile(r"^vit_(?P<size>[a-z]+)_patch(?P<patch>\d+)_(?P<img>\d+)$")


def vit_config(name: str) -> dict:
    """Constructor arguments of a named variant ``vit_{size}_patch{P}_{img}``."""
    m = _NAME_RE.match(name)
    if m is None or m["size"] not in VIT_SIZES:
        raise ValueError(
            f"unknown ViT variant {name!r}; allowed: vit_{{{','.join(VIT_SIZES)}}}_patch{{P}}_{{img}}, "
            "e.g. vit_base_patch16_224"
        )
    dim, depth, heads = VIT_SIZES[m["size"]]
    return dict(
        img_size=int(m["img"]),
        patch_size=int(m["patch"]),
        embed_dim=dim,
        depth=depth,
        num_heads=heads,
    )


def full_vit_config(model_kwargs: dict) -> dict:
    """A variant name plus overrides (``{"name": ..., "embed_dim": 128}``; None: not set, as a run's
    config.json writes it) -> the constructor arguments that build it."""
    overrides = {k: v for k, v in model_kwargs.items() if k != "name" and v is not None}
    return {**vit_config(model_kwargs["name"]), **overrides}


def create_vit(name: str, **overrides) -> VisionTransformer:
    """timm-like factory: ``create_vit("vit_base_patch16_224", img_size=32, attn_backend="sdpa")``."""
    return VisionTransformer(**{**vit_config(name), **overrides})
