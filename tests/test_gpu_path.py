"""The GPU path's settings, pinned on the CPU (issue 22 §5): configs that split on 8-64 GPUs,
DeepSpeed keys that keep host syncs out of the step and reductions in fp32, and a real bf16
engine that holds them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mpp.config import Config, ConfigError, FinetuneConfig, load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# the training configs: not the probes' (linear_*) nor the ablation specs (a "grid")
TRAINING = {
    p.stem: p
    for p in sorted(CONFIGS.glob("*.json"))
    if not p.stem.startswith("linear") and "grid" not in json.loads(p.read_text())
}
# the tiny models' decoders (MAE's pixel decoder, HPM's loss predictor): 2 blocks 32 wide, not the
# default 8 x 512; the same modules at any size
SMALL_DECODER = {"decoder_dim": 32, "decoder_depth": 2, "decoder_heads": 2}


def shipped(name: str):
    cls = FinetuneConfig if name.startswith("finetune") else Config
    shards = ["data.train_shards=/nowhere/{0..1}.tar", "data.val_shards=/nowhere/v.tar"]
    return load_config(TRAINING[name], shards, cls=cls)


@pytest.mark.parametrize("name", sorted(TRAINING))
@pytest.mark.parametrize("world", [1, 8, 16, 32, 64])
def test_every_shipped_config_splits_its_batch_on_1_to_64_gpus(name, world):
    """The *_b16 recipes (4096 / 1024 images) exited 2 on 64 ranks: micro 256 x 64 > 4096."""
    cfg = shipped(name)
    t = cfg.train
    if t.batch_size % world:  # the demos' small batches: not a 64-GPU recipe
        pytest.skip(f"batch {t.batch_size} on {world} ranks")
    micro, accum = cfg.micro_batch(world)
    assert micro * accum * world == t.batch_size
    assert micro <= (t.max_micro_batch_size or t.micro_batch_size or micro)
    if t.max_micro_batch_size:  # fewest accumulation steps under the bound
        assert (
            accum == 1
            or t.batch_size // world // (accum - 1) > t.max_micro_batch_size
            or ((t.batch_size // world) % (accum - 1))
        )


def test_max_micro_batch_size_picks_the_fewest_accumulation_steps():
    cfg = shipped("mpp_b16")  # 4096, at most 256 per rank
    assert [cfg.micro_batch(w) for w in (8, 16, 64)] == [(256, 2), (256, 1), (64, 1)]
    cfg.train.max_micro_batch_size = 100
    assert cfg.micro_batch(8) == (
        512 // 8,
        8,
    )  # 512 per rank: 6 steps of 85.3 do not split; 8 of 64 do
    with pytest.raises(ValueError, match="world size 3"):
        cfg.micro_batch(3)
    with pytest.raises(ValueError, match="not both"):
        shipped("mpp_b16").train.model_validate(
            {"batch_size": 8, "micro_batch_size": 2, "max_micro_batch_size": 4, "max_steps": 1}
        )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_config_for_gpus(stage):
    """No throughput timer (two device syncs per micro-step); 5e7-element buckets at ZeRO-1/2/3,
    overlapped at 1/2; bf16 gradients reduced in fp32 everywhere and accumulated in fp32 at ZeRO-2/3."""
    cfg = shipped("mae_b16")
    cfg.deepspeed = {"zero_optimization": {"stage": stage}}
    ds = cfg.deepspeed_config(8, "cuda")
    assert ds["timers"] == {"throughput": {"enabled": False}}
    # MAE clips nothing: DeepSpeed's own default would clip at 1.0
    assert ds["gradient_clipping"] == 0.0
    if stage == 0:  # auto: fp32 weights under bf16 autocast, the multi-tensor path
        assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"} and "bf16" not in ds
    else:  # mpp's finite-loss check guards: no per-gradient overflow check of DeepSpeed's
        assert ds["bf16"] == {"enabled": True, "check_grad_overflow": False}
        assert ds["communication_data_type"] == "fp32" and "torch_autocast" not in ds
    assert ("data_types" in ds) == (stage >= 2)
    zero = ds["zero_optimization"]
    # left to DeepSpeed: compute_grad_norm=false refuses checkpoints saved with a clip of 1.0
    assert "compute_grad_norm" not in zero
    if stage > 0:  # under autocast every gradient is reduced in fp32 too
        cfg.train.precision = "bf16-autocast"
        autocast = cfg.deepspeed_config(8, "cuda")["torch_autocast"]
        assert autocast["lower_precision_safe_modules"] == []
    assert zero.get("overlap_comm") == (
        True if stage in (1, 2) else None
    )  # DeepSpeed's own default at 3
    assert zero.get("reduce_bucket_size") == (int(5e7) if stage else None)
    assert "communication_data_type" not in cfg.deepspeed_config(
        8, "cpu"
    )  # fp32 on the CPU: nothing to say
    cfg.deepspeed = {
        "zero_optimization": {"stage": 2, "overlap_comm": False},
        "communication_data_type": "bf16",
    }
    ds = cfg.deepspeed_config(8, "cuda")  # the user's word wins
    assert (
        ds["zero_optimization"]["overlap_comm"] is False and ds["communication_data_type"] == "bf16"
    )


def test_the_users_precision_keys_survive_and_the_derived_ones_are_refused(tmp_path):
    """``deepspeed.bf16`` / ``torch_autocast`` keys other than what ``train.precision`` decides reach
    DeepSpeed (``derive`` used to replace the section with ``{"enabled": true}``); ``enabled`` and
    the autocast dtype are refused, naming the key and the file; clipping is DeepSpeed's only
    where ``optim.grad_clip`` says so."""
    cfg = shipped("mae_b16")
    cfg.deepspeed = {"zero_optimization": {"stage": 1}, "bf16": {"check_grad_overflow": True}}
    assert cfg.deepspeed_config(8, "cuda")["bf16"] == {"enabled": True, "check_grad_overflow": True}
    safe = ["torch.nn.Linear"]
    cfg.deepspeed = {"torch_autocast": {"lower_precision_safe_modules": safe}}
    assert cfg.deepspeed_config(8, "cuda")["torch_autocast"] == {
        "lower_precision_safe_modules": safe,
        "enabled": True,
        "dtype": "bfloat16",
    }
    cfg.train.skip_nonfinite = False  # no check of mpp's: DeepSpeed's own stays on
    cfg.deepspeed = {"zero_optimization": {"stage": 1}}
    assert cfg.deepspeed_config(8, "cuda")["bf16"] == {"enabled": True}
    mpp_cfg = shipped("mpp_b16")  # clips at 1.0: the norm is needed
    mpp_cfg.deepspeed = {"zero_optimization": {"stage": 2}}
    ds = mpp_cfg.deepspeed_config(8, "cuda")
    assert ds["gradient_clipping"] == 1.0 and "compute_grad_norm" not in ds["zero_optimization"]
    for section, key in [("bf16", "enabled"), ("torch_autocast", "dtype"), ("fp16", True)]:
        path = tmp_path / f"{section}.json"
        raw = json.loads((CONFIGS / "mae_b16.json").read_text())
        # a key of it, or a bare value where DeepSpeed's object goes ("fp16": true)
        raw["deepspeed"][section] = {key: True} if isinstance(key, str) else key
        raw["data"]["train_shards"] = "x-{000000..000001}.tar"
        path.write_text(json.dumps(raw))
        said = rf"\.{key} is derived" if isinstance(key, str) else " must be an object"
        with pytest.raises(ConfigError, match=rf"{path.name}.*deepspeed\.{section}{said}"):
            load_config(str(path))


def test_a_resume_in_another_precision_is_refused_naming_the_key(tmp_path):
    """The weights' dtype and the optimizer's states differ between DeepSpeed's bf16 and bf16
    autocast: a checkpoint is resumed in the precision it was trained in, or refused before
    anything starts, naming train.precision, both values and what to set. A checkpoint from
    before issue 36 states no precision: its run's "auto" was bf16 on a GPU."""
    from mpp.checkpoint.format import MARKER, tag_for
    from mpp.train.plan import check_resume

    cfg = shipped("mae_b16")
    cfg.train.output_dir = str(tmp_path / "run")
    cfg.train.precision = "bf16-autocast"
    tag = tmp_path / "run" / "checkpoints" / tag_for(10)
    tag.mkdir(parents=True)
    layout = {"step": 10, "batch_size": 4096, "zero_stage": 1, "world_size": 8}
    said = r"train\.precision.*bf16-autocast.*trained in bf16 at stage 1.*set train\.precision=bf16"
    for saved, refused in [
        ({}, True),
        ({"precision": "bf16"}, True),
        ({"precision": "bf16-autocast"}, False),
    ]:
        (tag / MARKER).write_text(json.dumps({**layout, **saved}))
        if refused:
            with pytest.raises(ConfigError, match=said):
                check_resume(cfg, "auto")
        else:
            check_resume(cfg, "auto")


