"""HPM (mpp/objectives/hpm.py) and its picture (mpp/tools/viz.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from scipy.stats import spearmanr

from mpp.masking import topk_mask
from mpp.models.vit import create_vit
from mpp.objectives import create_objective
from mpp.objectives.hpm import (
    HardPatchesMining,
    momentum_at,
    rank_correlation,
    ranking_loss,
    zscore_mse_loss,
)
from mpp.objectives.hpm_mask import hard_patch_mask, hard_ratio_at
from mpp.ops import IMAGENET_MEAN, IMAGENET_STD
from mpp.train.panels import objective_panels, picture_size, save_picture

SMALL = dict(decoder_dim=32, decoder_depth=1, decoder_heads=4)


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny tensors on a shared 2-core machine: extra intra-op threads only spin
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_hpm(base: str = "mae", embed_dim: int = 64, **kwargs) -> HardPatchesMining:
    torch.manual_seed(0)
    encoder = create_vit(
        "vit_tiny_patch4_32", depth=2, embed_dim=embed_dim, num_heads=4, pos_embed="sincos"
    )
    return create_objective("hpm", encoder, base=base, **{**SMALL, **kwargs})


def digits(n: int = 32) -> torch.Tensor:
    """Structured images: scikit-learn's 8x8 digits, smoothly upscaled to 32 px, normalised."""
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().images[:n], dtype=torch.float32) / 16
    x = F.interpolate(x[:, None], size=32, mode="bilinear", align_corners=False).expand(
        -1, 3, -1, -1
    )
    mean, std = (
        torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1),
        torch.tensor(IMAGENET_STD).view(1, 3, 1, 1),
    )
    return (x - mean) / std


# ---- the loss predictor's objective ---------------------------------------------------------


def test_ranking_loss_by_hand_with_a_tie():
    pred = torch.tensor([[0.3, -0.4, 1.2], [0.0, 1.0, -1.0]])
    target = torch.tensor([[2.0, 2.0, 5.0], [1.0, 3.0, 2.0]])  # patches 0 and 1 of image 0 tie
    total, pairs = 0.0, 0
    for b in range(2):
        for i in range(3):
            for j in range(3):
                if i == j or target[b, i] == target[b, j]:
                    continue
                s = 1 / (1 + math.exp(-(pred[b, j] - pred[b, i]).item()))
                total += -math.log(s) if target[b, j] > target[b, i] else -math.log(1 - s)
                pairs += 1
    assert pairs == 4 + 6  # image 0: 2 untied unordered pairs, both orders; image 1: all 6
    assert ranking_loss(pred, target).item() == pytest.approx(total / pairs, rel=1e-6)
    # the same written out: each untied pair counts in both orders, as -log sigmoid(p_harder - p_easier)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    by_hand = (
        2 * (-math.log(sig(1.2 - 0.3)) - math.log(sig(1.2 + 0.4)))  # l_2 > l_0, l_2 > l_1
        + 2 * (-math.log(sig(1.0 - 0.0)) - math.log(sig(-1.0 - 0.0)) - math.log(sig(1.0 + 1.0)))
    ) / 10
    assert ranking_loss(pred, target).item() == pytest.approx(by_hand, rel=1e-6)
    # all tied: no pairs, zero loss, no NaN
    assert ranking_loss(pred, torch.ones(2, 3)).item() == 0.0


def test_mse_variant_by_hand():
    pred, target = torch.tensor([[0.5, -0.5, 0.0]]), torch.tensor([[1.0, 2.0, 6.0]])
    mean, var = 3.0, ((1 - 3) ** 2 + (2 - 3) ** 2 + (6 - 3) ** 2) / 2
    z = [(t - mean) / (var + 1e-6) ** 0.5 for t in (1.0, 2.0, 6.0)]
    expected = sum((p - t) ** 2 for p, t in zip((0.5, -0.5, 0.0), z, strict=True)) / 3
    assert zscore_mse_loss(pred, target).item() == pytest.approx(expected, rel=1e-6)


def test_rank_correlation_is_spearman():
    a, b = torch.randn(5, 40), torch.randn(5, 40)
    b[0] = 2 * a[0] + 1  # monotone: rho = 1
    expected = [spearmanr(a[i], b[i]).statistic for i in range(5)]
    torch.testing.assert_close(rank_correlation(a, b), torch.tensor(expected, dtype=torch.float32))


