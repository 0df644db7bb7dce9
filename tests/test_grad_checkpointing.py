"""model.grad_checkpointing (issue 22 §2): every objective's gradients equal without it (fp32,
drop path on: its RNG is replayed in the recompute), activations held drop as predicted, and the
switch is a runtime choice, not architecture."""

import pytest
import torch
from conftest import tiny_config

from mpp.build import build_objective
from mpp.config import Config, FinetuneConfig

# a 2-block decoder 32 wide (the default, 512 wide and 8 deep, is most of the time here): the
# same modules, in a loop over blocks, as at any size
SMALL_DECODER = {"decoder_dim": 32, "decoder_depth": 2, "decoder_heads": 2}
OBJECTIVES = [
    {"name": "mpp"},
    {"name": "mae", "norm_pix_loss": True, **SMALL_DECODER},
    {"name": "hpm", "base": "mae", **SMALL_DECODER},
    {"name": "hpm", "base": "mpp", **SMALL_DECODER},
]
IDS = ["mpp", "mae-True", "hpm-mae", "hpm-mpp"]


def grads(model, inputs, seed=3):
    torch.manual_seed(seed)  # the same masks and drop-path draws for both
    loss, _ = model(*inputs)
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("objective", OBJECTIVES, ids=IDS)
def test_gradients_equal_with_and_without(digits16, objective):
    images = torch.randn(4, 3, 16, 16)
    results = []
    for on in (False, True):
        torch.manual_seed(0)
        raw = tiny_config(
            digits16, objective=objective, model={"drop_path_rate": 0.2, "grad_checkpointing": on}
        )
        model = build_objective(Config.model_validate(raw))
        assert model.encoder.grad_checkpointing is on
        results.append(grads(model, (images,)))
    (loss0, g0), (loss1, g1) = results
    assert torch.equal(loss0, loss1) and g0.keys() == g1.keys() and len(g0) > 10
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_classifier_too(digits16):
    from mpp.transfer.finetune import build_classifier

    raw = tiny_config(digits16, model={"drop_path_rate": 0.2}, data={"val_shards": digits16["val"]})
    raw.pop("objective"), raw.pop("masking")
    images, labels = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])
    results = []
    for on in (False, True):
        torch.manual_seed(0)
        raw["model"]["grad_checkpointing"] = on
        model = build_classifier(FinetuneConfig.model_validate(raw))
        assert model.encoder.grad_checkpointing is on
        results.append(grads(model, (images, labels)))
    for name in results[0][1]:
        torch.testing.assert_close(results[1][1][name], results[0][1][name], rtol=1e-5, atol=1e-7)


def test_activations_held_drop_to_about_one_block():
    """MemTracker on real CPU tensors: a 6-block ViT keeps ~8x fewer activation bytes (measured
    76.9 MB -> 9.6 MB: the blocks' inputs plus one block recomputed at a time)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from mpp.models import create_vit

    def peak_activations(on: bool) -> int:
        torch.manual_seed(0)
        model = create_vit("vit_tiny_patch4_32", depth=6, embed_dim=192, num_heads=3)
        model.set_grad_checkpointing(on)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            model(torch.randn(16, 3, 32, 32)).sum().backward()
        (per_device,) = tracker.get_tracker_snapshot("peak").values()
        return next(v for k, v in per_device.items() if str(k).endswith("ACT"))

    without, with_ = peak_activations(False), peak_activations(True)
    assert with_ < without / 5, (without, with_)


def test_a_runtime_switch_not_architecture(digits16):
    cfg = Config.model_validate(
        tiny_config(digits16, objective={"name": "mae"}, model={"grad_checkpointing": True})
    )
    model = build_objective(cfg)
    assert model.decoder.grad_checkpointing and model.encoder.grad_checkpointing
    assert "grad_checkpointing" not in cfg.model.vit_kwargs()  # the exported encoder's metadata
    with torch.no_grad():  # nothing to recompute without a backward
        model(torch.randn(2, 3, 16, 16))
