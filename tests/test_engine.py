"""The engine in-process: LR schedule, parameter groups, exact resume, the export."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import launcher, read_metrics, run_cli, tiny_config, write_config, zero
from safetensors.torch import load_file

from mpp.build import build_objective
from mpp.checkpoint.format import weights_only_loads
from mpp.checkpoint.manager import Checkpointer
from mpp.checkpoint.state import RunState
from mpp.config import validate
from mpp.hub.encoder_file import load_encoder_file
from mpp.hub.pretrained import load_pretrained
from mpp.models import create_vit
from mpp.train.optim import build_optimizer, lr_at, param_groups, set_lr


def test_lr_schedule_warmup_then_cosine():
    kw = dict(peak=1.0, total=110, warmup=10, min_lr=0.1)
    assert lr_at(0, **kw) == 0.0
    assert lr_at(5, **kw) == pytest.approx(0.5)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, **kw) == pytest.approx(0.1)


def test_param_groups_exempt_bias_norm_pos_and_tokens():
    cfg = validate(
        {
            "model": {"name": "vit_tiny_patch4_16", "depth": 1},
            "optim": {"lr": 1e-3, "weight_decay": 0.05},
            "train": {"max_steps": 1},
            "data": {"builtin": "digits"},
        }
    )
    obj = build_objective(cfg)
    groups = param_groups(obj, 0.05)
    names = {id(p): n for n, p in obj.named_parameters()}
    no_decay = {names[id(p)] for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}
    decay = {names[id(p)] for g in groups if g["weight_decay"] > 0.0 for p in g["params"]}
    assert {
        "encoder.pos_embed",
        "encoder.cls_token",
        "mask_token",
        "encoder.blocks.0.attn.qkv.bias",
        "encoder.blocks.0.norm1.weight",
        "encoder.norm.weight",
    } <= no_decay
    assert {
        "encoder.blocks.0.attn.qkv.weight",
        "encoder.patch_embed.proj.weight",
        "head.weight",
    } <= decay
    assert isinstance(
        build_optimizer(cfg, obj), torch.optim.Adam
    )  # the ViT paper's optimiser for mpp
    cfg.objective.name = "mae"


@pytest.mark.parametrize("stage", [0, 2])
def test_per_group_lr_follows_schedule_times_lr_scale_on_the_engine_optimizer(stage, dist_group):
    import deepspeed

    enc = create_vit("vit_tiny_patch4_16", depth=2, embed_dim=32, num_heads=2)
    scale = lambda name: 0.5 if name.startswith("blocks.0.") else 1.0  # noqa: E731
    opt = torch.optim.AdamW(param_groups(enc, 0.05, scale), lr=1.0)
    engine, opt, _, _ = deepspeed.initialize(
        model=enc,
        optimizer=opt,
        config={
            "train_batch_size": 2,
            "zero_optimization": zero(stage),
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        },
    )
    kw = dict(peak=1e-3, total=6, warmup=2)
    for step in range(6):
        set_lr(opt, lr_at(step, **kw))
        # the groups the underlying torch optimiser steps with, not a copy
        inner = getattr(opt, "optimizer", opt)
        for g in inner.param_groups:
            assert g["lr"] == pytest.approx(lr_at(step, **kw) * g["lr_scale"])
        assert sorted({g["lr_scale"] for g in inner.param_groups}) == [0.5, 1.0]
        loss = engine(torch.randn(2, 3, 16, 16)).pow(2).mean()
        engine.backward(loss)
        engine.step()


class WithRankState(torch.nn.Linear):
    """A model with state outside its parameters, as HPM's fp32 EMA: its own per-rank file."""

    def rank_state(self):
        return {"ema": 2 * self.weight.detach()}

    def load_rank_state(self, state):
        self.loaded = state