# ---- gradients --------------------------------------------------------------------------------


def test_pred_loss_trains_the_encoder_but_not_the_pixel_decoder():
    hpm = tiny_hpm()
    hpm.set_progress(5, 10)  # alpha > 0: the teacher's mask
    images = torch.randn(4, 3, 32, 32)

    def grads(pred_weight: float) -> dict[str, torch.Tensor]:
        hpm.zero_grad(set_to_none=True)
        hpm.pred_weight = pred_weight
        torch.manual_seed(1)  # the same mask both times
        hpm(images)[0].backward()
        return {n: p.grad.clone() for n, p in hpm.named_parameters() if p.grad is not None}

    with_pred, without = grads(1.0), grads(0.0)
    d_pred = {
        n: with_pred[n] - without.get(n, 0.0) for n in with_pred
    }  # the gradient of L_pred alone
    assert not any(n.startswith("teacher.") for n in with_pred)
    decoder = [n for n in with_pred if n.startswith("base.decoder.")]
    assert decoder and all(d_pred[n].abs().max() == 0 for n in decoder)  # pixel decoder: untouched
    for prefix in (
        "base.encoder.blocks.0.",
        "base.encoder.patch_embed.",
        "base.decoder_embed.proj.",
        "predictor.",
    ):
        assert sum(d_pred[n].abs().sum() for n in d_pred if n.startswith(prefix)) > 0, prefix
    assert all(
        without[n].abs().max() == 0 for n in without if n.startswith("predictor.")
    )  # nor L_rec it


# ---- masks ------------------------------------------------------------------------------------


def test_hard_patch_mask_counts_and_top_k():
    scores = torch.randn(64, 16)
    for k in (0, 3, 12):
        mask, hard = hard_patch_mask(scores, 12, k)
        assert mask.sum(1).eq(12).all() and hard.sum(1).eq(k).all()
        assert torch.equal(hard, topk_mask(scores, k)) and not (hard & ~mask).any()
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(hard_patch_mask(scores, 12, 4, g1)[0], hard_patch_mask(scores, 12, 4, g2)[0])
    with pytest.raises(ValueError, match="k=13"):
        hard_patch_mask(scores, 12, 13)


def test_hard_patch_mask_statistics():
    B, N, n_mask = 20000, 16, 12
    scores = torch.arange(N, dtype=torch.float32).expand(B, N)  # strongly ordered scores
    freq = hard_patch_mask(scores, n_mask, 0)[0].float().mean(0)
    assert (
        freq - n_mask / N
    ).abs().max() < 0.015  # k = 0: every patch equally likely, scores ignored
    mask, hard = hard_patch_mask(scores, n_mask, 4)
    assert hard[:, -4:].all() and mask[:, -4:].all()  # the top-4 always masked
    rest = mask[:, :-4].float().mean(0)
    assert (rest - (n_mask - 4) / (N - 4)).abs().max() < 0.015  # the rest uniformly


@pytest.mark.parametrize("base", ["mae", "mpp"])
def test_objective_masks_the_teachers_hardest_patches(base):
    hpm = tiny_hpm(base)
    images = torch.randn(3, 3, 32, 32)
    hpm.set_progress(9, 10)  # easy_to_hard at the last epoch: alpha = alpha_T
    k = int(hpm.num_masked * 0.5)
    assert hpm.num_hard == k
    mask, hard = hpm.hard_patch_masking(images)
    assert torch.equal(hard, topk_mask(hpm.teacher_scores(images), k))
    assert mask.sum(1).eq(hpm.num_masked).all() and not (hard & ~mask).any()
    out = hpm.base.forward_per_patch(images, mask)  # the base corrupts / hides exactly these
    assert torch.equal(
        out["mask"].gather(1, out["idx"]), torch.ones_like(out["idx"], dtype=torch.bool)
    )

    hpm.set_progress(0, 1000)  # k = 0: plain random, and the teacher is not run at all
    assert hpm.num_hard == 0
    hpm.teacher_scores = None
    assert hpm.hard_patch_masking(images)[1].sum() == 0