def test_zero_offload_runs_with_our_optimizer(tmp_path, digits16, dist_group):
    """ZeRO-Offload raised at initialize (zero_force_ds_cpu_optimizer with a torch optimizer);
    and a bf16 ZeRO-2 engine accumulates and reduces in fp32 with its throughput timer off."""
    import deepspeed
    from conftest import tiny_config

    from mpp.build import build_objective
    from mpp.train.optim import build_optimizer

    raw = tiny_config(
        digits16,
        train={"precision": "bf16", "micro_batch_size": 8},
        deepspeed={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    )
    cfg = Config.model_validate(raw)
    objective = build_objective(cfg)
    ds = cfg.deepspeed_config(
        1, "cpu"
    )  # bf16 asked for: fp32 reductions and accumulation, as on a GPU
    engine, *_ = deepspeed.initialize(
        model=objective, optimizer=build_optimizer(cfg, objective), config=ds
    )
    assert engine.communication_data_type == torch.float32
    assert engine.optimizer.gradient_accumulation_dtype == torch.float32
    assert engine.tput_timer.config.enabled is False
    x = torch.randn(8, 3, 16, 16, dtype=torch.bfloat16)
    for _ in range(2):  # two micro-batches, one step
        engine.backward(engine(x)[0])
        engine.step()
    assert engine.global_steps == 1


class TensorsFromHost(torch.overrides.TorchFunctionMode):
    """Counts tensors built from Python / NumPy data: on a GPU each is a blocking host-to-device copy."""

    MAKERS = {torch.tensor, torch.as_tensor, torch.from_numpy, torch.Tensor.new_tensor}

    def __init__(self):
        super().__init__()
        self.made: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.MAKERS:
            self.made.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "objective",
    [
        {"name": "mpp"},
        {"name": "mae", **SMALL_DECODER},
        {"name": "hpm", "base": "mpp", **SMALL_DECODER},
        {"name": "hpm", "base": "mae", **SMALL_DECODER},
    ],
)
def test_a_training_step_builds_no_tensor_from_host_data(digits16, objective):
    """MPP's unnormalize built mean/std from lists every step (also under HPM with base mpp)."""
    from conftest import tiny_config

    from mpp.build import build_objective

    model = build_objective(Config.model_validate(tiny_config(digits16, objective=objective)))
    images = torch.randn(4, 3, 16, 16)
    counts = []
    for _ in range(2):  # the first step may fill per-device caches
        with TensorsFromHost() as mode:
            loss, _ = model(images)
            loss.backward()
        counts.append(mode.made)
    assert counts[1] == []


