"""MAE (mpp/objectives/mae.py) and its decoder (mpp/models/decoder.py)."""

from __future__ import annotations

import pytest
import torch

from mpp.masking import mask_indices
from mpp.models.decoder import Decoder, DecoderEmbed
from mpp.models.vit import create_vit
from mpp.objectives import OBJECTIVES, create_objective
from mpp.objectives.mae import MaskedAutoencoder, normalize_patches

SMALL = dict(decoder_dim=32, decoder_depth=1, decoder_heads=4)


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny tensors on a shared 2-core machine: extra intra-op threads only spin
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_mae(**kwargs) -> MaskedAutoencoder:
    torch.manual_seed(0)
    return create_objective(
        "mae", create_vit("vit_tiny_patch4_32", depth=2, pos_embed="sincos"), **{**SMALL, **kwargs}
    )


def test_norm_pix_target_by_hand():
    patch = torch.tensor([[[1.0, 2.0, 4.0, 9.0]]])
    mean = (1 + 2 + 4 + 9) / 4
    var = sum((v - mean) ** 2 for v in (1, 2, 4, 9)) / 3  # unbiased, as MAE's target.var(dim=-1)
    expected = torch.tensor([[[(v - mean) / (var + 1e-6) ** 0.5 for v in (1, 2, 4, 9)]]])
    torch.testing.assert_close(normalize_patches(patch), expected)

    # and on an image: the target of patch (row 1, col 2) of a 4-px-patch grid, values in (p, q, c) order
    mae = tiny_mae()
    images = torch.randn(2, 3, 32, 32)
    values = [
        images[1, c, 4 + p, 8 + q].item() for p in range(4) for q in range(4) for c in range(3)
    ]
    m = sum(values) / len(values)
    v = sum((x - m) ** 2 for x in values) / (len(values) - 1)
    expected = torch.tensor([(x - m) / (v + 1e-6) ** 0.5 for x in values])
    torch.testing.assert_close(mae.targets(images)[1, 1 * 8 + 2], expected, atol=1e-5, rtol=1e-5)
    raw = tiny_mae(norm_pix_loss=False).targets(images)[1, 1 * 8 + 2]
    torch.testing.assert_close(raw, torch.tensor(values))


def test_mask_has_exact_count_and_encoder_sees_visible_tokens_only():
    mae = tiny_mae()
    N, n_mask = 64, 48  # 75 % of the 8x8 grid
    seen = []
    mae.encoder.blocks[0].register_forward_hook(lambda m, inp, out: seen.append(inp[0].shape))
    out = mae.forward_per_patch(torch.randn(3, 3, 32, 32))
    assert mae.num_masked == n_mask
    assert out["mask"].sum(dim=1).tolist() == [n_mask] * 3
    assert seen == [torch.Size([3, 1 + N - n_mask, 192])]  # cls + the 16 visible patches
    assert out["loss"].shape == (3, n_mask) and out["pred"].shape == (3, N, 4 * 4 * 3)
    assert torch.equal(out["mask"].gather(1, out["idx"]), torch.ones(3, n_mask, dtype=torch.bool))


def test_loss_is_the_mse_over_masked_patches_only():
    mae = tiny_mae()
    images = torch.randn(2, 3, 32, 32)
    mask = mae.mask_generator(2, "cpu")
    out = mae.forward_per_patch(images, mask)
    pred, target = out["pred"], mae.targets(images)
    expected = [
        [((pred[b, i] - target[b, i]) ** 2).mean().item() for i in range(64) if mask[b, i]]
        for b in range(2)
    ]  # in ascending patch order, as mask_indices lists them
    torch.testing.assert_close(out["loss"], torch.tensor(expected))

    # perturbing the targets of visible patches changes nothing, of a masked one changes the loss
    original = mae.targets
    for where, changes in ((~mask, False), (mask, True)):
        mae.targets = lambda x, w=where: original(x) + 5.0 * w.unsqueeze(-1)
        loss = mae.forward_per_patch(images, mask)["loss"]
        assert (not torch.allclose(loss, out["loss"])) == changes
    del mae.targets


def test_decoder_embed_puts_tokens_back_in_place():
    embed = DecoderEmbed(embed_dim=8, decoder_dim=16, grid_size=(2, 3))
    mask = torch.tensor(
        [[True, False, True, True, False, True], [False, True, True, True, True, False]]
    )
    visible_idx, _ = mask_indices(mask, 4)  # (2, 2)
    latent = torch.randn(2, 1 + 2, 8)
    x = embed(latent, visible_idx)  # (2, 1 + 6, 16)
    proj = embed.proj(latent)
    pos = embed.pos_embed[0]
    for b in range(2):
        torch.testing.assert_close(x[b, 0], proj[b, 0] + pos[0])  # cls
        visible = [i for i in range(6) if not mask[b, i]]
        for j, i in enumerate(visible):
            torch.testing.assert_close(x[b, 1 + i], proj[b, 1 + j] + pos[1 + i])
        for i in range(6):
            if mask[b, i]:
                torch.testing.assert_close(x[b, 1 + i], embed.mask_token[0, 0] + pos[1 + i])
    assert not embed.pos_embed.requires_grad
    assert Decoder(16, depth=1, num_heads=4, out_dim=5, in_dim=8)(latent).shape == (2, 3, 5)


def test_mae_learns_and_gradients_reach_everything_trainable():
    mae = tiny_mae()
    images = torch.randn(4, 3, 32, 32)
    opt = torch.optim.AdamW([p for p in mae.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(15):
        loss, metrics = mae(images)
        assert (
            set(metrics) == {"loss"}
            and metrics["loss"].ndim == 0
            and not metrics["loss"].requires_grad
        )
        opt.zero_grad()
        loss.backward()
        if not losses:
            missing = [n for n, p in mae.named_parameters() if p.requires_grad and p.grad is None]
            assert missing == []
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


def test_registry_and_bad_arguments():
    assert set(OBJECTIVES) == {"mpp", "mae", "hpm", "simmim"}
    enc = create_vit("vit_tiny_patch4_32", depth=1)
    assert isinstance(create_objective("mae", enc, **SMALL), MaskedAutoencoder)
    with pytest.raises(ValueError, match=r"'beit'.*\['hpm', 'mae', 'mpp', 'simmim'\]"):
        create_objective("beit", enc)
    with pytest.raises(
        ValueError, match=r"'mae': decoder_width: unknown key \(did you mean decoder_"
    ):
        create_objective("mae", enc, decoder_width=64)
    with pytest.raises(ValueError, match="mask_ratio.*1.5"):
        create_objective("mae", enc, mask_ratio=1.5)
    with pytest.raises(ValueError, match="decoder_dim 30"):
        create_objective("mae", enc, decoder_dim=30, decoder_heads=3)
    assert "decoder_embed.mask_token" in create_objective("mae", enc, **SMALL).no_weight_decay()
