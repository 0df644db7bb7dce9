"""Mask generators (one interface, batched on the device, exact counts) and the typed ``masking``
config section (docs/ARCHITECTURE.md §3.1, §4.5). Bad settings raise ``ValueError`` at
construction; ``python -m mpp.tools.masking_viz`` draws the masks."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

import torch
from pydantic import BeforeValidator, Field
from torch import Tensor

from mpp.ops import to_2tuple
from mpp.sections import Section


def num_masked(num_patches: int, ratio: float) -> int:
    """round(ratio * N), halves rounded up (Python's round() rounds halves to even)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"mask ratio must be in [0, 1], got {ratio}")
    return int(math.floor(ratio * num_patches + 0.5))


def mask_indices(mask: Tensor, num_masked: int) -> tuple[Tensor, Tensor]:
    """Split an exact-count mask into (visible_idx (B, N_vis), masked_idx (B, N_mask)), each in
    ascending order: a stable argsort and a static slice, no host sync (docs/ARCHITECTURE.md §3.1)."""
    n_vis = mask.shape[1] - num_masked
    order = torch.argsort(mask.to(torch.int8), dim=1, stable=True)
    return order[:, :n_vis], order[:, n_vis:]


def topk_mask(scores: Tensor, k: int) -> Tensor:
    """Bool mask (B, N) with True at the k highest scores of each row."""
    mask = torch.zeros_like(scores, dtype=torch.bool)
    if k > 0:
        mask.scatter_(1, scores.topk(k, dim=1).indices, True)
    return mask


class MaskGenerator(ABC):
    """Makes (B, N) bool masks over a (H, W) patch grid with an exact masked count."""

    def __init__(self, grid_size: tuple[int, int], mask_ratio: float) -> None:
        self.grid_size = to_2tuple(grid_size, "grid_size")
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.mask_ratio = mask_ratio
        self.num_masked = num_masked(self.num_patches, mask_ratio)

    @abstractmethod
    def __call__(
        self,
        batch_size: int,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ) -> Tensor: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}(grid={self.grid_size}, ratio={self.mask_ratio}, masked={self.num_masked})"


class RandomMask(MaskGenerator):
    """MAE's uniform random masking: the k highest of per-sample uniform noise are masked."""

    def __call__(self, batch_size, device="cpu", generator=None):
        noise = torch.rand(batch_size, self.num_patches, device=device, generator=generator)
        return topk_mask(noise, self.num_masked)


def _rect_sums(mask: Tensor, top: Tensor, left: Tensor, h: Tensor, w: Tensor) -> Tensor:
    """True count of mask (B, H, W) inside each rectangle (B, T), from its integral image."""
    B, H, W = mask.shape
    integral = torch.zeros(B, H + 1, W + 1, dtype=torch.long, device=mask.device)
    integral[:, 1:, 1:] = mask.long().cumsum(1).cumsum(2)
    flat = integral.flatten(1)  # (B, (H + 1) (W + 1))

    def at(y: Tensor, x: Tensor) -> Tensor:
        return flat.gather(1, y * (W + 1) + x)

    return at(top + h, left + w) - at(top, left + w) - at(top + h, left) + at(top, left)


class Blocks(NamedTuple):
    """The blocks a ``BlockMask`` call accepted, one row each (all 1-D tensors)."""

    sample: Tensor
    """Which sample of the batch."""
    top: Tensor
    left: Tensor
    height: Tensor
    width: Tensor
    area: Tensor
    """The drawn target area."""
    aspect: Tensor
    """The drawn aspect ratio r = h/w before rounding."""


