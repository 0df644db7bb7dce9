"""The training engine: DeepSpeed init, parameter groups, the LR schedule, the step loop,
logging and checkpoints. Read it top to bottom; DeepSpeed does the heavy lifting underneath.

The engine knows nothing objective-specific: it calls ``objective(images) -> (loss, metrics)``
and the two hooks of ``mpp.objectives.base.Objective``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mpp import checkpoint as ckpt
from mpp.config import ConfigError, RunConfig, save_config
from mpp.data import count_samples, digits_shards, expand_shards, make_train_loader, normalize
from mpp.launch import free_port

log = logging.getLogger("mpp.engine")


# ---- distributed -----------------------------------------------------------------------------


def world_from_env() -> tuple[int, int]:
    """(rank, world size) as the launcher set them; a plain ``python`` run is rank 0 of 1."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed() -> torch.device:
    """Join the process group the launcher (deepspeed, torchrun, slurm) describes, or make a
    one-process group for ``python pretrain/run.py``. gloo on CPU, NCCL on GPU."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    unlink_shm_buffer()
    return torch.device("cpu")


def unlink_shm_buffer() -> None:
    """DeepSpeed's CPU all-reduce (its shm comm op) creates one 66 MB /dev/shm buffer per rank
    and never unlinks it: every CPU run leaked 66 MB per rank until the machine ran out of
    memory (20 GB after a day of tests here). By the time init returns, every rank has mapped
    every peer's buffer; after a barrier each rank unlinks its own name. The memory stays
    mapped while the job runs and is freed when it ends, even on SIGKILL."""
    dist.barrier()
    env = os.environ
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR')}_{env.get('MASTER_PORT')}_{dist.get_rank()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(Path("/dev/shm") / name)


# ---- optimiser and schedule -----------------------------------------------------------------


def param_groups(
    model: torch.nn.Module, weight_decay: float, lr_scale_of: Callable[[str], float] | None = None
) -> list[dict[str, Any]]:
    """Trainable parameters grouped by (weight decay, lr scale). No decay on biases, norms
    (any 1-D tensor) and the model's ``no_weight_decay()`` names (position embeddings, tokens)."""
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    groups: dict[tuple[float, float], dict[str, Any]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = 0.0 if p.ndim <= 1 or name.endswith(".bias") or name in skip else weight_decay
        scale = lr_scale_of(name) if lr_scale_of else 1.0
        group = groups.setdefault((decay, scale), {"params": [], "weight_decay": decay, "lr_scale": scale})
        group["params"].append(p)
    return list(groups.values())


PAPER_OPTIMIZER = {"mpp": "adam", "mae": "adamw", "hpm": "adamw"}  # ViT paper: Adam; MAE/HPM: AdamW


def build_optimizer(cfg: RunConfig, model: torch.nn.Module, lr_scale_of=None) -> torch.optim.Optimizer:
    o = cfg.optim
    objective = getattr(cfg, "objective", None)  # fine-tuning has none: AdamW
    name = o.name or PAPER_OPTIMIZER.get(objective.name if objective else "", "adamw")
    groups = param_groups(model, o.weight_decay, lr_scale_of)
    return adam(name, groups, peak_lr(cfg), o.betas, o.eps)


def adam(
    name: str, groups: list[dict], lr: float, betas: tuple[float, float] | None = None, eps: float = 1e-8
) -> torch.optim.Optimizer:
    """torch's Adam ("adam": L2-style decay, as the ViT paper's Adam with weight decay) or
    AdamW, betas by default the paper's: (0.9, 0.999) for Adam, (0.9, 0.95) for AdamW (MAE).

    Fused kernels on CPU and CUDA: one pass over each group instead of ~8 foreach ops; a
    ViT-S Adam step takes 15 ms instead of 75 ms on one CPU core (BENCHMARKS.md, cpu-step)."""
    betas = betas or ((0.9, 0.999) if name == "adam" else (0.9, 0.95))
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return cls(groups, lr=lr, betas=betas, eps=eps, fused=True)


def peak_lr(cfg: RunConfig) -> float:
    """Absolute lr, or MAE's linear scaling rule: blr x global batch / 256."""
    return cfg.optim.lr if cfg.optim.lr is not None else cfg.optim.blr * cfg.train.batch_size / 256


def lr_at(step: int, *, peak: float, total: int, warmup: int, min_lr: float = 0.0) -> float:
    """Linear warm-up from 0, then half-cosine to ``min_lr`` (MAE's per-iteration schedule)."""
    if step < warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Per-group lr = lr x lr_scale, on the engine's optimiser (DeepSpeed schedulers would
    flatten the per-group scales)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


# ---- the plan: everything checked before a run directory exists -----------------------------