def test_every_part_of_the_checkpoint_round_trips_in_the_format_on_disk(tmp_path, dist_group):
    """Each part ``Checkpointer.save`` writes comes back from ``restore``: the weights, the
    RunState, the RNG and the per-rank state. The client_state keys are those of every checkpoint
    ("state", "rng": DeepSpeed keeps them beside its own), so older ones still load."""
    import deepspeed

    model = WithRankState(4, 4)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        config={"train_batch_size": 2, "steps_per_print": 10**9},
    )
    plan = SimpleNamespace(grad_accum=1, micro_batch=2)
    checkpointer = Checkpointer(engine, tmp_path, plan, keep_last=1, seed=0)
    saved = RunState(
        step=3, epoch=1, batch_in_epoch=5, samples=48, rollback_steps=[2], lr_scale=0.5
    )
    weights = model.weight.detach().clone()
    checkpointer.save(saved)
    draws = torch.rand(3)
    with torch.no_grad():
        model.weight.zero_()
    state = RunState()
    checkpointer.restore(tmp_path / "checkpoints", "step00000003", state)
    assert state == saved and torch.equal(torch.rand(3), draws)
    assert torch.equal(model.weight, weights) and torch.equal(model.loaded["ema"], 2 * weights)
    tag = tmp_path / "checkpoints" / "step00000003"
    with weights_only_loads():
        files = torch.load(tag / "mp_rank_00_model_states.pt")
    assert {"state", "rng"} <= files.keys() and (tag / "rank_state_00000.safetensors").is_file()


