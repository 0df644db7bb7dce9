"""Mask generators (mpp/masking.py): exact counts, seeding, and each strategy's shape."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from mpp.masking import (
    MASKING_CONFIGS,
    BlockMask,
    RandomMask,
    build_mask_generator,
    mask_indices,
    num_masked,
    topk_mask,
)
from mpp.objectives.hpm_mask import HardPatchMask, hard_patch_mask


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Masks are tiny tensors: on shared cores, OpenMP barriers across 2 threads made the
    block tests 5-100x slower (measured 30 ms vs 0.16-3.9 s per 256 masks) for no gain."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


GRIDS = [(14, 14), (8, 8), (8, 12)]  # ViT-B/16 at 224, a small grid, a non-square one
B = 64

# a stochastic setting of every strategy (fixed grid / un-jittered centre are tested apart)
STRATEGIES = {
    "random": {},
    "block": {},
    "grid": {"offset": "cell"},
    "grid_image": {"offset": "image"},
    "center": {"jitter": 2.0},
    "units": {"unit_size": 2},
    "hpm": {"hard_ratio": 0.5},
}


def ratio_for(strategy: str, grid: tuple[int, int]) -> float:
    if strategy == "units" and grid == (14, 14):
        return 36 / 49  # 0.75 masks 147 patches, not whole 2x2 units
    return 0.75


def make(strategy: str, grid: tuple[int, int], ratio: float | None = None):
    name = "grid" if strategy == "grid_image" else strategy
    if name == "hpm":  # HPM's own policy (mpp.objectives.hpm_mask), not a config's strategy
        return HardPatchMask(grid, 0.75 if ratio is None else ratio, **STRATEGIES[strategy])
    return build_mask_generator(
        name, grid, ratio_for(strategy, grid) if ratio is None else ratio, **STRATEGIES[strategy]
    )


def sample(gen, batch: int, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator(device).manual_seed(seed)
    if isinstance(gen, HardPatchMask):  # scores from their own seed: only the mask's rng varies
        scores = torch.rand(
            batch, gen.num_patches, generator=torch.Generator().manual_seed(123)
        ).to(device)
        return gen(batch, device, g, scores=scores)
    return gen(batch, device, g)


def neighbours_masked(mask: torch.Tensor, grid: tuple[int, int]) -> float:
    """Mean number of masked 4-neighbours per masked patch."""
    m = mask.view(-1, *grid).float()
    padded = torch.nn.functional.pad(m, (1, 1, 1, 1))
    around = padded[:, :-2, 1:-1] + padded[:, 2:, 1:-1] + padded[:, 1:-1, :-2] + padded[:, 1:-1, 2:]
    return ((around * m).sum() / m.sum()).item()


def distance_from_centre(mask: torch.Tensor, grid: tuple[int, int]) -> float:
    """Mean Euclidean distance (in patches) of masked patches from the grid centre."""
    H, W = grid
    y, x = torch.meshgrid(
        torch.arange(H) - (H - 1) / 2, torch.arange(W) - (W - 1) / 2, indexing="ij"
    )
    dist = (y**2 + x**2).sqrt().flatten()
    return ((mask.float() * dist).sum() / mask.sum()).item()


# ---- every strategy -------------------------------------------------------------------------


def test_registry_has_every_strategy():
    assert set(MASKING_CONFIGS) == {"random", "block", "grid", "center", "units"}


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_exact_count_seeded_and_varied(strategy, grid):
    gen = make(strategy, grid)
    masks = sample(gen, B, seed=0)
    assert masks.shape == (B, grid[0] * grid[1]) and masks.dtype == torch.bool
    assert gen.num_masked == num_masked(grid[0] * grid[1], ratio_for(strategy, grid))
    assert (masks.sum(1) == gen.num_masked).all()
    assert torch.equal(masks, sample(gen, B, seed=0)), "same seed must give the same masks"
    assert not torch.equal(masks, sample(gen, B, seed=1)), "another seed must give other masks"
    distinct = torch.unique(masks, dim=0).shape[0]
    if strategy == "grid_image":  # 4 shifts of one lattice: all of them occur
        assert distinct == 4
    elif strategy == "center":  # a jittered centre takes a limited number of shapes
        assert distinct >= 8
    else:
        assert distinct > B // 2, "samples of a batch must differ"


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.4, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("strategy", ["random", "block", "center", "hpm"])
def test_exact_count_at_any_ratio(strategy, ratio):
    for grid in GRIDS:
        gen = make(strategy, grid, ratio)
        assert (sample(gen, 32, seed=0).sum(1) == num_masked(grid[0] * grid[1], ratio)).all()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_masks_split_into_dense_indices(strategy):
    gen = make(strategy, (8, 8))
    mask = sample(gen, 4, seed=0)
    visible, masked = mask_indices(mask, gen.num_masked)
    assert not mask.gather(1, visible).any() and mask.gather(1, masked).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_generated_on_cuda(strategy):
    gen = make(strategy, (14, 14))
    masks = sample(gen, B, seed=0, device="cuda")
    assert masks.device.type == "cuda" and (masks.sum(1) == gen.num_masked).all()
    assert torch.equal(masks, sample(gen, B, seed=0, device="cuda"))


# ---- block ----------------------------------------------------------------------------------


@pytest.mark.parametrize("grid", GRIDS)
def test_block_aspect_ratios_and_block_geometry(grid):
    gen = build_mask_generator("block", grid, 0.5)
    mask, blocks = gen(256, generator=torch.Generator().manual_seed(0), return_blocks=True)
    assert len(blocks.sample) > 256, "expected several accepted blocks per sample"
    assert (blocks.aspect >= 0.3 - 1e-6).all() and (blocks.aspect <= 1 / 0.3 + 1e-6).all()
    # log-uniform over the whole range, not a constant: both tall and wide blocks occur
    assert blocks.aspect.min() < 0.5 and blocks.aspect.max() > 2.0
    # h, w follow BEiT's rounding of the drawn area and aspect; blocks fit strictly inside
    assert torch.equal(blocks.height, torch.round(torch.sqrt(blocks.area * blocks.aspect)).long())
    assert torch.equal(blocks.width, torch.round(torch.sqrt(blocks.area / blocks.aspect)).long())
    assert (blocks.height < grid[0]).all() and (blocks.width < grid[1]).all()
    assert (blocks.top + blocks.height <= grid[0]).all() and (
        blocks.left + blocks.width <= grid[1]
    ).all()
    # every accepted block lies wholly inside the final mask (the top-up never trims a block)
    m = mask.view(-1, *grid)
    for i in torch.randperm(len(blocks.sample))[:200].tolist():
        s, t, lft, h, w = (int(x[i]) for x in blocks[:5])
        assert m[s, t : t + h, lft : lft + w].all()


def test_block_proposals_nearly_fill_the_budget_on_14x14():
    """BEiT's proposal alone reaches ~99 % of the target (74.5 of 75); the random top-up is small."""
    gen = build_mask_generator("block", (14, 14), 0.4)
    proposal, _ = gen.propose(512, generator=torch.Generator().manual_seed(0))
    counts = proposal.flatten(1).sum(1)
    assert (counts <= gen.num_masked).all()
    assert counts.float().mean() > 0.97 * gen.num_masked


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("ratio,margin", [(0.4, 1.2), (0.75, 0.5)])
def test_block_masks_are_clustered(grid, ratio, margin):
    # measured (seed 0, 256 masks): 14x14 3.36 vs 1.48 at 0.4, 3.59 vs 2.79 at 0.75; 8x8 3.33 vs 2.60 at 0.75
    g = torch.Generator().manual_seed(0)
    block = neighbours_masked(build_mask_generator("block", grid, ratio)(256, generator=g), grid)
    rand = neighbours_masked(RandomMask(grid, ratio)(256, generator=g), grid)
    assert block > rand + margin, (block, rand)


