"""The probe protocols' facts against the papers' text and code (mpp/transfer/probe.py,
probe_protocols.py): LARS's trust ratio by hand, MAE's lr rule and BatchNorm head, DINOv2's grid and its
concatenation widths, per-block features from one forward, heads trained together exactly as
alone, DINO's weighted k-NN vote. The CLIs run on a demo run in test_demo_runs.py."""

import math

import pytest
import torch
from torch import nn

from mpp.config import ProbeSection
from mpp.features import feature_slots, knn_scores, pooled_features
from mpp.models import create_vit
from mpp.transfer.probe import (
    LARS,
    HeadTrainer,
    LinearHead,
    Probe,
    linear_probes,
    scaled_lr,
    trust_ratio,
)
from mpp.transfer.probe_protocols import (
    DINOV2_LRS,
    dinov2_heads,
    dinov2_probe,
    dinov2_slots,
    holdout_split,
    mae_heads,
    micro_batches,
)


def test_lars_scales_a_matrix_step_by_the_trust_ratio_and_leaves_biases_plain():
    """MAE's util/lars.py: for p.ndim > 1, d = (g + wd p) * eta ||p|| / ||g + wd p||; 1-D
    parameters take g as it is (no weight decay, no ratio); mu = m mu + d; p -= lr mu."""
    w = nn.Parameter(torch.tensor([[3.0, 4.0]]))  # ||w|| = 5
    b = nn.Parameter(torch.tensor([1.0]))
    opt = LARS([w, b], lr=2.0, weight_decay=0.5, momentum=0.9)
    w.grad, b.grad = torch.tensor([[-1.5, 0.0]]), torch.tensor([2.0])
    opt.step()
    # d = g + 0.5 w = (0, 2), ||d|| = 2: ratio 0.001 * 5 / 2 = 0.0025, step 2 * 0.0025 * (0, 2)
    torch.testing.assert_close(w.data, torch.tensor([[3.0, 3.99]]))
    torch.testing.assert_close(b.data, torch.tensor([-3.0]))  # 1 - 2 * 2: no decay, no ratio
    opt.step()  # the same gradients again: momentum 0.9 carries the first update
    d2 = torch.tensor([[-1.5, 0.0]]) + 0.5 * torch.tensor([[3.0, 3.99]])
    ratio2 = 0.001 * math.hypot(3.0, 3.99) / d2.norm().item()
    expected = torch.tensor([[3.0, 3.99]]) - 2.0 * (
        0.9 * torch.tensor([[0.0, 0.005]]) + ratio2 * d2
    )
    torch.testing.assert_close(w.data, expected)
    torch.testing.assert_close(b.data, torch.tensor([-3.0 - 2.0 * (0.9 * 2.0 + 2.0)]))


def test_lars_trust_ratio_is_one_for_a_zero_weight_or_gradient():
    assert trust_ratio(torch.zeros(2, 2), torch.ones(2, 2), 0.001).item() == 1.0
    assert trust_ratio(torch.ones(2, 2), torch.zeros(2, 2), 0.001).item() == 1.0
    assert trust_ratio(
        torch.full((2, 2), 3.0), torch.full((2, 2), 4.0), 0.001
    ).item() == pytest.approx(0.00075)


def test_maes_linear_probe_head_lr_rule_and_schedule():
    """main_linprobe.py: head = BatchNorm1d(affine=False, eps=1e-6) + Linear(trunc_normal std 0.01,
    bias 0); LARS; lr = blr x batch / 256 (0.1 x 16384 / 256 = 6.4); 10 warm-up epochs of 90,
    then half-cosine to 0, per iteration."""
    assert scaled_lr(0.1, 16384) == pytest.approx(6.4)
    (probe,) = mae_heads([(11, "token")], dim=768, num_classes=1000, lr=6.4, seed=0)
    head = probe.head
    assert isinstance(head, LinearHead) and probe.facts == {"block": 11}
    assert not head.bn.affine and head.bn.eps == 1e-6 and list(head.bn.parameters()) == []
    assert head.fc.weight.std().item() == pytest.approx(
        0.01, rel=0.05
    )  # timm's trunc_normal_ cuts at +-2, not 2 std
    assert torch.count_nonzero(head.fc.bias) == 0
    steps_per_epoch = 3
    trainer = HeadTrainer(
        [probe],
        total_steps=90 * steps_per_epoch,
        warmup_steps=10 * steps_per_epoch,
        momentum=0.9,
        weight_decay=0.0,
        optimizer="lars",
    )
    assert (
        isinstance(trainer.optimizer, LARS)
        and trainer.optimizer.defaults["trust_coefficient"] == 0.001
    )
    x, y = torch.randn(4, 1, 768), torch.tensor([0, 1, 2, 3])
    lrs = []
    for _ in range(32):
        trainer.step(x, y)
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
    assert lrs[:3] == pytest.approx([0.0, 6.4 / 30, 2 * 6.4 / 30])  # linear warm-up from 0
    assert lrs[15] == pytest.approx(3.2) and lrs[30] == pytest.approx(
        6.4
    )  # the peak at warm-up's end
    assert lrs[31] == pytest.approx(
        0.5 * 6.4 * (1 + math.cos(math.pi * 1 / 240))
    )  # then cosine over 240 steps
    assert micro_batches(16384) == 16 and micro_batches(512) == 1 and micro_batches(1500) == 2