class BlockMask(MaskGenerator):
    """BEiT's blockwise masking (Bao et al. 2021, Alg. 1), made exact-count by ranking
    (docs/ARCHITECTURE.md §4.5). Rounds of block proposals run for the whole batch at once (the
    ``max_tries`` tries of a round are drawn together; the first acceptable one wins, as in
    BEiT's sequential loop)."""

    def __init__(
        self,
        grid_size: tuple[int, int],
        mask_ratio: float,
        *,
        min_num_patches: int,
        max_num_patches: int | None,
        min_aspect: float,
        max_aspect: float | None,
        max_tries: int,
    ) -> None:
        super().__init__(grid_size, mask_ratio)
        max_aspect = 1.0 / min_aspect if max_aspect is None and min_aspect > 0 else max_aspect
        if min_num_patches < 1:
            raise ValueError(f"block masking: min_num_patches must be >= 1, got {min_num_patches}")
        if max_num_patches is not None and max_num_patches < 1:
            raise ValueError(
                f"block masking: max_num_patches must be >= 1 or None, got {max_num_patches}"
            )
        if not (min_aspect > 0 and max_aspect >= min_aspect):
            raise ValueError(
                f"block masking: need 0 < min_aspect <= max_aspect, got {min_aspect}, {max_aspect}"
            )
        if max_tries < 1:
            raise ValueError(f"block masking: max_tries must be >= 1, got {max_tries}")
        self.min_num_patches = min_num_patches
        self.max_num_patches = max_num_patches or self.num_patches
        self.log_aspect = (math.log(min_aspect), math.log(max_aspect))
        self.max_tries = max_tries

    def propose(self, batch_size: int, device="cpu", generator=None) -> tuple[Tensor, Blocks]:
        """BEiT's block proposal: (B, H, W) bool union of accepted blocks, and the blocks."""
        H, W = self.grid_size
        mask = torch.zeros(batch_size, H, W, dtype=torch.bool, device=device)
        count = torch.zeros(batch_size, dtype=torch.long, device=device)
        active = torch.ones(batch_size, dtype=torch.bool, device=device)
        rows, cols = torch.arange(H, device=device), torch.arange(W, device=device)
        picked = torch.arange(batch_size, device=device)
        records = []
        while True:
            active &= count < self.num_masked
            if not bool(active.any()):  # one host sync per round; <= num_masked rounds
                break
            budget = (self.num_masked - count).clamp(max=self.max_num_patches)[:, None]  # (B, 1)
            # (B, T) each
            top, left, h, w, area, aspect = tries = self._draw_blocks(budget, generator)
            new = h * w - _rect_sums(mask, top, left, h, w)  # (B, T) patches a block would add
            ok = (h < H) & (w < W) & (new > 0) & (new <= budget) & active[:, None]
            accepted = ok.any(1)  # (B,)
            first = ok.int().argmax(1)  # the first acceptable try wins, as in BEiT's loop
            top, left, h, w, area, aspect = (x[picked, first] for x in tries)  # (B,) each
            in_rows = (rows >= top[:, None]) & (rows < (top + h)[:, None])  # (B, H)
            in_cols = (cols >= left[:, None]) & (cols < (left + w)[:, None])  # (B, W)
            mask |= in_rows[:, :, None] & in_cols[:, None, :] & accepted[:, None, None]
            count += new[picked, first] * accepted
            active &= accepted  # BEiT stops once a round adds nothing
            records.append((accepted, picked, top, left, h, w, area, aspect))
        if not records:
            empty = torch.zeros(0, device=device)
            return mask, Blocks(*(empty.long(),) * 5, empty, empty)
        accepted, *fields = (torch.cat(x) for x in zip(*records, strict=True))
        return mask, Blocks(*(f[accepted] for f in fields))

    def _draw_blocks(self, budget: Tensor, generator) -> tuple[Tensor, ...]:
        """``max_tries`` BEiT block draws per sample: (top, left, h, w, area, aspect), each (B, T)."""
        (H, W), (log_lo, log_hi) = self.grid_size, self.log_aspect
        u = torch.rand(
            budget.shape[0], self.max_tries, 4, device=budget.device, generator=generator
        )
        # random.uniform(a, b) = a + (b - a) u, also when budget < min_num_patches
        area = self.min_num_patches + (budget - self.min_num_patches) * u[..., 0]
        aspect = torch.exp(log_lo + (log_hi - log_lo) * u[..., 1])
        h = torch.round(torch.sqrt(area * aspect)).long().clamp(max=H)  # clamped draws are rejected
        w = torch.round(torch.sqrt(area / aspect)).long().clamp(max=W)
        top = (u[..., 2] * (H - h + 1)).long()  # randint(0, H - h)
        left = (u[..., 3] * (W - w + 1)).long()
        return top, left, h, w, area, aspect

    def __call__(self, batch_size, device="cpu", generator=None, *, return_blocks: bool = False):
        blocks_mask, blocks = self.propose(batch_size, device, generator)
        noise = torch.rand(batch_size, self.num_patches, device=device, generator=generator)
        mask = topk_mask(blocks_mask.flatten(1).float() + noise, self.num_masked)  # blocks first
        return (mask, blocks) if return_blocks else mask