def test_block_on_a_tiny_grid_still_exact():
    """On 4x4, BEiT's areas >= 8 rarely fit strictly inside: its proposal mostly masks nothing."""
    gen = build_mask_generator("block", (4, 4), 0.5)
    g = torch.Generator().manual_seed(0)
    proposal, _ = gen.propose(64, generator=g)
    assert (proposal.flatten(1).sum(1) == 0).float().mean() > 0.5
    assert (gen(64, generator=g).sum(1) == 8).all()


# ---- grid -----------------------------------------------------------------------------------


@pytest.mark.parametrize("grid", GRIDS)
def test_grid_fixed_is_maes_2x2_pattern(grid):
    H, W = grid
    i, j = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    expected = ~((i % 2 == 0) & (j % 2 == 0))  # keep the top-left patch of every 2x2 cell
    masks = build_mask_generator("grid", grid, 0.75)(8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(masks, expected.flatten().expand(8, -1))


def test_grid_random_offsets_keep_one_per_cell():
    H, W = 8, 12
    g = torch.Generator().manual_seed(0)
    cells = build_mask_generator("grid", (H, W), 0.75, offset="cell")(B, generator=g).view(
        B, H // 2, 2, W // 2, 2
    )
    kept = (~cells).sum((2, 4))
    assert (kept == 1).all()
    kept_pos = (~cells).permute(0, 1, 3, 2, 4).reshape(B, -1, 4).float().argmax(-1)
    assert kept_pos.unique().numel() == 4 and (kept_pos != kept_pos[:, :1]).any()

    i, j = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    shifted = [~((i % 2 == dy) & (j % 2 == dx)).flatten() for dy in (0, 1) for dx in (0, 1)]
    for m in build_mask_generator("grid", (H, W), 0.75, offset="image")(B, generator=g):
        assert any(torch.equal(m, s) for s in shifted)


# ---- center ---------------------------------------------------------------------------------


def test_center_is_the_central_square():
    mask = build_mask_generator("center", (8, 8), 36 / 64)(3).view(3, 8, 8)
    expected = torch.zeros(8, 8, dtype=torch.bool)
    expected[1:7, 1:7] = True
    assert torch.equal(mask, expected.expand(3, -1, -1))
    mask = build_mask_generator("center", (8, 12), 0.25)(1).view(
        8, 12
    )  # 24 = 4x6: the grid's aspect
    expected = torch.zeros(8, 12, dtype=torch.bool)
    expected[2:6, 3:9] = True
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("jitter,margin", [(0.0, 0.75), (2.0, 0.85)])
def test_center_masks_the_central_patches(grid, jitter, margin):
    # measured at ratio 0.5: ~0.70 of random's mean distance un-jittered, <= 0.80 with jitter 2
    g = torch.Generator().manual_seed(0)
    centre = distance_from_centre(
        build_mask_generator("center", grid, 0.5, jitter=jitter)(256, generator=g), grid
    )
    rand = distance_from_centre(RandomMask(grid, 0.5)(256, generator=g), grid)
    assert centre < margin * rand, (centre, rand)
    if jitter == 0:
        # every masked patch is at least as central (Chebyshev, grid-relative) as every visible one
        H, W = grid
        y, x = torch.meshgrid(
            torch.arange(H) - (H - 1) / 2, torch.arange(W) - (W - 1) / 2, indexing="ij"
        )
        cheb = torch.maximum(y.abs() / H, x.abs() / W).flatten()
        mask = build_mask_generator("center", grid, 0.5)(1)[0]
        assert cheb[mask].max() <= cheb[~mask].min()


# ---- units ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grid,unit,ratio",
    [((14, 14), 2, 36 / 49), ((14, 14), 7, 0.75), ((8, 8), 2, 0.75), ((8, 12), 4, 0.5)],
)
def test_units_are_whole_units(grid, unit, ratio):
    (H, W), n = grid, 64
    gen = build_mask_generator("units", grid, ratio, unit_size=unit)
    masks = gen(n, generator=torch.Generator().manual_seed(0))
    units = (
        masks.view(n, H // unit, unit, W // unit, unit)
        .permute(0, 1, 3, 2, 4)
        .reshape(n, -1, unit * unit)
    )
    assert (units.all(-1) | ~units.any(-1)).all(), "a unit must be masked whole or not at all"
    assert (units.all(-1).sum(1) == gen.num_masked_units).all()


# ---- hpm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("hard_ratio", [0.0, 0.5, 1.0])
def test_hpm_masks_the_hardest_patches(hard_ratio):
    gen = HardPatchMask((14, 14), 0.75, hard_ratio=hard_ratio)
    scores = torch.randn(B, 196, generator=torch.Generator().manual_seed(1))
    k = int(147 * hard_ratio)
    mask, hard = gen(B, scores=scores, generator=torch.Generator().manual_seed(0), return_hard=True)
    assert (mask.sum(1) == 147).all() and (hard.sum(1) == k).all()
    assert torch.equal(hard, topk_mask(scores, k)) and not (hard & ~mask).any()
    # the random rest: other seeds pick other patches beyond the hard ones
    other = gen(B, scores=scores, generator=torch.Generator().manual_seed(1))
    assert torch.equal(mask, other) == (k == 147)


def test_hpm_schedule_per_call_and_policy_function():
    gen = HardPatchMask((8, 8), 0.75)
    scores = torch.arange(64.0).expand(4, -1)  # the last patches are the hardest
    g = torch.Generator().manual_seed(0)
    assert gen(4, generator=g, scores=scores, hard_ratio=1.0)[:, 16:].all()
    assert gen(4, generator=g, scores=scores, num_hard=10)[:, -10:].all()
    assert gen.num_hard(0.5) == 24 and gen.num_hard() == 0
    assert (gen(4, generator=g).sum(1) == 48).all(), "hard_ratio 0 needs no scores"
    # the strategy is the HPM objective's own policy function, draw for draw
    mask, hard = gen(
        4, generator=torch.Generator().manual_seed(3), scores=scores, num_hard=20, return_hard=True
    )
    ref_mask, ref_hard = hard_patch_mask(scores, 48, 20, generator=torch.Generator().manual_seed(3))
    assert torch.equal(mask, ref_mask) and torch.equal(hard, ref_hard) and hard[:, -20:].all()


def test_hpm_bad_calls():
    gen = HardPatchMask((8, 8), 0.75, hard_ratio=0.5)
    with pytest.raises(ValueError, match="needs scores"):
        gen(4)
    with pytest.raises(ValueError, match=r"scores must be \(4, 64\)"):
        gen(4, scores=torch.rand(4, 63))
    with pytest.raises(ValueError, match="hard_ratio must be in"):
        gen(4, scores=torch.rand(4, 64), hard_ratio=1.5)


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "strategy,ratio,params,message",
    [
        (
            "nope",
            0.75,
            {},
            r"unknown masking strategy 'nope'; allowed: \['block', 'center', 'grid', 'random', 'units'\]",
        ),
        ("grid", 0.6, {}, r"mask_ratio must be 0.75, got 0.6"),
        ("grid", 0.75, {"offset": "diagonal"}, r"unknown offset 'diagonal'"),
        ("units", 0.75, {"unit_size": 3}, r"unit_size 3 must divide the 14x14 patch grid"),
        (
            "units",
            0.75,
            {"unit_size": 2},
            r"147 patches, not a multiple of the 2x2 unit area 4.*0\.7347 \(36 units\), 0\.7551",
        ),
        ("units", 0.75, {"unit_size": 0}, r"unit_size must be a positive int"),
        ("block", 0.75, {"min_aspect": 0.0}, r"0 < min_aspect <= max_aspect"),
        ("block", 0.75, {"min_num_patches": 0}, r"min_num_patches must be >= 1, got 0"),
        ("center", 0.75, {"jitter": -1}, r"jitter must be >= 0"),
        (
            "block",
            0.75,
            {"aspect": 2.0},
            r"unknown parameter\(s\) \['aspect'\] for masking strategy 'block'",
        ),
    ],
)
def test_bad_settings_raise_at_construction(strategy, ratio, params, message):
    with pytest.raises(ValueError, match=message):
        build_mask_generator(strategy, (14, 14), ratio, **params)