def test_schedule_endpoints():
    T, a = 10, 0.5
    assert hard_ratio_at("easy_to_hard", 0, T, a) == pytest.approx(a / T)
    assert hard_ratio_at("easy_to_hard", T - 1, T, a) == pytest.approx(a)
    assert hard_ratio_at("easy_to_hard", 3.7, T, a) == pytest.approx(a * 4 / T)  # integer epoch
    assert hard_ratio_at("hard_to_easy", 0, T, a) == pytest.approx(a)
    assert hard_ratio_at("hard_to_easy", T - 1, T, a) == pytest.approx(a / T)
    assert hard_ratio_at("hard_only", 0, T, a) == hard_ratio_at("hard_only", T - 1, T, a) == a
    assert hard_ratio_at("random", 0, T, a) == hard_ratio_at("random", T - 1, T, a) == 0.0
    hpm = tiny_hpm(schedule="random")
    hpm.set_progress(T - 1, T)
    assert hpm.alpha == 0.0 and hpm.num_hard == 0


# ---- the EMA teacher --------------------------------------------------------------------------


def test_momentum_schedule():
    assert momentum_at(0) == pytest.approx(0.999)
    assert momentum_at(50) == pytest.approx(0.99945)
    assert momentum_at(100) == pytest.approx(0.9999) and momentum_at(800) == pytest.approx(0.9999)
    hpm = tiny_hpm(momentum_start=0.99, momentum_end=0.999, momentum_epochs=4)
    hpm.set_progress(2, 10)
    assert hpm.teacher_momentum == pytest.approx(0.9945)


def test_teacher_momentum_changes_once_per_epoch_like_alpha():
    """The official code sets the momentum (and alpha) once per epoch: every step of epoch e
    uses momentum_at(e), however far into the epoch it is."""
    hpm = tiny_hpm(momentum_start=0.99, momentum_end=0.999, momentum_epochs=4)
    for within in (2.0, 2.25, 2.5, 2.999):
        hpm.set_progress(within, 10)
        assert hpm.teacher_momentum == pytest.approx(0.9945)  # momentum_at(2), not momentum_at(2.5)
    hpm.set_progress(3.0, 10)
    assert hpm.teacher_momentum == pytest.approx(0.99675)


def test_ranking_loss_differs_from_the_official_form_only_where_documented():
    """Official: -pos*log(sigmoid(d) + 1e-6) - neg*log(1 - sigmoid(d) + 1e-6), / valid pairs.
    Ours equals it to ~1e-6 on ordinary scores, is not capped at -log(1e-6) ~ 13.8 per pair
    for a badly wrong pair, and gives 0 (not NaN) when every pair is tied."""

    def official(pred, target):
        d = pred.unsqueeze(1) - pred.unsqueeze(2)
        pos = (target.unsqueeze(1) > target.unsqueeze(2)).float()
        neg = (target.unsqueeze(1) < target.unsqueeze(2)).float()
        s = torch.sigmoid(d)
        loss = -pos * torch.log(s + 1e-6) - neg * torch.log(1 - s + 1e-6)
        return loss.sum() / (pos + neg).sum()

    g = torch.Generator().manual_seed(0)
    pred, target = (
        torch.randn(4, 12, generator=g, dtype=torch.float64),
        torch.rand(4, 12, generator=g, dtype=torch.float64),
    )
    assert ranking_loss(pred, target).item() == pytest.approx(
        official(pred, target).item(), abs=1e-5
    )
    wrong = torch.tensor(
        [[40.0, 0.0]], dtype=torch.float64
    )  # patch 0 scored far harder, but is easier
    easy_first = torch.tensor([[0.1, 0.9]], dtype=torch.float64)
    assert official(wrong, easy_first).item() == pytest.approx(
        -math.log(1e-6), rel=1e-3
    )  # the cap, ~13.8
    assert ranking_loss(wrong, easy_first).item() == pytest.approx(
        40.0, rel=1e-6
    )  # -log sigmoid(-40)
    tied = torch.ones(2, 3)
    assert torch.isnan(official(torch.randn(2, 3), tied))
    assert ranking_loss(torch.randn(2, 3), tied).item() == 0.0