@dataclass
class Plan:
    train_shards: list[str]
    samples_per_epoch: int
    steps_per_epoch: int  # optimiser steps
    total_steps: int
    warmup_steps: int
    micro_batch: int
    grad_accum: int
    world_size: int
    img_size: int
    ds_config: dict
    missing_shards: int = 0

    @property
    def micro_per_epoch(self) -> int:  # micro-batches per rank per epoch
        return self.steps_per_epoch * self.grad_accum

    @property
    def total_epochs(self) -> float:
        return self.total_steps / self.steps_per_epoch


def plan_run(cfg: RunConfig, world_size: int, dev_type: str, img_size: int) -> Plan:
    """Resolve data, batch and schedule; any problem is a ConfigError naming the key."""
    src = getattr(cfg, "_source", "<config>")

    def fail(key: str, msg: str) -> ConfigError:
        return ConfigError(f"{src}: {key}: {msg}")

    try:
        micro, accum = cfg.micro_batch(world_size)
    except ValueError as e:
        raise fail("train.batch_size", str(e)) from None
    try:
        ds_config = cfg.deepspeed_config(world_size, dev_type)
    except ValueError as e:
        raise fail("train.precision", str(e)) from None
    d = cfg.data
    if d.train_shards is None:
        spec, key = digits_shards(img_size)["train"], "data.builtin"
    else:
        spec, key = d.train_shards, "data.train_shards"
    try:
        shards = expand_shards(spec)
    except ValueError as e:
        raise fail(key, str(e)) from None
    local_missing = [s for s in shards if "://" not in s and not s.startswith("pipe:") and not Path(s).is_file()]
    if len(local_missing) == len(shards):
        raise fail(key, f"{len(local_missing)} shard(s) not found, first: {local_missing[0]}")
    if local_missing:  # a lost shard costs its samples, not the run; named once, counted in metrics
        log.warning("%d of %d shards not found, training without them: %s", len(local_missing), len(shards),
                    ", ".join(local_missing[:10]))
        shards = [s for s in shards if s not in set(local_missing)]
    if any(s.startswith("pipe:") for s in shards) and not d.allow_pipe:
        raise fail(key, "pipe: shards run shell commands; set data.allow_pipe=true to allow them")
    if d.num_samples is not None:
        samples = d.num_samples
    else:
        try:
            samples = count_samples(shards)
        except ValueError as e:
            raise fail("data.num_samples", f"{e} (set data.num_samples for shards without sizes.json)") from None
    steps_per_epoch = samples // cfg.train.batch_size
    if steps_per_epoch < 1:
        raise fail("train.batch_size", f"{cfg.train.batch_size} exceeds the {samples} samples of an epoch")
    t = cfg.train
    total = t.max_steps if t.max_steps is not None else math.ceil(t.epochs * steps_per_epoch)
    o = cfg.optim
    warmup = o.warmup_steps if o.warmup_steps is not None else round((o.warmup_epochs or 0.0) * steps_per_epoch)
    return Plan(shards, samples, steps_per_epoch, total, warmup, micro, accum, world_size, img_size, ds_config,
                len(local_missing))


# ---- run state and RNG ---------------------------------------------------------------------


@dataclass
class RunState:
    step: int = 0  # optimiser steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches this rank consumed in the current epoch
    samples: int = 0  # images seen, all ranks
    bad_steps: int = 0