@pytest.mark.parametrize("strategy", sorted(MASKING_CONFIGS))
@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_ratio_outside_unit_interval(strategy, ratio):
    with pytest.raises(ValueError, match=rf"mask ratio must be in \[0, 1\], got {ratio}"):
        build_mask_generator(strategy, (8, 8), ratio)


def test_grid_rejects_odd_grids_and_bad_sizes():
    with pytest.raises(
        ValueError, match=r"odd 7x7 grid masks 33 patches, not round\(0.75\*49\) = 37"
    ):
        build_mask_generator("grid", (7, 7), 0.75)
    with pytest.raises(ValueError, match="grid_size must be a positive int"):
        RandomMask((0, 14), 0.5)


# ---- helpers kept for other modules ---------------------------------------------------------


def test_num_masked_rounds_halves_up():
    assert num_masked(196, 0.75) == 147 and num_masked(98, 0.5) == 49 and num_masked(6, 0.75) == 5
    assert num_masked(196, 0.4) == round(0.4 * 196) == 78


def test_mask_picture(tmp_path):
    from mpp.tools.masking_viz import GREY, grey_out, main

    out = tmp_path / "masks.png"
    main(["--out", str(out), "--grid", "8", "--patch", "8", "--samples", "2"])
    from PIL import Image

    sheet = Image.open(out)
    assert sheet.size[1] == 7 * (8 * 8 + 4)  # one row per strategy setting
    image = torch.randint(0, 256, (32, 32, 3), dtype=torch.uint8).numpy()
    mask = torch.zeros(16, dtype=torch.bool)
    mask[5] = True  # patch (1, 1) of a 4x4 grid of 8-px patches
    out_img = grey_out(image, mask, 4)
    assert (out_img[8:16, 8:16] == GREY).all()
    assert (out_img[:8] == image[:8]).all() and (out_img[16:] == image[16:]).all()