def test_rng_restore_with_fewer_visible_gpus_than_at_save(monkeypatch):
    """set_rng_state_all raised IndexError when a rank saw fewer GPUs than at save (8 x 8
    resumed as 16 x 4, or one visible GPU per SLURM task): each rank keeps its own device's."""
    from mpp.checkpoint.state import rng_state, set_rng_state

    states = [torch.full((4,), i, dtype=torch.uint8) for i in range(8)]
    set_to = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": states[3])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # one GPU visible to this task
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda s, device="cuda": set_to.append(int(s[0]))
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state_all", lambda s: pytest.fail("restores every device")
    )
    saved = rng_state()
    assert [int(s[0]) for s in saved["cuda"]] == [3]  # only the rank's own device
    set_rng_state(saved)
    set_rng_state({**saved, "cuda": states})  # a checkpoint in the old all-devices format
    assert set_to == [3, 0]


def test_gloo_side_group_only_where_gloo_can_connect_the_nodes(monkeypatch):
    """The preemption flag's gloo group failed across nodes whose hostname maps to 127.0.1.1
    ("connectFullMesh failed"): there the ranks agree to use the default group instead."""
    import socket

    from mpp.train import preemption

    monkeypatch.setattr(preemption.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(preemption.dist, "get_world_size", lambda: 16)
    for var in ("GLOO_SOCKET_IFNAME", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(socket, "gethostbyname", lambda host: "127.0.1.1")
    assert not preemption.gloo_reachable()  # two nodes, Debian's /etc/hosts
    monkeypatch.setenv("LOCAL_SIZE", "16")  # DeepSpeed's launcher: one node holds every rank
    assert preemption.gloo_reachable()
    monkeypatch.setenv("LOCAL_SIZE", "8")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    assert preemption.gloo_reachable()
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setattr(socket, "gethostbyname", lambda host: "10.1.2.3")
    assert preemption.gloo_reachable()


def test_zero3_gather_stream_is_where_the_ema_ordering_looks(digits16, dist_group):
    """HPM's EMA writes ZeRO-3 shards on the default stream; the next gather runs on DeepSpeed's
    own stream (overlap_comm) and does not wait for it. ``gather_stream`` finds it to wait on:
    pin the private attribute it reads, so a DeepSpeed upgrade that renames it fails here."""
    import deepspeed
    from conftest import tiny_config, zero

    from mpp.build import build_objective
    from mpp.parallel import zero as zero_internals
    from mpp.train.optim import build_optimizer

    cfg = Config.model_validate(
        tiny_config(
            digits16,
            objective={"name": "hpm", "base": "mae", **SMALL_DECODER},
            deepspeed={"zero_optimization": zero(3)},
        )
    )
    objective = build_objective(cfg)
    _, optimizer, _, _ = deepspeed.initialize(
        model=objective,
        optimizer=build_optimizer(cfg, objective),
        config=cfg.deepspeed_config(1, "cpu"),
    )
    coordinator = optimizer.parameter_offload.get_param_coordinator()
    assert hasattr(
        coordinator, "_PartitionedParameterCoordinator__allgather_stream"
    )  # None on the CPU
    assert zero_internals.gather_stream(optimizer) is None  # no CUDA here, and no error


def test_fine_tune_evaluation_reads_with_the_configured_workers(
    monkeypatch, tmp_path, digits16, dist_group
):
    """The evaluation loader was capped at one worker per rank: on a GPU node, one process decoding
    a 50k-image validation set while the GPUs wait."""
    from types import SimpleNamespace

    from conftest import tiny_config

    from mpp.transfer import evaluate

    seen = {}

    class Enough(Exception):  # the loader's settings are what this test reads
        pass

    def loader(shards, **kwargs):
        seen.update(kwargs)
        raise Enough

    monkeypatch.setattr(evaluate, "make_eval_loader", loader)
    raw = tiny_config(digits16, data={"num_workers": 6, "val_shards": digits16["val"]})
    raw.pop("objective"), raw.pop("masking")
    cfg = FinetuneConfig.model_validate(raw)
    from mpp.data.stats import Pixels
    from mpp.data.transforms import PixelFormat

    pixels = Pixels((0.5,) * 3, (0.25,) * 3, PixelFormat(3))
    plan = SimpleNamespace(img_size=16, micro_batch=8, steps_per_epoch=1, pixels=pixels)
    ev = evaluate.Evaluator(cfg, plan, tmp_path, torch.device("cpu"), {})
    with pytest.raises(Enough):
        ev(SimpleNamespace(module=SimpleNamespace(num_classes=10)), SimpleNamespace(step=1))
    assert seen["num_workers"] == 6