def test_exact_resume_equals_straight_run(tmp_path, one_rank_run):
    """8 steps straight == 4 steps, then --resume auto for 4 more: same per-step losses. The
    straight run is the suite's one-process run (conftest.one_rank_run: 2 data workers)."""
    straight, path = one_rank_run["run"], one_rank_run["config"]
    split = tmp_path / "split"
    r = run_cli(
        [
            "python",
            "pretrain/run.py",
            "--config",
            str(path),
            "--output-dir",
            str(split),
            "--set",
            "train.stop_at_step=4",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli(
        [
            "python",
            "pretrain/run.py",
            "--config",
            str(path),
            "--output-dir",
            str(split),
            "--resume",
            "auto",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr
    a, b = read_metrics(straight), read_metrics(split)
    assert [m["step"] for m in b] == list(range(1, 9)) and [m["samples"] for m in b] == [
        16 * s for s in range(1, 9)
    ]
    assert [m["loss"] for m in b] == [
        m["loss"] for m in a
    ]  # bitwise: fp32 on the CPU is deterministic
    assert [m["lr"] for m in b] == [m["lr"] for m in a]
    sd_a, kwargs = load_encoder_file(straight / "encoder.safetensors")
    sd_b, _ = load_encoder_file(split / "encoder.safetensors")
    assert kwargs["name"] == "vit_tiny_patch4_16" and kwargs["depth"] == 2
    for k in sd_a:
        torch.testing.assert_close(sd_a[k], sd_b[k], rtol=0, atol=0)
    enc = create_vit(kwargs.pop("name"), **kwargs)
    enc.load_state_dict(sd_a, strict=True)  # the export is exactly the encoder


def test_bf16_hpm_resume_is_exact_with_its_fp32_ema(tmp_path, digits16):
    """bf16 (DeepSpeed's bf16 on the CPU): HPM's fp32 EMA rides along with the checkpoint
    (rank_state_00000.safetensors), so 4 + resume + 4 steps == 8 straight, teacher included.
    Without it the EMA restarts from the bf16 teacher: measured 65 of 66 tensors differ."""
    cfg = tiny_config(
        digits16,
        train={"max_steps": 8, "ckpt_every": 4, "precision": "bf16"},
        objective={
            "name": "hpm",
            "base": "mae",
            "decoder_dim": 32,
            "decoder_depth": 1,
            "decoder_heads": 2,
            "momentum_start": 0.99,
            "momentum_end": 0.999,
            "momentum_epochs": 1,
            "hard_ratio": 0.5,
        },
    )
    cfg.pop("masking")
    path = write_config(tmp_path / "c.json", cfg)
    straight, split = tmp_path / "straight", tmp_path / "split"
    for out, extra in (
        (straight, []),
        (split, ["--set", "train.stop_at_step=4"]),
        (split, ["--resume", "auto"]),
    ):
        r = run_cli(
            ["python", "pretrain/run.py", "--config", str(path), "--output-dir", str(out), *extra]
        )
        assert r.returncode == 0, r.stderr[-3000:]
    assert [m["loss"] for m in read_metrics(split)] == [m["loss"] for m in read_metrics(straight)]
    ema = [
        load_file(out / "checkpoints" / "step00000008" / "rank_state_00000.safetensors")
        for out in (straight, split)
    ]
    assert len(ema[0]) > 20 and all(v.dtype == torch.float32 for v in ema[0].values())
    for k in ema[0]:
        assert torch.equal(ema[0][k], ema[1][k]), k


@pytest.mark.parametrize("stage", [0, 1])
def test_bf16_runs_export_their_fp32_master_weights(tmp_path, digits16, stage):
    """bf16 params, fp32 masters in DeepSpeed's optimiser: the exported encoder is the masters
    (finer than bf16), and the module's bf16 weights are those masters rounded."""
    cfg = tiny_config(
        digits16,
        train={"max_steps": 4, "ckpt_every": 4, "precision": "bf16"},
        deepspeed={"zero_optimization": zero(stage)},
    )
    out = tmp_path / "run"
    r = run_cli(
        [
            "python",
            "pretrain/run.py",
            "--config",
            str(write_config(tmp_path / "c.json", cfg)),
            "--output-dir",
            str(out),
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    enc, _ = load_encoder_file(out / "encoder.safetensors")
    with weights_only_loads():
        module = torch.load(out / "checkpoints" / "step00000004" / "mp_rank_00_model_states.pt")[
            "module"
        ]
    w = "blocks.0.attn.qkv.weight"
    assert module[f"encoder.{w}"].dtype == torch.bfloat16 and enc[w].dtype == torch.float32
    assert torch.equal(enc[w].bfloat16(), module[f"encoder.{w}"])
    assert not torch.equal(enc[w], enc[w].bfloat16().float())  # more than bf16 precision
    # the checkpoint as a downstream init: ZeRO's masters, or stage 0's module weights upcast
    sd, _ = load_pretrained(out / "checkpoints")
    assert torch.equal(sd[w], enc[w] if stage else module[f"encoder.{w}"].float())


@pytest.mark.parametrize("name", ["mpp", "mae"])
def test_bf16_objectives_take_their_targets_from_the_exact_pixels(name):
    """The engine hands objectives fp32 images whatever the precision; a bf16 model casts at its
    patch embedding, so MPP's colour classes and MAE's norm-pix targets equal fp32's bitwise."""
    import copy

    from mpp.objectives import create_objective as build_by_name
    from mpp.ops import IMAGENET_MEAN, IMAGENET_STD
    from mpp.train.trainer import to_device

    g = torch.Generator().manual_seed(0)
    ramp = torch.linspace(0, 255, 64).view(1, 1, 1, 64) + 40 * torch.rand(8, 3, 64, 1, generator=g)
    pixels = ramp.clamp(0, 255).round().to(torch.uint8)  # smooth: many patch means near a bin edge
    images = to_device({"image": pixels}, torch.device("cpu"), IMAGENET_MEAN, IMAGENET_STD)["image"]
    assert images.dtype == torch.float32
    torch.manual_seed(0)
    fp32 = build_by_name(
        name,
        create_vit("vit_tiny_patch8_64", depth=1, embed_dim=32, num_heads=2),
        **({"decoder_dim": 32, "decoder_depth": 1, "decoder_heads": 2} if name == "mae" else {}),
    )
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    assert torch.equal(bf16.targets(images), fp32.targets(images))
    loss, _ = bf16(images)  # runs: the patch embedding casts the fp32 images to the model's dtype
    assert torch.isfinite(loss)
    # what the engine used to do (cast the images to bf16 first) moves the targets
    assert not torch.equal(
        fp32.targets(images.to(torch.bfloat16)).float(), fp32.targets(images).float()
    )


@pytest.mark.slow
def test_stage0_multi_tensor_path_matches_deepspeeds_on_3_ranks(tmp_path):
    """ZeRO stage 0 with fp32 weights (bf16 autocast): the trainer's engine all-reduces and clips
    the gradients in multi-tensor ops (``mpp.parallel.stage0``). On 3 gloo ranks with rank-specific
    data and an active clip, its reduced gradients (the mean: a sum would be 3x), clipped
    gradients and weights after two accumulated steps equal DeepSpeed's own path's, and every rank
    holds the same weights."""
    out = tmp_path / "stage0.json"
    cmd = launcher(3)
    r = run_cli([*cmd, "tests/stage0_probe.py", str(out)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["world"] == 3 and got["multi_tensor_path"] is True
    assert got["torch_autocast"]["enabled"] and got["gradient_clipping"] == 0.05
    norms = got["grad_norms"]
    assert norms["reduced"] > 0.05 and norms["clipped"] == pytest.approx(0.05, rel=1e-4)
    assert got["vs_deepspeed"]["reduced"] < 1e-5 * norms["reduced"]
    assert got["vs_deepspeed"]["clipped"] < 1e-6 and got["vs_deepspeed"]["weights"] < 1e-6
    assert got["across_ranks"] == 0.0 and got["moved"] > 1e-5
