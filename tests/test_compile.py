"""torch.compile without graph breaks (issue 22 §4): every objective's training forward is one
graph (read from break_reasons, not only the count: fullgraph=True does not always raise), and
DeepSpeed's engine.compile() trains a step."""

import pytest
import torch
from conftest import tiny_config

from mpp.build import build_objective
from mpp.config import Config

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


@pytest.mark.parametrize("objective", OBJECTIVES, ids=IDS)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_forward_is_one_graph(digits16, objective, checkpointing):
    """The attention backend's "resolved once" log line broke the graph in every block (8 to 33
    graphs per forward before)."""
    torch._dynamo.reset()
    raw = tiny_config(digits16, objective=objective, model={"grad_checkpointing": checkpointing})
    model = build_objective(Config.model_validate(raw))
    explained = torch._dynamo.explain(model)(torch.randn(4, 3, 16, 16))
    assert [str(b.reason) for b in explained.break_reasons] == []
    assert explained.graph_count == 1


def test_the_classifier_and_the_encoder_are_one_graph_each(digits16):
    from mpp.models import create_vit

    torch._dynamo.reset()
    encoder = create_vit("vit_tiny_patch4_16", depth=2, embed_dim=32, num_heads=2, num_classes=10)
    explained = torch._dynamo.explain(encoder)(torch.randn(2, 3, 16, 16))
    assert explained.break_reasons == [] and explained.graph_count == 1


def test_engine_compile_trains_a_step(digits16, dist_group):
    """DeepSpeed's engine.compile(), the path model.compile takes, on a tiny model (aot_eager: the
    graph capture and autograd, without inductor's minute of C++ builds on this CPU)."""
    import deepspeed

    from mpp.train.optim import build_optimizer

    torch._dynamo.reset()
    cfg = Config.model_validate(tiny_config(digits16, objective={"name": "mae", **SMALL_DECODER}))
    objective = build_objective(cfg)
    engine, *_ = deepspeed.initialize(
        model=objective,
        optimizer=build_optimizer(cfg, objective),
        config=cfg.deepspeed_config(1, "cpu"),
    )
    engine.compile(backend="aot_eager")
    before = {n: p.detach().clone() for n, p in objective.named_parameters()}
    loss, _ = engine(torch.randn(16, 3, 16, 16))
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss) and engine.is_compiled
    assert any(not torch.equal(p, before[n]) for n, p in objective.named_parameters())


def test_compile_auto_compiles_only_long_cuda_runs():
    """``model.compile=auto``: eager on the CPU and for runs too short to pay back a compile."""
    from mpp.train.trainer import COMPILE_MIN_STEPS, resolve_compile

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_compile("auto", cuda, COMPILE_MIN_STEPS)[0] is True
    short, why = resolve_compile("auto", cuda, 300)
    assert short is False and "300 steps do not pay back a compile" in why
    assert resolve_compile("auto", cpu, 10**6)[0] is False
    assert (
        resolve_compile(True, cpu, 10)[0] is True
        and resolve_compile(False, cuda, 10**6)[0] is False
    )