def test_teacher_is_an_ema_of_the_student():
    hpm = tiny_hpm(momentum_start=0.9, momentum_end=0.99, momentum_epochs=10)
    trainable = [p for p in hpm.parameters() if p.requires_grad]
    teacher_ids = {id(p) for p in hpm.teacher.parameters()}
    assert not any(id(p) in teacher_ids for p in trainable)
    assert all(not p.requires_grad for p in hpm.teacher.parameters())
    assert any(k.startswith("teacher.base.encoder.blocks.0.") for k in hpm.state_dict())
    hpm.train()
    assert not hpm.teacher.training and hpm.base.training

    opt = torch.optim.SGD(trainable, lr=0.5)
    images = torch.randn(4, 3, 32, 32)
    for epoch in (0, 5):
        hpm.set_progress(epoch, 10)
        old = {n: p.detach().clone() for n, p in hpm.teacher.named_parameters()}
        opt.zero_grad()
        hpm(images)[0].backward()
        opt.step()
        hpm.after_optimizer_step()
    m = 0.945  # at epoch 5 of the 10-epoch ramp 0.9 -> 0.99
    student = dict(hpm.named_parameters())
    moved = 0
    for name, t in hpm.teacher.named_parameters():
        s = student[name]
        torch.testing.assert_close(t, m * old[name] + (1 - m) * s, rtol=1e-6, atol=1e-7)
        moved += not torch.equal(t, old[name])
    assert moved > 10

    # a load that assigns new Parameter objects: the EMA follows them
    hpm.load_state_dict({k: v.clone() for k, v in hpm.state_dict().items()}, assign=True)
    t, s = hpm.teacher["predictor"].pred.weight, hpm.predictor.pred.weight
    old = t.detach().clone()
    hpm.update_teacher()
    torch.testing.assert_close(t, m * old + (1 - m) * s)
    assert not torch.equal(t, old)


def test_ema_in_bf16_keeps_moving():
    hpm = tiny_hpm().to(torch.bfloat16)
    hpm.set_progress(0, 10)  # m = 0.999: a bf16 lerp by 1e-3 rounds back to where it started
    w_t = hpm.teacher["predictor"].pred.weight
    w_s = hpm.predictor.pred.weight
    with torch.no_grad():
        w_s.add_(1.0)
    start = w_t.detach().float().clone()
    for _ in range(100):
        hpm.update_teacher()
    moved = (w_t.float() - start).mean().item()
    assert moved == pytest.approx(1 - 0.999**100, rel=0.05)  # ~0.095 of the gap, as in fp32


def test_fp32_ema_state_round_trips_for_resume(caplog):
    """Under bf16 the EMA lives in fp32 beside the teacher: rank_state hands it to the
    checkpoint and load_rank_state puts it back; an fp32 teacher needs none."""
    assert tiny_hpm().rank_state() == {}  # fp32: the teacher is its own EMA
    hpm = tiny_hpm().to(torch.bfloat16)
    hpm.set_progress(0, 10)
    with torch.no_grad():
        hpm.predictor.pred.weight.add_(1.0)
    for _ in range(3):
        hpm.update_teacher()
    state = hpm.rank_state()
    assert len(state) == len(list(hpm.teacher.parameters())) and all(
        t.dtype == torch.float32 for t in state.values()
    )
    resumed = tiny_hpm().to(torch.bfloat16)
    resumed.load_state_dict(hpm.state_dict())
    resumed.load_rank_state({k: v.clone() for k, v in state.items()})
    for a, b in zip(resumed.rank_state().values(), state.values(), strict=True):
        assert torch.equal(a, b)
    other = tiny_hpm(embed_dim=32).to(
        torch.bfloat16
    )  # another shape (as another ZeRO-3 world size)
    other.load_rank_state(state)
    assert other.ema.fp32 is None and "does not match" in caplog.text


