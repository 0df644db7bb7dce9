import pytest
import torch

from mpp.models import create_vit, resample_abs_pos_embed, sincos_pos_embed, vit_config


def timm_vit_keys(depth=12, dim=768, patch=16, in_chans=3, num_patches=196, mlp=3072):
    """timm's VisionTransformer state dict for vit_base_patch16_224 (global_pool='token',
    num_classes=0), spelled out from timm's module tree; timm itself cannot import here."""
    keys = {
        "cls_token": (1, 1, dim),
        "pos_embed": (1, num_patches + 1, dim),
        "patch_embed.proj.weight": (dim, in_chans, patch, patch),
        "patch_embed.proj.bias": (dim,),
    }
    for i in range(depth):
        b = f"blocks.{i}."
        keys.update(
            {
                b + "norm1.weight": (dim,),
                b + "norm1.bias": (dim,),
                b + "attn.qkv.weight": (3 * dim, dim),
                b + "attn.qkv.bias": (3 * dim,),
                b + "attn.proj.weight": (dim, dim),
                b + "attn.proj.bias": (dim,),
                b + "norm2.weight": (dim,),
                b + "norm2.bias": (dim,),
                b + "mlp.fc1.weight": (mlp, dim),
                b + "mlp.fc1.bias": (mlp,),
                b + "mlp.fc2.weight": (dim, mlp),
                b + "mlp.fc2.bias": (dim,),
            }
        )
    keys.update({"norm.weight": (dim,), "norm.bias": (dim,)})
    return keys


def test_vit_base_has_timms_parameter_count_names_and_shapes():
    with torch.device("meta"):
        m = create_vit("vit_base_patch16_224")
    assert sum(p.numel() for p in m.parameters()) == 85_798_656
    sd = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert sd == timm_vit_keys()


def test_with_head_and_avg_pool_match_timm_layout():
    m = create_vit("vit_tiny_patch16_224", num_classes=10, global_pool="avg", depth=1)
    sd = m.state_dict()
    assert tuple(sd["head.weight"].shape) == (10, 192)
    assert "fc_norm.weight" in sd and "norm.weight" not in sd  # timm: avg pool -> fc_norm
    assert m(torch.randn(2, 3, 224, 224)).shape == (2, 10)


@pytest.mark.parametrize(
    "name,dim,depth,heads",
    [
        ("vit_tiny_patch16_224", 192, 12, 3),
        ("vit_small_patch32_384", 384, 12, 6),
        ("vit_large_patch14_224", 1024, 24, 16),
        ("vit_huge_patch14_224", 1280, 32, 16),
    ],
)
def test_variant_table(name, dim, depth, heads):
    cfg = vit_config(name)
    assert (cfg["embed_dim"], cfg["depth"], cfg["num_heads"]) == (dim, depth, heads)


def test_any_divisible_image_size_and_overrides():
    m = create_vit(
        "vit_tiny_patch16_224", img_size=48, patch_size=8, in_chans=1, depth=2, pos_embed="sincos"
    )
    assert m.grid_size == (6, 6) and m.num_patches == 36
    assert m.forward_features(torch.randn(3, 1, 48, 48)).shape == (3, 37, 192)
    assert not m.pos_embed.requires_grad  # sin-cos is fixed


def test_forward_on_visible_subset_equals_gathering_inputs():
    """encode(tokens, visible_idx) == running the blocks on exactly those tokens."""
    torch.manual_seed(0)
    m = create_vit("vit_tiny_patch4_32", depth=2, attn_backend="math").eval()
    imgs = torch.randn(2, 3, 32, 32)
    idx = torch.stack([torch.randperm(64)[:16].sort().values for _ in range(2)])  # (B, 16)
    out = m.forward_features(imgs, visible_idx=idx)
    assert out.shape == (2, 17, 192)
    tokens = m.patch_embed(imgs) + m.pos_embed[:, 1:]
    ref = torch.stack([tokens[b, idx[b]] for b in range(2)])
    ref = torch.cat([(m.cls_token + m.pos_embed[:, :1]).expand(2, -1, -1), ref], 1)
    ref = m.norm(m.blocks(ref))
    torch.testing.assert_close(out, ref)
    # a visible subset differs from the full sequence: attention really sees fewer tokens
    assert not torch.allclose(out[:, 0], m.forward_features(imgs)[:, 0])


def test_drop_path_is_linear_over_depth():
    m = create_vit("vit_tiny_patch16_224", depth=5, drop_path_rate=0.2)
    rates = [b.drop_path.drop_prob for b in m.blocks]
    assert rates == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2])


def test_sincos_matches_mae_formula():
    pe = sincos_pos_embed(8, (2, 3))  # D=8 -> 2 frequencies per (sin, cos) per axis
    assert pe.shape == (7, 8) and torch.all(pe[0] == 0)
    # patch at row h=1, col w=2 is index 1*3+2 = 5 (+1 for cls); first half encodes w
    omega = torch.tensor([1.0, 1.0 / 100.0], dtype=torch.float64)
    w_part = torch.cat([torch.sin(2 * omega), torch.cos(2 * omega)])
    h_part = torch.cat([torch.sin(1 * omega), torch.cos(1 * omega)])
    torch.testing.assert_close(pe[6].double(), torch.cat([w_part, h_part]), atol=1e-6, rtol=0)


def test_resample_pos_embed_keeps_cls_and_is_identity_on_same_grid():
    pe = torch.randn(1, 1 + 16, 8)
    assert resample_abs_pos_embed(pe, (4, 4)) is pe
    up = resample_abs_pos_embed(pe, (8, 8))
    assert up.shape == (1, 65, 8)
    torch.testing.assert_close(up[:, 0], pe[:, 0])
    # a constant field stays constant under bicubic resampling
    const = torch.ones(1, 17, 8)
    torch.testing.assert_close(
        resample_abs_pos_embed(const, (6, 6)), torch.ones(1, 37, 8), atol=1e-5, rtol=0
    )
    # a linear ramp along w is preserved in its direction (values increase with column)
    ramp = torch.arange(4.0).repeat(4).view(1, 16, 1).expand(1, 16, 2)
    ramp = torch.cat([torch.zeros(1, 1, 2), ramp], 1)
    r = resample_abs_pos_embed(ramp, (4, 8))[0, 1:, 0].view(4, 8)
    assert torch.all(r[:, 1:] >= r[:, :-1])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(img_size=225), "not divisible by patch_size 16"),
        (dict(pos_embed="rope"), "pos_embed.*allowed"),
        (dict(attn_backend="flash"), "attn_backend.*allowed"),
        (dict(global_pool="max"), "global_pool.*allowed"),
    ],
)
def test_bad_arguments_raise_valueerror_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        create_vit("vit_tiny_patch16_224", depth=1, **kwargs)


def test_unknown_variant_and_wrong_channels():
    with pytest.raises(ValueError, match="vit_gigantic_patch16_224.*allowed"):
        create_vit("vit_gigantic_patch16_224")
    m = create_vit("vit_tiny_patch16_32", depth=1)
    with pytest.raises(ValueError, match=r"expected images \(B, 3, H, W\)"):
        m(torch.randn(1, 1, 32, 32))
