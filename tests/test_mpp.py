import pytest
import torch

from mpp.models import create_vit
from mpp.objectives import create_objective
from mpp.objectives.mpp import (
    color_classes,
    mean_color_targets,
)
from mpp.ops import IMAGENET_MEAN, IMAGENET_STD


def tiny_encoder(img=16, patch=4, depth=1, **kw):
    return create_vit(
        "vit_tiny_patch4_32",
        img_size=img,
        patch_size=patch,
        depth=depth,
        embed_dim=32,
        num_heads=2,
        attn_backend="sdpa",
        **kw,
    )


def normalise(raw):
    m = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    s = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (raw - m) / s


def test_mean_color_targets_match_hand_computation():
    # one 4x4 image, 2x2 patches of 2x2 pixels
    img = torch.zeros(1, 3, 4, 4, dtype=torch.uint8)
    img[0, :, 0:2, 0:2] = torch.tensor([255, 0, 128]).view(
        3, 1, 1
    )  # means 1.0, 0, .502 -> (7, 0, 4)
    img[0, 0, 0:2, 2:4] = torch.tensor([[64, 191], [191, 64]])  # red mean exactly 0.5 -> 4
    img[0, 1, 0:2, 2:4] = 32  # .1255 -> 1
    img[0, :, 2:4, 0:2] = 31  # .1216 -> 0 everywhere
    img[0, :, 2:4, 2:4] = torch.tensor([224, 223, 255]).view(
        3, 1, 1
    )  # .878 -> 7, .8745 -> 6, 1.0 -> 7
    expected = torch.tensor([[7 * 64 + 0 + 4, 4 * 64 + 1 * 8 + 0, 0, 7 * 64 + 6 * 8 + 7]])
    raw = img.float() / 255
    torch.testing.assert_close(mean_color_targets(raw, patch_size=2), expected)
    obj = create_objective("mpp", tiny_encoder(img=4, patch=2))
    torch.testing.assert_close(obj.targets(normalise(raw)), expected)  # maps normalised inputs back


def test_downsampled_target_is_sixteen_cell_classes():
    raw = torch.rand(2, 3, 16, 16)
    t = mean_color_targets(raw, patch_size=8, cells=4)  # cells of 2x2 pixels
    assert t.shape == (2, 4, 16)
    cell = raw[1, :, 8:10, 2:4].mean(dim=(1, 2))  # patch (1, 0), cell row 0 col 1
    assert t[1, 2, 1] == color_classes(cell)


def test_normalised_and_raw_inputs_give_the_same_targets():
    g = torch.Generator().manual_seed(0)
    u8 = torch.randint(0, 256, (16, 3, 32, 32), generator=g, dtype=torch.uint8)
    u8[:, :, :16, :16] = torch.tensor([64, 191]).repeat(8)  # patch means on a bin edge (0.5)
    raw = u8.float() / 255
    enc = tiny_encoder(img=32, patch=8)
    norm_obj = create_objective("mpp", enc)
    raw_obj = create_objective("mpp", enc, mean=(0, 0, 0), std=(1, 1, 1))
    for target in ("mean_color", "downsampled", "pixel"):
        norm_obj.target = raw_obj.target = target
        torch.testing.assert_close(norm_obj.targets(normalise(raw)), raw_obj.targets(raw))
    # without mapping back, normalised pixels would collapse classes: the bug this guards against
    assert (
        mean_color_targets(normalise(raw).clamp(0, 1), 8).unique().numel()
        < raw_obj.targets(raw).unique().numel()
    )


def test_corruption_statistics_exact_count_and_80_10_10():
    torch.manual_seed(0)
    obj = create_objective("mpp", tiny_encoder(img=32, patch=4))  # N = 64
    N, B = 64, 512
    kinds = []
    for _ in range(4):
        mask = obj.mask_generator(B)
        assert torch.all(mask.sum(1) == round(0.5 * N))
        _, kind = obj.corrupt(torch.randn(B, N, 32), mask)
        assert torch.equal(kind > 0, mask)
        kinds.append(kind)
    kind = torch.cat(kinds)
    n = (kind > 0).sum().item()  # 65,536 corrupted tokens: 3 sigma of a 10 % share is 0.0035
    assert (kind == 1).sum().item() / n == pytest.approx(0.8, abs=0.01)
    assert (kind == 2).sum().item() / n == pytest.approx(0.1, abs=0.01)
    assert (kind == 3).sum().item() / n == pytest.approx(0.1, abs=0.01)
    # every position is corrupted equally often
    per_pos = (kind > 0).float().mean(0)
    assert per_pos.min() > 0.4 and per_pos.max() < 0.6


def test_each_corruption_kind_does_what_it_says():
    torch.manual_seed(1)
    obj = create_objective("mpp", tiny_encoder(img=32, patch=4))
    tokens = torch.randn(8, 64, 32)
    mask = obj.mask_generator(8)
    out, kind = obj.corrupt(tokens, mask)
    assert torch.equal(out[kind == 0], tokens[kind == 0])
    assert torch.equal(out[kind == 3], tokens[kind == 3])
    assert torch.all(out[kind == 1] == obj.mask_token.detach().view(1, -1))
    for b, i in (kind == 2).nonzero().tolist():
        match = (tokens[b] == out[b, i]).all(-1).nonzero().flatten().tolist()
        assert len(match) == 1 and match[0] != i  # another patch of the same image, never itself


def test_gradients_reach_the_mask_embedding_and_loss_only_on_corrupted():
    torch.manual_seed(0)
    obj = create_objective("mpp", tiny_encoder())
    loss, metrics = obj(torch.randn(4, 3, 16, 16))
    loss.backward()
    assert obj.mask_token.grad is not None and obj.mask_token.grad.abs().sum() > 0
    assert metrics["corrupt_frac"].item() == 0.5
    # loss covers corrupted positions only: the head sees exactly round(0.5 N) tokens per image
    out = obj.forward_per_patch(torch.randn(4, 3, 16, 16))
    assert out["loss"].shape == (4, 8) and torch.equal(
        out["mask"].gather(1, out["idx"]), torch.ones(4, 8, dtype=torch.bool)
    )


@pytest.mark.parametrize("target", ["mean_color", "pixel"])
def test_tiny_model_overfits_a_fixed_batch(target):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    # 4 images of coloured 4x4-pixel blocks: structure that context can predict
    blocks = torch.randint(0, 256, (4, 3, 4, 4), generator=g).float() / 255
    raw = blocks.repeat_interleave(4, dim=2).repeat_interleave(4, dim=3)  # (4, 3, 16, 16)
    images = normalise(raw)
    obj = create_objective("mpp", tiny_encoder(depth=2), target=target)
    opt = torch.optim.Adam(obj.parameters(), lr=2e-3)
    losses = []
    for _ in range(200):
        loss, _ = obj(images)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    start, end = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    assert end < 0.3 * start, (start, end)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(target="hog"), "target: Input should be 'mean_color', 'downsampled' or .*'hog'"),
        (dict(mask_ratio=1.5), r"mask_ratio: Input should be less than or equal to 1 \(got 1.5\)"),
        (dict(mask_token_prob=0.7), "'mpp': mask_token_prob \\+ random_token_prob .* sum to 1"),
        (dict(keep_prob=-0.1, mask_token_prob=1.0), r"keep_prob: Input should be greater.*-0.1"),
        (dict(bits=9), r"bits: Input should be less than or equal to 8 \(got 9\)"),
    ],
)
def test_bad_config_raises_valueerror(kwargs, match):
    with pytest.raises(ValueError, match=match):
        create_objective("mpp", tiny_encoder(), **kwargs)