class GridMask(MaskGenerator):
    """MAE's grid-wise sampling: keep one patch of every 2×2 cell (ratio 0.75 exactly).

    ``offset`` picks the kept patch of each cell: ``"fixed"`` (default, MAE's regular grid:
    the top-left one, identical for every sample), ``"image"`` (one random position per
    sample, shared by its cells: a shifted regular grid) or ``"cell"`` (random per cell and
    sample: still 1 of 4 kept in every cell, no longer a lattice).
    """

    OFFSETS = ("fixed", "image", "cell")

    def __init__(
        self, grid_size: tuple[int, int], mask_ratio: float = 0.75, *, offset: str
    ) -> None:
        super().__init__(grid_size, mask_ratio)
        H, W = self.grid_size
        if offset not in self.OFFSETS:
            raise ValueError(f"grid masking: unknown offset {offset!r}; allowed: {self.OFFSETS}")
        if mask_ratio != 0.75:
            raise ValueError(
                f"grid masking keeps one patch of every 2x2 cell, so mask_ratio must be 0.75, got {mask_ratio}"
            )
        kept = math.ceil(H / 2) * math.ceil(W / 2)  # one per (possibly cut) cell
        if (H % 2 or W % 2) and (offset != "fixed" or self.num_patches - kept != self.num_masked):
            raise ValueError(
                f"grid masking on an odd {H}x{W} grid masks {self.num_patches - kept} patches, not "
                f"round(0.75*{self.num_patches}) = {self.num_masked}; use an even grid"
            )
        self.offset = offset

    def __call__(self, batch_size, device="cpu", generator=None):
        H, W = self.grid_size
        ch, cw = math.ceil(H / 2), math.ceil(W / 2)
        if self.offset == "fixed":
            kept = torch.zeros(batch_size, ch, cw, dtype=torch.long, device=device)
        else:
            shape = (batch_size, 1, 1) if self.offset == "image" else (batch_size, ch, cw)
            draw = 4 * torch.rand(shape, device=device, generator=generator)
            kept = draw.long().expand(-1, ch, cw)
        kept = kept.repeat_interleave(2, 1).repeat_interleave(2, 2)[:, :H, :W]  # (B, H, W)
        rows, cols = torch.arange(H, device=device), torch.arange(W, device=device)
        in_cell = 2 * (rows[:, None] % 2) + cols[None, :] % 2  # (H, W) position within its cell
        return (in_cell != kept).flatten(1)


class CenterMask(MaskGenerator):
    """A central block: the ``num_masked`` patches nearest the grid centre, by Chebyshev distance
    in grid-relative units, then Euclidean, then index (docs/ARCHITECTURE.md §4.5). ``jitter`` > 0
    moves each sample's centre by U[-jitter, jitter] patches per axis (the block is cut at the
    image border and grows inward, keeping the count)."""

    def __init__(self, grid_size: tuple[int, int], mask_ratio: float, *, jitter: float) -> None:
        super().__init__(grid_size, mask_ratio)
        if jitter < 0:
            raise ValueError(f"center masking: jitter must be >= 0 patches, got {jitter}")
        self.jitter = jitter

    def __call__(self, batch_size, device="cpu", generator=None):
        H, W = self.grid_size
        shift = torch.zeros(batch_size, 2, device=device)
        if self.jitter > 0:
            shift = self.jitter * (
                2 * torch.rand(batch_size, 2, device=device, generator=generator) - 1
            )
        dy = (torch.arange(H, device=device) - (H - 1) / 2 - shift[:, :1]).abs() / H  # (B, H)
        dx = (torch.arange(W, device=device) - (W - 1) / 2 - shift[:, 1:]).abs() / W  # (B, W)
        cheb = torch.maximum(dy[:, :, None], dx[:, None, :]).flatten(1)  # (B, N)
        eucl = (dy[:, :, None] ** 2 + dx[:, None, :] ** 2).flatten(1)
        # lexicographic (cheb, eucl, index): stable sort by the minor key, then the major
        order = torch.argsort(eucl, dim=1, stable=True)
        order = order.gather(1, torch.argsort(cheb.gather(1, order), dim=1, stable=True))
        mask = torch.zeros(batch_size, self.num_patches, dtype=torch.bool, device=device)
        return mask.scatter_(1, order[:, : self.num_masked], True)