def test_ema_updates_zero3_shards_in_place():
    """Fake ZeRO-3 partitioning: every parameter gets a flat shard ``ds_tensor``; big ones are
    released (empty data), small "persistent" ones stay whole on the rank as well."""
    hpm = tiny_hpm()
    hpm.set_progress(0, 10)
    m = 0.999
    for p in hpm.parameters():
        p.ds_numel = p.numel()
        p.ds_tensor = torch.randn(max(p.numel() // 2, 1))
        if p.numel() > 1000:
            p.data = torch.empty(0)
    teacher = dict(hpm.teacher.named_parameters())
    student = dict(hpm.named_parameters())
    assert any(p.numel() == 0 for p in teacher.values()) and any(
        p.numel() > 0 for p in teacher.values()
    )
    with torch.no_grad():  # a student that differs from its teacher
        for n in teacher:
            student[n].add_(1.0)
    data = {n: p.detach().clone() for n, p in teacher.items()}
    shards = {n: p.ds_tensor.clone() for n, p in teacher.items()}
    hpm.update_teacher()
    for n, p in teacher.items():
        torch.testing.assert_close(p.ds_tensor, m * shards[n] + (1 - m) * student[n].ds_tensor)
        torch.testing.assert_close(
            p.data, m * data[n] + (1 - m) * student[n].data
        )  # whole copy too
    assert sum(p.numel() for p in teacher.values()) < sum(p.ds_numel for p in teacher.values())


# ---- learning and configuration --------------------------------------------------------------


@pytest.mark.parametrize("base", ["mae", "mpp"])
def test_predictor_learns_to_rank_patch_losses(base):
    hpm = tiny_hpm(base)
    images = digits(32)
    opt = torch.optim.Adam([p for p in hpm.parameters() if p.requires_grad], lr=1e-3)
    corr = []
    for step in range(40):
        hpm.set_progress(step / 10, 8)
        loss, metrics = hpm(images)
        opt.zero_grad()
        loss.backward()
        opt.step()
        hpm.after_optimizer_step()
        corr.append(metrics["rank_corr"].item())
    assert set(metrics) == {
        "loss",
        "loss_rec",
        "loss_pred",
        "rank_corr",
        "alpha",
        "teacher_momentum",
    }
    assert all(v.ndim == 0 and not v.requires_grad for v in metrics.values())
    first, last = sum(corr[:3]) / 3, sum(corr[-5:]) / 5
    assert last > 0.5 and last > first + 0.2, corr


def test_bad_arguments():
    enc = create_vit("vit_tiny_patch4_32", depth=1)
    for kwargs, match in [
        (dict(schedule="linear"), r"schedule: .*'easy_to_hard'.*\(got 'linear'\)"),
        (dict(pred_loss="bce"), r"pred_loss: .*ranking.*\(got 'bce'\)"),
        (
            dict(base="beit"),
            r"base.name: Input should be 'mae', 'mpp' or 'simmim' \(got 'beit'\)",
        ),
        (dict(hard_ratio=1.5), "hard_ratio.*1.5"),
        # the keys of the base it picked, mpp's
        (
            dict(base="mpp", norm_pix_loss=True),
            r"'hpm': norm_pix_loss: unknown key; allowed: bits, .* \(its base's\); "
            "its own: .*hard_ratio,",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            create_objective("hpm", enc, **SMALL, **kwargs)
    hpm = create_objective("hpm", enc, base="mpp", mask_ratio=0.4, **SMALL)
    assert hpm.num_masked == round(0.4 * 64) and hpm.no_weight_decay() >= {"base.mask_token"}
    with pytest.raises(ValueError, match="total_epochs"):
        hpm.set_progress(0, 0)


# ---- the picture ------------------------------------------------------------------------------


def test_picture(tmp_path):
    hpm = tiny_hpm()
    images = digits(3)
    panels = objective_panels(hpm, images, hpm.mean, hpm.std, num_hard=5)
    pic = save_picture(panels, tmp_path / "grid.png", 2)
    with Image.open(tmp_path / "grid.png") as png:
        assert png.format == "PNG" and png.size == picture_size(3, 32, 32, 2) == (
            4 * 64 + 5 * 2,
            3 * 64 + 4 * 2,
        )
    assert pic.size == picture_size(3, 32, 32, 2)
    assert hpm.training  # put back as it was

    raw, shown, recon, heat = panels
    hard = topk_mask(hpm.teacher_scores(images), 5)
    for b, i in hard.nonzero().tolist():  # hard patches are red in the mask panel
        r, g, _ = shown[b, :, 4 * (i // 8) + 1, 4 * (i % 8) + 1].tolist()
        assert r > g + 0.4
    assert all(
        x.shape == (3, 3, 32, 32) and 0 <= x.min() and x.max() <= 1
        for x in (raw, shown, recon, heat)
    )
    other = tiny_hpm("mpp")  # the other base draws too
    save_picture(objective_panels(other, images, other.mean, other.std), tmp_path / "mpp.png")


def test_picture_command(tmp_path, capsys):
    from mpp.tools.viz import main

    out = tmp_path / "cli.png"
    main(
        [
            "--images",
            "2",
            "--out",
            str(out),
            "--decoder-dim",
            "32",
            "--decoder-depth",
            "1",
            "--scale",
            "1",
        ]
    )
    with Image.open(out) as png:
        assert png.size == picture_size(2, 32, 32, 1)
    assert "wrote" in capsys.readouterr().out


def test_picture_loads_weights(tmp_path):
    from mpp.tools.viz import load_weights

    trained, fresh = tiny_hpm(), tiny_hpm()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.1)
    torch.save({"module": trained.state_dict()}, tmp_path / "states.pt")  # DeepSpeed's layout
    load_weights(fresh, str(tmp_path / "states.pt"))
    expected = trained.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())
    (tmp_path / "ckpt" / "step3").mkdir(parents=True)  # a DeepSpeed stage-0 checkpoint folder
    (tmp_path / "ckpt" / "latest").write_text("step3")
    torch.save({"module": expected}, tmp_path / "ckpt" / "step3" / "mp_rank_00_model_states.pt")
    fresh = tiny_hpm()
    load_weights(fresh, str(tmp_path / "ckpt"))
    assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())

    fresh = tiny_hpm()
    torch.save(trained.encoder.state_dict(), tmp_path / "encoder.pt")  # an exported encoder
    load_weights(fresh, str(tmp_path / "encoder.pt"))
    for encoder in (fresh.encoder, fresh.teacher["base"].encoder):
        assert torch.equal(
            encoder.blocks[0].attn.qkv.weight, trained.encoder.blocks[0].attn.qkv.weight
        )
    assert not torch.equal(fresh.predictor.pred.weight, trained.predictor.pred.weight)


@pytest.mark.parametrize("base", ["mae", "mpp", "simmim"])
def test_every_hpm_base_keeps_the_per_patch_contract(base):
    """What HPM reads from its base is declared (mpp.objectives.base.PerPatchObjective): the
    keys of forward_per_patch, their shapes, token_dim and predictor_tokens' width."""
    from typing import get_type_hints

    from mpp.objectives.base import PerPatch, PerPatchObjective
    from mpp.objectives.hpm import hpm_bases

    assert issubclass(hpm_bases()[base], PerPatchObjective)
    student = tiny_hpm(base).base
    images = digits(4)
    B, N = images.shape[0], student.mask_generator.num_patches
    out = student.forward_per_patch(images)
    assert set(get_type_hints(PerPatch)) <= set(out)
    n = student.mask_generator.num_masked
    assert out["loss"].shape == out["idx"].shape == (B, n) and out["mask"].shape == (B, N)
    assert (
        out["tokens"].shape[-1] == student.token_dim == student.predictor_tokens(images).shape[-1]
    )
    assert (out["mask"].gather(1, out["idx"])).all()  # the losses are the masked patches'


def test_picture_of_a_run_builds_the_encoder_its_model_json_states(tmp_path, digits16):
    """A run whose init stated the size, eps and bias: its config.json leaves them unset (as
    loaded), its model.json states them; viz, which takes the weights from the run and not from
    its init, builds that encoder, not the variant's 16-px one."""
    import json

    from conftest import tiny_config, write_config

    from mpp.tools.viz import pretraining_config

    run = tmp_path / "run"
    run.mkdir()
    write_config(run / "config.json", tiny_config(digits16, model={"init": str(tmp_path)}))
    stated = {"img_size": 32, "patch_size": 4, "norm_eps": 1e-12, "qkv_bias": False}
    (run / "model.json").write_text(json.dumps({"name": "vit_tiny_patch4_16", **stated}))
    cfg = pretraining_config(run / "config.json")
    assert cfg.model.init is None
    assert {k: getattr(cfg.model, k) for k in stated} == stated