def rng_state() -> dict[str, Any]:
    """This process's RNG states, as plain lists and tensors (loadable with weights_only)."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    v, internal, gauss = s["python"]
    random.setstate((v, tuple(internal), gauss))
    n = s["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---- logging -------------------------------------------------------------------------------


class MetricLog:
    """metrics.jsonl + TensorBoard on rank 0; sums metrics on the device between log steps so
    the step itself never waits for the host."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.rank = rank
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0
        self.data_wait = 0.0
        self.t0 = time.perf_counter()
        self.samples0 = 0
        self.file = open(run_dir / "metrics.jsonl", "a") if rank == 0 else None
        self.tb = None
        if rank == 0:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tb"))
            except ImportError:  # tensorboard is optional at run time
                log.warning("tensorboard not installed: no event files")

    def add(self, metrics: dict[str, torch.Tensor], data_wait: float) -> None:
        for k, v in metrics.items():
            v = v.detach().float()
            self.sums[k] = self.sums[k] + v if k in self.sums else v.clone()
        self.count += 1
        self.data_wait += data_wait

    def flush(self, state: RunState, plan: Plan, lr: float, skipped: int) -> dict[str, float] | None:
        """All-reduce the averages (every rank calls this), write one record on rank 0."""
        keys = sorted(self.sums)
        dev = self.sums[keys[0]].device
        extra = torch.tensor([float(skipped), self.data_wait], device=dev)
        stats = torch.cat([torch.stack([self.sums[k] / self.count for k in keys]), extra])
        dist.all_reduce(stats)
        values = stats.tolist()
        world = dist.get_world_size()
        elapsed = time.perf_counter() - self.t0
        record = {
            "step": state.step,
            "epoch": round(state.step / plan.steps_per_epoch, 4),
            "samples": state.samples,
            **{k: values[i] / world for i, k in enumerate(keys)},
            "lr": lr,
            "imgs_per_sec": (state.samples - self.samples0) / max(elapsed, 1e-9),
            "data_wait_frac": values[-1] / world / max(elapsed, 1e-9),
            "skipped": int(values[-2]),
            "missing_shards": plan.missing_shards,
            "bad_steps": state.bad_steps,
        }
        self.sums, self.count, self.data_wait = {}, 0, 0.0
        self.t0, self.samples0 = time.perf_counter(), state.samples
        if self.rank == 0:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            if self.tb is not None:
                for k, v in record.items():
                    if k != "step":
                        self.tb.add_scalar(f"train/{k}", v, state.step)
        return record

    def write(self, state: RunState, plan: Plan, values: dict | None) -> None:
        """An extra record (e.g. validation results) at this step, rank 0 only."""
        if self.rank != 0 or not values:
            return
        record = {"step": state.step, "epoch": round(state.step / plan.steps_per_epoch, 4), **values}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(f"val/{k}", v, state.step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()


# ---- non-finite losses ----------------------------------------------------------------------


class NonFiniteLossError(RuntimeError):
    """Too many steps with a NaN/Inf loss: the run stops, its last checkpoint untouched."""


def all_finite(loss: torch.Tensor) -> bool:
    """True when the loss is finite on every rank. One small all-reduce and host sync per
    micro-step: the price of never applying a NaN update (``train.skip_nonfinite``)."""
    bad = (~torch.isfinite(loss.detach())).float().reshape(1)
    dist.all_reduce(bad)
    return bad.item() == 0.0


def skip_bad_step(state: RunState, limit: int, rank: int) -> None:
    state.bad_steps += 1
    if rank == 0:
        log.warning("non-finite loss at step %d: skipped (%d of at most %d)", state.step + 1, state.bad_steps, limit)
    if state.bad_steps > limit:
        raise NonFiniteLossError(
            f"{state.bad_steps} steps with a non-finite loss (train.max_bad_steps={limit}); stopped at step "
            f"{state.step}, the last complete checkpoint is untouched (lower the lr, check the data)"
        )


# ---- the loop ------------------------------------------------------------------------------


def train(
    cfg: RunConfig,
    objective: torch.nn.Module,
    plan: Plan,
    run_dir: Path,
    device: torch.device,
    resume: str | None = None,
    model_kwargs: dict | None = None,
    lr_scale_of: Callable[[str], float] | None = None,
    loader_kwargs: dict | None = None,
    on_epoch_end: Callable[[Any, RunState], dict | None] | None = None,
    desc: str = "pretrain",
) -> RunState:
    """Train ``objective`` under DeepSpeed for ``plan.total_steps`` optimiser steps.

    ``lr_scale_of(name)`` scales a parameter's lr (layer decay); ``loader_kwargs`` go to the
    training loader (e.g. RandAugment); ``on_epoch_end(engine, state)`` runs on every rank after
    each epoch and at the end, and what it returns is logged (evaluation)."""
    from tqdm import tqdm

    rank, world = dist.get_rank(), dist.get_world_size()
    seed_everything(cfg.train.seed + rank)  # ranks draw different masks; data has its own seeds
    stop = min(plan.total_steps, cfg.train.stop_at_step or plan.total_steps)
    with_labels = getattr(objective, "needs_labels", False)
    ckpt_root = run_dir / "checkpoints"
    engine, optimizer, state = start_engine(cfg, objective, plan, ckpt_root, resume, lr_scale_of)
    model = engine.module
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else torch.float32

    def save() -> None:
        rngs = [None] * world
        dist.all_gather_object(rngs, rng_state())
        ckpt.save_checkpoint(engine, ckpt_root, state.step, {"state": asdict(state), "rng": rngs}, cfg.train.keep_last,
                             rank_state=objective.rank_state())  # fmt: skip

    peak = peak_lr(cfg)
    schedule = dict(peak=peak, total=plan.total_steps, warmup=plan.warmup_steps, min_lr=cfg.optim.min_lr)
    lr = lr_at(state.step, **schedule)
    set_lr(optimizer, lr)
    metrics_log = MetricLog(run_dir, rank)
    bar = tqdm(total=plan.total_steps, initial=state.step, disable=rank != 0, dynamic_ncols=True, desc=desc)
    d = cfg.data
    skipped_before = 0  # bad samples this rank skipped in finished epochs

    try:
        while state.step < stop:
            loader = make_train_loader(
                plan.train_shards, batch_size=plan.micro_batch, num_batches=plan.micro_per_epoch,
                img_size=plan.img_size, crop_scale=d.crop_scale, crop_ratio=d.crop_ratio, hflip=d.hflip,
                seed=cfg.train.seed, epoch=state.epoch, rank=rank, world_size=world, num_workers=d.num_workers,
                start_batch=state.batch_in_epoch, shuffle_buffer=d.shuffle_buffer, allow_pipe=d.allow_pipe,
                with_labels=with_labels, **(loader_kwargs or {}),
            )  # fmt: skip
            skipped_epoch = 0
            t_wait = time.perf_counter()
            for batch in loader:
                data_wait = time.perf_counter() - t_wait
                skipped_epoch = batch["skipped"]
                images = normalize(batch["image"].to(device, non_blocking=True), d.mean, d.std).to(dtype)
                model.set_progress(state.epoch + state.batch_in_epoch / plan.micro_per_epoch, plan.total_epochs)
                loss, metrics = engine(images, batch["label"].to(device)) if with_labels else engine(images)
                stepped = False
                if cfg.train.skip_nonfinite and not all_finite(loss):
                    skip_bad_step(state, cfg.train.max_bad_steps, rank)  # every rank agrees: no backward, no step
                else:
                    engine.backward(loss)
                    stepped = engine.is_gradient_accumulation_boundary()
                    engine.step()
                    metrics_log.add({"loss": loss, **metrics}, data_wait)
                state.batch_in_epoch += 1
                epoch_done = state.batch_in_epoch >= plan.micro_per_epoch
                if epoch_done:
                    state.epoch, state.batch_in_epoch = state.epoch + 1, 0
                if stepped:
                    model.after_optimizer_step()
                    state.step += 1
                    state.samples += cfg.train.batch_size
                    lr_done, lr = lr, lr_at(state.step, **schedule)
                    set_lr(optimizer, lr)
                    bar.update(1)
                    if metrics_log.count and (state.step % cfg.train.log_every == 0 or state.step == stop):
                        record = metrics_log.flush(state, plan, lr_done, skipped_before + skipped_epoch)
                        bar.set_postfix(loss=f"{record['loss']:.4f}", ips=f"{record['imgs_per_sec']:.1f}")
                if on_epoch_end is not None and (epoch_done or (stepped and state.step == stop)):
                    metrics_log.write(state, plan, on_epoch_end(engine, state))
                if stepped and (state.step % cfg.train.ckpt_every == 0 or state.step == stop):
                    save()
                if state.step >= stop:
                    break
                t_wait = time.perf_counter()
            skipped_before += skipped_epoch
    finally:  # a stopped run still leaves a closed log and a clean terminal
        bar.close()
        metrics_log.close()

    export_final_encoder(engine, cfg, run_dir, model_kwargs or {})
    return state


def start_engine(cfg: RunConfig, objective: torch.nn.Module, plan: Plan, ckpt_root: Path, resume: str | None,
                 lr_scale_of: Callable[[str], float] | None) -> tuple[Any, torch.optim.Optimizer, RunState]:
    """``deepspeed.initialize`` with our optimiser, then the resume (weights, optimiser, RNG, position)."""
    import deepspeed

    optimizer = build_optimizer(cfg, objective, lr_scale_of)
    engine, optimizer, _, _ = deepspeed.initialize(model=objective, optimizer=optimizer, config=plan.ds_config)
    state = RunState()
    found = ckpt.resolve_resume(resume, ckpt_root)
    if found:
        with ckpt.weights_only_loads():  # a checkpoint is untrusted input
            _, client = engine.load_checkpoint(found[0], tag=found[1])
        state = RunState(**client["state"])
        set_rng_state(client["rng"][dist.get_rank()])
        objective.load_rank_state(ckpt.load_rank_state(*found))
        if dist.get_rank() == 0:
            log.info("resumed from %s/%s at step %d", found[0], found[1], state.step)
    return engine, optimizer, state


def export_final_encoder(engine: Any, cfg: RunConfig, run_dir: Path, model_kwargs: dict) -> None:
    """fp32 ``encoder.safetensors`` for downstream: from the final checkpoint (ZeRO, bf16) or
    the module itself (fp32, stage 0). Every rank calls it."""
    ckpt_root = run_dir / "checkpoints"
    sd = ckpt.full_state_dict(engine, ckpt_root, ckpt.latest_complete(ckpt_root))
    if dist.get_rank() == 0:
        model = engine.module
        prefix = next(n for n, m in model.named_modules() if m is model.encoder) + "."  # hpm: base.encoder.
        ckpt.export_encoder(sd, model_kwargs, run_dir / "encoder.safetensors", prefix=prefix)
        save_config(cfg, run_dir / "encoder_config.json")
    dist.barrier()