def test_float_ratios_meet_registry_defaults():
    # 0.75 of a 14x14 grid is 147 for every strategy that accepts it
    for name in ("random", "block", "grid", "center"):
        assert build_mask_generator(name, (14, 14), 0.75).num_masked == 147
    assert HardPatchMask((14, 14), 0.75).num_masked == 147
    assert math.isclose(
        build_mask_generator("units", (14, 14), 0.75, unit_size=7).num_masked / 196, 0.75
    )


@pytest.mark.parametrize("objective", ["mae", "mpp"])
def test_a_config_cannot_choose_hpms_own_mask(objective):
    """masking.strategy="hpm" needs a teacher's scores at every step: a config asking for it
    under MAE or MPP is refused when it loads, naming the key and what to set instead."""
    from mpp.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match=r'masking.strategy: "hpm" masks .* set objective.name="hpm"'
    ):
        load_config(f"{objective}_demo", ['masking.strategy="hpm"'])


# ---- the config's typed masking section -----------------------------------------------------


@pytest.mark.parametrize("strategy", sorted(MASKING_CONFIGS))
def test_each_default_lives_in_the_typed_section_alone(strategy):
    """The generators take their strategy's parameters as required keywords (no default that
    could drift from the section's), exactly the section's keys."""
    params = inspect.signature(MASKING_CONFIGS[strategy].generator).parameters
    own = {k: p for k, p in params.items() if k not in ("grid_size", "mask_ratio")}
    assert all(p.kind is p.KEYWORD_ONLY and p.default is p.empty for p in own.values()), own
    assert set(MASKING_CONFIGS[strategy]().model_dump()) - {"strategy"} == set(own)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (['masking.strategy="blocks"'], "masking.strategy: Input should be 'random', 'block', "),
        (['masking.strategy="block"', "masking.aspect=2"], "masking.aspect: unknown key"),
        (
            ['masking.strategy="block"', 'masking.min_aspect="wide"'],
            "masking.min_aspect: Input should be a valid number",
        ),
        (["masking.jitter=1"], "masking.jitter: unknown key"),  # random's: no parameters
        (
            ['objective.name="hpm"', 'masking.strategy="block"'],
            'masking: objective.name="hpm" chooses its own masks',
        ),
    ],
)
def test_a_bad_masking_key_is_named_with_the_file(overrides, message):
    from mpp.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config("mae_demo", overrides)
    s = str(err.value)
    assert "configs/mae_demo.json" in s and message in s, s
    if message.startswith("masking."):  # the key came from --set: said so
        assert s.startswith("--set masking."), s


def test_the_masking_section_builds_and_round_trips(tmp_path):
    """A section without ``strategy`` is random masking; a chosen one builds its generator at
    the objective's ratio, and a saved config.json loads back to the same section."""
    from mpp.build import build_objective
    from mpp.config import load_config, save_config

    assert load_config("mae_demo").masking == MASKING_CONFIGS["random"]()
    cfg = load_config("mae_demo", ['masking.strategy="block"', "masking.min_num_patches=4"])
    gen = build_objective(cfg).mask_generator
    assert isinstance(gen, BlockMask) and gen.min_num_patches == 4
    assert gen.num_masked == round(cfg.objective.mask_ratio * gen.num_patches)
    save_config(cfg, tmp_path / "config.json")
    assert load_config(tmp_path / "config.json").masking == cfg.masking