def test_dinov2_grid_is_13_lrs_times_last_1_or_4_blocks_times_cls_or_cls_and_avg():
    """dinov2/eval/linear.py: learning rates 1e-5 ... 0.1 (each x batch / 256), n_last_blocks in
    {1, 4}, avgpool in {False, True}; create_linear_input concatenates the cls tokens of the last
    n blocks, then (avgpool) the last block's mean patch token: (n + avgpool) x D wide."""
    assert DINOV2_LRS == (
        1e-5,
        2e-5,
        5e-5,
        1e-4,
        2e-4,
        5e-4,
        1e-3,
        2e-3,
        5e-3,
        1e-2,
        2e-2,
        5e-2,
        0.1,
    )
    d = 8
    probes = dinov2_heads(depth=12, dim=d, num_classes=5, batch_size=1024, seed=0)
    assert len(probes) == 2 * 2 * 13
    widths = {(p.facts["n_blocks"], p.facts["avgpool"]): p.head.in_features for p in probes}
    assert widths == {(1, False): d, (1, True): 2 * d, (4, False): 4 * d, (4, True): 5 * d}
    assert sorted({p.lr for p in probes}) == pytest.approx([lr * 1024 / 256 for lr in DINOV2_LRS])
    assert all(not isinstance(m, nn.BatchNorm1d) for p in probes for m in p.head.modules())
    assert dinov2_slots(12) == [
        (8, "token"),
        (9, "token"),
        (10, "token"),
        (11, "token"),
        (11, "avg"),
    ]
    feats = torch.arange(5.0).view(1, 5, 1).expand(1, 5, d)  # slot i holds the value i
    four_avg = next(p for p in probes if p.facts == {"lr": 0.1, "n_blocks": 4, "avgpool": True})
    one_avg = next(p for p in probes if p.facts == {"lr": 0.1, "n_blocks": 1, "avgpool": True})
    assert four_avg.inputs(feats)[0, ::d].tolist() == [
        0,
        1,
        2,
        3,
        4,
    ]  # cls of blocks 8..11, then avg
    assert one_avg.inputs(feats)[0, ::d].tolist() == [3, 4]  # cls of block 11, then avg
    assert {p.facts["n_blocks"] for p in dinov2_heads(2, d, 5, 256, 0)} == {
        1,
        2,
    }  # a 2-block encoder: n <= 2


def test_dinov2_probe_picks_on_held_out_train_and_reports_val():
    fit, held = holdout_split(1000, 0.1, seed=0)
    assert len(held) == 100 and len(fit) == 900 and not set(fit.tolist()) & set(held.tolist())
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (400,), generator=g)
    x = torch.randn(400, 5, 6, generator=g) * 0.1
    x[:, 4, :4] += nn.functional.one_hot(
        y, 4
    )  # only the averaged patch tokens (slot 4) know the class
    settings = ProbeSection(epochs=5, batch_size=32, holdout=0.1)  # momentum 0.9, weight decay 0
    res = dinov2_probe(
        (x[:300], y[:300]), (x[300:], y[300:]), 4, depth=4, settings=settings, seed=0
    )
    assert res["num_holdout"] == 30 and len(res["grid"]) == 52
    assert res["best"]["avgpool"] is True and res["top1"] > 90
    best = max(res["grid"], key=lambda r: r["holdout_top1"])
    assert res["best"]["holdout_top1"] == best["holdout_top1"] and res["top1"] == best["val_top1"]


def test_heads_trained_in_one_pass_end_as_each_would_alone():
    """The grid's premise: a shared pass (summed losses, one optimiser with a group per head)
    gives each head the training it gets alone."""
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 3, (200,), generator=g)
    x = torch.randn(200, 3, 4, generator=g)
    kw = dict(settings=ProbeSection(epochs=3, batch_size=32, warmup_epochs=1), seed=0)
    together = linear_probes(x[:150], y[:150], x[150:], y[150:], 3, **kw)
    for s in range(3):
        (alone,) = linear_probes(x[:150, s, None], y[:150], x[150:, s, None], y[150:], 3, **kw)
        assert alone["top1"] == together[s]["top1"] and alone["train_loss"] == pytest.approx(
            together[s]["train_loss"], abs=1e-6
        )