class UnitMask(MaskGenerator):
    """SimMIM's random masking on coarse mask units of ``unit_size`` × ``unit_size`` patches.

    SimMIM masks 32-px units over 4-px (Swin) patches; here a unit is given in patches.
    Whole units only, so ``round(ratio * N)`` must be a multiple of the unit area.
    """

    def __init__(
        self, grid_size: tuple[int, int], mask_ratio: float, *, unit_size: int | tuple[int, int]
    ) -> None:
        super().__init__(grid_size, mask_ratio)
        (H, W), (uh, uw) = self.grid_size, to_2tuple(unit_size, "unit_size")
        if H % uh or W % uw:
            raise ValueError(
                f"units masking: unit_size {unit_size} must divide the {H}x{W} patch grid"
            )
        area, n_units = uh * uw, (H // uh) * (W // uw)
        if self.num_masked % area:
            lo, hi = self.num_masked // area, self.num_masked // area + 1
            raise ValueError(
                f"units masking: mask_ratio {mask_ratio} masks round({mask_ratio}*{self.num_patches}) = "
                f"{self.num_masked} patches, not a multiple of the {uh}x{uw} unit area {area}; "
                f"reachable ratios nearby: {lo / n_units:.4f} ({lo} units), {min(hi, n_units) / n_units:.4f}"
            )
        self.unit_size, self.unit_grid = (uh, uw), (H // uh, W // uw)
        self.num_masked_units = self.num_masked // area

    def __call__(self, batch_size, device="cpu", generator=None):
        (uh, uw), (gh, gw) = self.unit_size, self.unit_grid
        noise = torch.rand(batch_size, gh * gw, device=device, generator=generator)
        units = topk_mask(noise, self.num_masked_units).view(batch_size, gh, 1, gw, 1)
        return units.expand(-1, -1, uh, -1, uw).reshape(batch_size, self.num_patches)


# ---- the config's ``masking`` section, typed: one model per strategy keyed on ``strategy`` --


class _Strategy(Section):
    """A strategy's own parameters and the only place of their defaults (its generator takes them
    as required keywords); the ratio comes from the objective and the grid from the encoder."""

    generator: ClassVar[type[MaskGenerator]]

    def build(self, grid_size: tuple[int, int], mask_ratio: float) -> MaskGenerator:
        return self.generator(grid_size, mask_ratio, **self.model_dump(exclude={"strategy"}))


class RandomMasking(_Strategy):
    generator = RandomMask
    strategy: Literal["random"] = "random"
    """random: uniform, an exact count per image (MAE)."""


class BlockMasking(_Strategy):
    generator = BlockMask
    strategy: Literal["block"] = "block"
    """block: BEiT's blockwise masking, made exact by ranking."""
    min_num_patches: int = 16
    """The smallest block, in patches."""
    max_num_patches: int | None = None
    """The largest block, in patches; None: what is left of the budget."""
    min_aspect: float = 0.3
    """The blocks' aspect ratios, log-uniform in [min_aspect, max_aspect]."""
    max_aspect: float | None = None
    """None: 1 / min_aspect."""
    max_tries: int = 10
    """Draws per block before another is tried."""


class GridMasking(_Strategy):
    generator = GridMask
    strategy: Literal["grid"] = "grid"
    """grid: one patch of every 2 x 2 kept (ratio 0.75)."""
    offset: str = "fixed"
    """GridMask.OFFSETS; checked (and named) by the constructor."""


class CenterMasking(_Strategy):
    generator = CenterMask
    strategy: Literal["center"] = "center"
    """center: one central block of the ratio's area."""
    jitter: float = 0.0
    """How far the block's centre moves, as a share of the grid."""


class UnitMasking(_Strategy):
    generator = UnitMask
    strategy: Literal["units"] = "units"
    """units: SimMIM-style random masking of coarse units."""
    unit_size: int | tuple[int, int] = 2
    """The unit's side in patches (an int or a pair); it must divide the grid."""


MASKING_CONFIGS: dict[str, type[_Strategy]] = {
    c.model_fields["strategy"].default: c
    for c in (RandomMasking, BlockMasking, GridMasking, CenterMasking, UnitMasking)
}


def _random_by_default(raw: Any) -> Any:
    """A section that names no strategy is random masking's (the default)."""
    return {"strategy": "random", **raw} if isinstance(raw, dict) else raw


MaskingConfig = Annotated[
    RandomMasking | BlockMasking | GridMasking | CenterMasking | UnitMasking,
    Field(discriminator="strategy"),
    BeforeValidator(_random_by_default),
]


def build_mask_generator(
    strategy: str, grid_size: tuple[int, int], mask_ratio: float, **params
) -> MaskGenerator:
    """Build a generator by name through its typed section (``MASKING_CONFIGS``); unknown
    names or parameters, and settings the strategy cannot honour exactly, raise ``ValueError``."""
    if strategy not in MASKING_CONFIGS:
        raise ValueError(
            f"unknown masking strategy {strategy!r}; allowed: {sorted(MASKING_CONFIGS)}"
        )
    section = MASKING_CONFIGS[strategy]
    allowed = [k for k in section.model_fields if k != "strategy"]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {unknown} for masking strategy {strategy!r}; allowed: {allowed}"
        )
    return section(**params).build(grid_size, mask_ratio)
