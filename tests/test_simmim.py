"""SimMIM (mpp/objectives/simmim.py; docs/ARCHITECTURE.md §4.10): the loss on a tiny input by
hand, the loss on the masked patches only, the mask token learned, HPM around it, the library
call, and a real DeepSpeed run of configs/simmim_demo.json (2 steps) that the pictures draw."""

from __future__ import annotations

import pytest
import torch
from conftest import read_metrics, run_cli

from mpp.masking import UnitMask
from mpp.models.vit import create_vit
from mpp.objectives import create_objective
from mpp.objectives.base import REGISTRY, PerPatchObjective
from mpp.objectives.hpm import HardPatchesMining
from mpp.objectives.simmim import SimMIM, SimMIMConfig
from mpp.tools import viz
from mpp.tools.flops import step_flops


def tiny(mask_ratio: float = 0.5, **vit) -> SimMIM:
    """One grey 4x4 image cut into four 2x2 patches (a 2x2 grid)."""
    torch.manual_seed(0)
    encoder = create_vit(
        "vit_tiny_patch4_32",
        **{
            "img_size": 4,
            "patch_size": 2,
            "in_chans": 1,
            "depth": 1,
            "embed_dim": 8,
            "num_heads": 2,
            **vit,
        },
    )
    return create_objective("simmim", encoder, mask_ratio=mask_ratio)


def test_the_registration_line_is_the_objectives_only_one():
    assert REGISTRY["simmim"] == (SimMIMConfig, SimMIM)
    assert issubclass(SimMIM, PerPatchObjective)


def test_the_loss_on_a_tiny_input_computed_by_hand():
    """Pixels 0..15 row by row: patches {0,1,4,5}, {2,3,6,7}, {8,9,12,13}, {10,11,14,15}. The head's
    weight is 0 and its bias 5, so every patch is predicted as four 5s. Masking patches 1 and 2:
    |5-2|+|5-3|+|5-6|+|5-7| = 8 and |5-8|+|5-9|+|5-12|+|5-13| = 22, so the loss is
    (8 + 22) / (2 masked patches x 4 values) = 3.75 (docs/ARCHITECTURE.md §4.10)."""
    model = tiny()
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.fill_(5.0)
    images = torch.arange(16.0).view(1, 1, 4, 4)
    mask = torch.tensor([[False, True, True, False]])
    out = model.forward_per_patch(images, mask)
    assert out["idx"].tolist() == [[1, 2]]
    assert out["loss"].tolist() == [[2.0, 5.5]]  # each patch's mean |error|
    assert out["loss"].mean().item() == 3.75


def test_the_loss_reads_the_masked_patches_only():
    model = tiny()
    images = torch.randn(3, 1, 4, 4)
    mask = torch.tensor(
        [[True, False, True, False], [False, True, True, False], [True, True, False, False]]
    )
    out = model.forward_per_patch(images, mask)
    pred = out["pred"].detach()
    loss = model.forward_loss(images, pred, out["idx"])
    other = torch.where(mask.unsqueeze(-1), pred, torch.randn_like(pred) * 100)
    assert torch.equal(model.forward_loss(images, other, out["idx"]), loss)
    moved = torch.where(mask.unsqueeze(-1), pred + 1.0, pred)
    assert not torch.equal(model.forward_loss(images, moved, out["idx"]), loss)
    # and the masked patches' embeddings are the mask token: their pixels do not reach the output
    changed = images.clone()
    changed[:, :, :2, :2] = 99.0  # patch 0, masked in images 0 and 2, visible in image 1
    again = model.forward_per_patch(changed, mask)["tokens"]
    assert torch.equal(again[[0, 2]], out["tokens"][[0, 2]]) and not torch.equal(
        again[1], out["tokens"][1]
    )


def test_the_gradient_reaches_the_mask_token_which_has_no_weight_decay():
    model = tiny()
    loss, metrics = model(torch.randn(2, 1, 4, 4))
    loss.backward()
    assert model.mask_token.grad is not None and model.mask_token.grad.abs().sum() > 0
    assert {"mask_token", "encoder.pos_embed", "encoder.cls_token"} <= model.no_weight_decay()
    assert metrics["loss"] == loss.detach()


def test_masks_are_the_masking_sections_and_the_step_counts_its_flops():
    encoder = create_vit("vit_tiny_patch4_32", depth=1, embed_dim=32, num_heads=2)
    units = UnitMask(encoder.grid_size, 0.625, unit_size=2)  # SimMIM's mask units, 8 px here
    model = create_objective("simmim", encoder, units)
    out = model.forward_per_patch(torch.randn(2, 3, 32, 32))
    assert out["loss"].shape == (2, 40) and out["pred"].shape == (2, 64, 48)
    grid = out["mask"].view(2, 4, 2, 4, 2)  # every 2x2 unit all masked or all visible
    assert (grid.all(dim=(2, 4)) | ~grid.any(dim=(2, 4))).all()
    flops = step_flops(model)
    assert flops.parts["head"] == 2 * 64 * 32 * 48 and flops.no_grad == 0


def test_hpm_wraps_simmim():
    encoder = create_vit("vit_tiny_patch4_32", depth=1, embed_dim=32, num_heads=2)
    hpm = create_objective(
        "hpm",
        encoder,
        base="simmim",
        mask_ratio=0.5,
        decoder_dim=32,
        decoder_depth=1,
        decoder_heads=2,
    )
    assert isinstance(hpm, HardPatchesMining) and isinstance(hpm.base, SimMIM)
    assert hpm.base.token_dim == 32 and "base.mask_token" in hpm.no_weight_decay()
    hpm.set_progress(1.0, 1.0)  # the teacher chooses half the mask
    loss, metrics = hpm(torch.randn(2, 3, 32, 32))
    loss.backward()
    assert torch.isfinite(loss) and hpm.base.mask_token.grad is not None and "rank_corr" in metrics
    assert set(hpm.held_out_metrics(torch.randn(2, 3, 32, 32))) >= {"rank_corr", "rec_l1"}


def test_create_objective_by_name_and_its_refusals():
    encoder = create_vit("vit_tiny_patch4_32", depth=1, embed_dim=32, num_heads=2)
    model = create_objective("simmim", encoder)
    assert isinstance(model, SimMIM) and model.num_masked == round(0.6 * 64)
    with pytest.raises(ValueError, match=r"'simmim': norm_pix_loss: unknown key"):
        create_objective("simmim", encoder, norm_pix_loss=True)
    with pytest.raises(ValueError, match=r"'simmim': mask_ratio: Input should be less than 1"):
        create_objective("simmim", encoder, mask_ratio=1.0)


def test_the_demo_trains_through_deepspeed_and_draws(tmp_path, demo_cache):
    run = tmp_path / "run"
    cmd = ["python", "pretrain/run.py", "--config", "simmim_demo", "--set", "train.max_steps=2"]
    r = run_cli([*cmd, "--output-dir", str(run)], env=demo_cache)
    assert r.returncode == 0, f"{r.stdout[-2000:]}{r.stderr[-3000:]}"
    losses = [m["loss"] for m in read_metrics(run, "train") if "loss" in m]
    assert losses and all(0 < v < 10 for v in losses)
    png = tmp_path / "simmim.png"
    assert viz.main(["--checkpoint", str(run), "--out", str(png), "--images", "2"]) == 0
    assert png.stat().st_size > 0