def test_every_blocks_features_come_from_one_forward_through_the_final_norm():
    """--layers all: block i's slot is the encoder cut after block i, through its final norm
    (DINOv2's get_intermediate_layers(norm=True)); the last block's is forward_features'."""
    torch.manual_seed(0)
    enc = create_vit("vit_tiny_patch4_16", depth=3, embed_dim=16, num_heads=2).eval()
    images = torch.randn(2, 3, 16, 16)
    slots = feature_slots(3, "avg", "all") + [(1, "token")]
    assert feature_slots(3, "token") == [(2, "token")]
    calls = []
    enc.blocks[0].register_forward_hook(lambda *_: calls.append(1))
    feats = pooled_features(enc, images, slots)
    assert feats.shape == (2, 4, 16) and len(calls) == 1
    with torch.no_grad():
        full = enc.forward_features(images)
        torch.testing.assert_close(feats[:, 2], full[:, 1:].mean(1))
        cut = create_vit("vit_tiny_patch4_16", depth=2, embed_dim=16, num_heads=2).eval()
        cut.load_state_dict(
            {k: v for k, v in enc.state_dict().items() if not k.startswith("blocks.2.")}
        )
        torch.testing.assert_close(feats[:, 1], cut.forward_features(images)[:, 1:].mean(1))
        torch.testing.assert_close(feats[:, 3], cut.forward_features(images)[:, 0])
    assert not enc.blocks[1]._forward_hooks  # the probe's hooks are gone


def test_knn_votes_with_exp_similarity_over_temperature():
    """DINO's weighted k-NN (eval_knn.py): the k nearest by cosine similarity vote exp(sim / T)."""
    train = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.6, 0.8], [0.0, 1.0]])
    y = torch.tensor([0, 1, 1, 0])
    scores = knn_scores(train, y, torch.tensor([[2.0, 0.0]]), num_classes=2, k=3, temperature=0.07)
    # cosine similarities to (1, 0): 1.0, 0.8, 0.6, 0.0; the 3 nearest are classes 0, 1, 1
    expected = torch.tensor([[math.exp(1.0 / 0.07), math.exp(0.8 / 0.07) + math.exp(0.6 / 0.07)]])
    torch.testing.assert_close(scores, expected)
    assert (
        scores.argmax().item() == 0
    )  # one close neighbour outvotes two farther ones (a majority says 1)
    flat = knn_scores(train, y, torch.tensor([[2.0, 0.0]]), num_classes=2, k=3, temperature=100.0)
    assert flat.argmax().item() == 1  # at a high temperature the vote is a count


def test_probe_is_a_dataclass_over_slots():
    p = Probe([2, 0], 0.1, nn.Identity())
    feats = torch.arange(6.0).view(1, 3, 2)
    assert p.inputs(feats).tolist() == [[4.0, 5.0, 0.0, 1.0]]


def _mae_probe_rank(r: int, port: int, out: dict) -> None:
    """A rank of MAE's probe whose stream (rank 1's) raises a DataError at its second batch."""
    import os

    import torch.distributed as dist

    from mpp.data.errors import DataError
    from mpp.features import FeatureSpec
    from mpp.transfer.probe import HeadTrainer
    from mpp.transfer.probe_protocols import mae_heads, mae_probe

    class Stream:
        def set_epoch(self, epoch: int) -> None:
            pass

        def __iter__(self):
            for i in range(4):
                if r == 1 and i == 1:
                    raise DataError("100 consecutive data failures (the last: a label 99)")
                yield {
                    "image": torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8),
                    "label": torch.tensor([0, 1, 2, 3]),
                }

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=2)
    try:
        torch.manual_seed(0)
        encoder = create_vit("vit_tiny_patch4_16", depth=1, embed_dim=16, num_heads=1)
        slots = feature_slots(1, "token")
        heads = HeadTrainer(
            mae_heads(slots, 16, 4, 0.1, 0),
            total_steps=4,
            warmup_steps=1,
            momentum=0.9,
            weight_decay=0.0,
            optimizer="lars",
        )
        val = (torch.randn(8, 1, 16), torch.arange(8) % 4)
        spec = FeatureSpec(slots, (0.5,) * 3, (0.25,) * 3)
        try:
            mae_probe(encoder, Stream(), heads, val, epochs=1, accum=1, features=spec)
            out[r] = "finished"
        except DataError as e:
            out[r] = f"DataError: {e}"
    finally:
        dist.destroy_process_group()


def test_a_data_error_in_maes_stream_on_one_rank_ends_every_rank():
    """MAE's probe gathers every step's features across ranks: rank 1's stream failing must end
    rank 0 too (with rank 1's error), not leave it in the next gather. Spawned ranks, 60 s limit."""
    import time

    import torch.multiprocessing as mp

    from mpp.parallel.launch import free_port

    with mp.Manager() as manager:
        out = manager.dict()
        ctx = mp.start_processes(
            _mae_probe_rank, (free_port(), out), nprocs=2, start_method="spawn", join=False
        )
        deadline = time.monotonic() + 60
        while not ctx.join(timeout=1) and time.monotonic() < deadline:
            pass
        alive = [p for p in ctx.processes if p.is_alive()]
        for p in alive:
            p.kill()
        ended = dict(out)
    assert not alive, f"a rank was left waiting: {ended}"
    assert ended[1].startswith("DataError: 100 consecutive"), ended
    assert ended[0].startswith("DataError: rank 1: 100 consecutive"), ended
