"""The training engine: the step loop, with DeepSpeed doing the heavy lifting underneath.
Read ``train`` top to bottom; setup, resume and the final export are the functions after it.

The engine knows nothing objective-specific: it calls ``objective(*objective.inputs(batch))
-> (loss, metrics)`` and the hooks of ``mpp.objectives.base.Objective``. What it builds on,
one file each: ``mpp.parallel.distributed`` (process group), ``mpp.plan`` (the run resolved before it
starts), ``mpp.train.optim`` (groups, Adam, warm-up + cosine), ``mpp.train.metrics`` (metrics.jsonl,
TensorBoard), ``mpp.train.rng`` (seeds and RNG states), ``mpp.train.checkpoint`` (the one format).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mpp.config import RunConfig, save_config
from mpp.data import make_train_loader
from mpp.ops import normalize
from mpp.parallel import zero
from mpp.parallel.distributed import from_rank0
from mpp.train import checkpoint as ckpt
from mpp.train.elastic import restore
from mpp.train.metrics import MetricLog
from mpp.train.nonfinite import NonFiniteLossError, all_finite, roll_back, skip_bad_step
from mpp.train.optim import build_optimizer, lr_at, peak_lr, set_lr
from mpp.train.plan import Plan, RunState
from mpp.train.preemption import Preempted, StopRequest, write_marker
from mpp.train.preview import build_preview
from mpp.train.rng import rng_state, seed_everything

log = logging.getLogger("mpp.engine")

EpochHook = Callable[[Any, RunState], "dict | None"]  # (DeepSpeed engine, state) -> values to log


# ---- the loop ------------------------------------------------------------------------------


def train(cfg: RunConfig, objective: torch.nn.Module, plan: Plan, run_dir: Path, device: torch.device,
          resume: str | None = None, on_epoch_end: EpochHook | None = None) -> RunState:  # fmt: skip
    """Train ``objective`` under DeepSpeed for ``plan.total_steps`` optimiser steps (``Preempted`` on a
    signal). ``on_epoch_end(engine, state)`` runs on every rank after each epoch and at the end."""
    from tqdm import tqdm

    rank, t = dist.get_rank(), cfg.train
    seed_everything(t.seed + rank)  # ranks draw different masks; data has its own seeds
    stop = min(plan.total_steps, t.stop_at_step or plan.total_steps)
    engine, optimizer, state = start_engine(cfg, objective, plan, run_dir / "checkpoints", resume)
    model, skipped_before = engine.module, 0  # skipped_before: bad samples this rank skipped in finished epochs
    schedule = dict(peak=peak_lr(cfg), total=plan.total_steps, warmup=plan.warmup_steps, min_lr=cfg.optim.min_lr)
    set_lr(optimizer, lr := lr_at(state.step, **schedule) * state.lr_scale)
    metrics_log = MetricLog(run_dir, rank, state, t.report_to, cfg.model_dump(mode="json"))
    preview = build_preview(cfg, plan.img_size, model, device, rank)
    bar = tqdm(total=plan.total_steps, initial=state.step, disable=rank != 0, dynamic_ncols=True, desc=cfg.name)
    # one loader, its workers kept across epochs (MAE's 1600 epochs would restart them 1600 times)
    stop_request = StopRequest()  # SIGTERM / SIGUSR1: finish the step, checkpoint, exit (before the workers fork)
    loader = train_loader(cfg, plan, rank, run_dir)
    try:
        while state.step < stop:
            loader.set_epoch(state.epoch, state.batch_in_epoch)
            t_wait = time.perf_counter()
            try:
                for batch in loader:
                    data_wait = time.perf_counter() - t_wait
                    skipped = skipped_before + batch["skipped"]
                    batch = to_device(batch, device, cfg.data.mean, cfg.data.std)
                    model.set_progress(state.epoch + state.batch_in_epoch / plan.micro_per_epoch, plan.total_epochs)
                    loss, metrics = engine(*model.inputs(batch))
                    if t.skip_nonfinite and not all_finite(loss, state):
                        stepped = skip_bad_step(state, t, rank)  # every rank agrees: no backward, no step
                    else:
                        engine.backward(loss)
                        boundary = engine.is_gradient_accumulation_boundary()
                        engine.step()
                        stepped = boundary and step_applied(engine, state)
                        metrics_log.add({"loss": loss, **metrics}, data_wait)
                    epoch_done = advance(state, plan, cfg, stepped)
                    if stepped:
                        lr = after_step(model, optimizer, state, plan, t, schedule, lr, metrics_log, bar, skipped, stop)
                        preview(model, state.step, metrics_log.reporters)  # every train.preview_every steps
                    if on_epoch_end is not None and (epoch_done or (stepped and state.step == stop)):
                        metrics_log.write(state, plan, on_epoch_end(engine, state))
                    if stepped:
                        checkpoint_or_stop(engine, objective, state, run_dir, t, stop, stop_request)
                    if state.step >= stop:
                        break
                    t_wait = time.perf_counter()
            except NonFiniteLossError as error:  # train.on_nonfinite: roll back and go on, or stop
                lr = recover(engine, objective, state, plan, run_dir, cfg, error, optimizer, schedule, metrics_log, bar)
                continue
            skipped_before += loader.skipped
    finally:  # a stopped run still leaves a closed log, no workers and a clean terminal
        stop_request.restore()
        loader.close()
        bar.close()
        metrics_log.close()
    export_final_encoder(engine, cfg, run_dir)
    return state


def after_step(model: Any, optimizer: Any, state: RunState, plan: Plan, t: Any, schedule: dict, lr: float,
               metrics_log: MetricLog, bar: Any, skipped: int, stop: int) -> float:  # fmt: skip
    """After an optimiser step: HPM's teacher, the next step's lr, the bar, a record at log steps.
    Returns the lr now set."""
    model.after_optimizer_step()
    zero.order_gathers_after_writes(optimizer)  # HPM's EMA wrote ZeRO-3 shards outside DeepSpeed
    lr_done, lr = lr, lr_at(state.step, **schedule) * state.lr_scale
    set_lr(optimizer, lr)
    bar.update(1)
    if metrics_log.count and (state.step % t.log_every == 0 or state.step == stop):
        record = metrics_log.flush(state, plan, lr_done, skipped)
        bar.set_postfix(loss=f"{record['loss']:.4f}", ips=f"{record['imgs_per_sec']:.1f}")
    return lr


def recover(engine: Any, objective: torch.nn.Module, state: RunState, plan: Plan, run_dir: Path, cfg: RunConfig,
            error: NonFiniteLossError, optimizer: Any, schedule: dict, metrics_log: MetricLog, bar: Any) -> float:  # fmt: skip
    """``train.on_nonfinite=rollback``: back to the last complete checkpoint, the data stream past
    the batch that failed (``mpp.train.nonfinite.roll_back``), metrics.jsonl rewound to that step with
    the event recorded; re-raises otherwise. Returns the lr now set."""
    advance(state, plan, cfg, stepped=False)  # the batch that failed is behind us
    roll_back(engine, objective, state, run_dir, cfg.train, error, plan)
    set_lr(optimizer, lr := lr_at(state.step, **schedule) * state.lr_scale)
    metrics_log.rewind(state)
    metrics_log.write(state, plan, {"event": "rollback", "failed_step": state.rollback_steps[-1], "to_step": state.step,
                                    "lr_scale": state.lr_scale})  # fmt: skip
    bar.n = state.step
    bar.refresh()
    return lr


def train_loader(cfg: RunConfig, plan: Plan, rank: int, run_dir: Path) -> Any:
    """This rank's loader, its workers kept across epochs; data.log_keys: RUN/keys/rankN.jsonl."""
    if rank == 0 and plan.census is not None:  # shard counts no shard folder could keep
        plan.census.write_run_cache(run_dir)
    key_log = run_dir / "keys" / f"rank{rank}.jsonl" if cfg.data.log_keys else None
    return make_train_loader(plan.train_shards, plan.stream, rank=rank, num_workers=cfg.data.num_workers,
                             persistent=True, key_log=key_log)  # fmt: skip


def to_device(batch: dict, device: torch.device, mean, std) -> dict:
    """The loader's uint8 images normalised on the device, in fp32 whatever the precision (the
    model casts them at its patch embedding; targets come from the exact pixels); tensors moved."""
    out = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    out["image"] = normalize(out["image"], mean, std)
    return out


def step_applied(engine: Any, state: RunState) -> bool:
    """False when fp16's loss scaler found an overflow and DeepSpeed skipped the update: then the
    step, the lr and the EMA teacher do not advance either (counted as ``overflow_steps``)."""
    if engine.was_step_applied():
        return True
    state.overflow_steps += 1
    return False


def advance(state: RunState, plan: Plan, cfg: RunConfig, stepped: bool) -> bool:
    """One micro-batch consumed (and an optimiser step taken when ``stepped``); True at an epoch's end."""
    state.batch_in_epoch += 1
    epoch_done = state.batch_in_epoch >= plan.micro_per_epoch
    if epoch_done:
        state.epoch, state.batch_in_epoch = state.epoch + 1, 0
    if stepped:
        state.step += 1
        state.samples += cfg.train.batch_size
    return epoch_done


# ---- setup, checkpoints, export ---------------------------------------------------------------


def start_engine(cfg: RunConfig, objective: torch.nn.Module, plan: Plan, ckpt_root: Path,
                 resume: str | None) -> tuple[Any, torch.optim.Optimizer, RunState]:  # fmt: skip
    """``deepspeed.initialize`` with our optimiser, then the resume (weights, optimiser, RNG, position)."""
    import deepspeed

    optimizer = build_optimizer(cfg, objective)
    engine, optimizer, _, _ = deepspeed.initialize(model=objective, optimizer=optimizer, config=plan.ds_config)
    if cfg.model.compile:  # the training forward has no graph break (tests/test_compile.py)
        engine.compile()
    state = RunState()
    found = from_rank0(_resolve_on_rank0(resume, ckpt_root))
    if isinstance(found, str):
        raise ckpt.CheckpointError(found)
    if found:  # any world size, micro batch or accumulation (mpp.train.elastic)
        state = restore(engine, objective, found[0], found[1], plan, cfg.train.seed)
        if dist.get_rank() == 0:
            log.info("resumed from %s/%s at step %d", found[0], found[1], state.step)
    if dist.get_rank() == 0:
        (ckpt_root.parent / "preempted.json").unlink(missing_ok=True)  # this run is going again
        ckpt.room(engine, ckpt_root, cfg.train.keep_last)  # a warning now if keep_last + 1 checkpoints do not fit
    return engine, optimizer, state


def checkpoint_or_stop(engine: Any, objective: torch.nn.Module, state: RunState, run_dir: Path, t: Any, stop: int,
                       stop_request: StopRequest) -> None:  # fmt: skip
    """After an optimiser step: a checkpoint every ``train.ckpt_every`` steps and at the end; and
    when any rank got SIGTERM / SIGUSR1, a checkpoint here (unless just written) and ``Preempted``."""
    due = state.step % t.ckpt_every == 0 or state.step == stop
    if due:
        save(engine, objective, state, run_dir / "checkpoints", t.keep_last)
    signum = stop_request.agreed()
    if signum:
        if not due:
            save(engine, objective, state, run_dir / "checkpoints", t.keep_last)
        write_marker(run_dir, state.step, signum, stop_request.reason)
        raise Preempted(state.step, signum, stop_request.reason)


def _resolve_on_rank0(resume: str | None, ckpt_root: Path) -> tuple[str, str] | str | None:
    if dist.get_rank() != 0:
        return None
    try:
        return ckpt.resolve_resume(resume, ckpt_root)  # the newest intact checkpoint: files checked
    except (FileNotFoundError, ckpt.CheckpointError) as e:  # every rank must learn it, not wait in the broadcast
        return str(e)


def save(engine: Any, objective: torch.nn.Module, state: RunState, ckpt_root: Path, keep_last: int) -> None:
    """A complete checkpoint: DeepSpeed's files, the run state, every rank's RNG states and the
    objective's per-rank state. Every rank calls it."""
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, rng_state())
    client = {"state": asdict(state), "rng": rngs}
    ckpt.save_checkpoint(engine, ckpt_root, state.step, client, keep_last, rank_state=objective.rank_state())


def encoder_kwargs(cfg: RunConfig, encoder: torch.nn.Module) -> dict:
    """The exported encoder's architecture: the config's variant and overrides, and a classifier's head."""
    kwargs = {"name": cfg.model.name, **cfg.model.vit_kwargs()}
    if encoder.num_classes > 0:
        kwargs.update(num_classes=encoder.num_classes, global_pool=encoder.global_pool)
    return kwargs


def export_final_encoder(engine: Any, cfg: RunConfig, run_dir: Path) -> None:
    """fp32 ``encoder.safetensors`` for downstream: from the final checkpoint (ZeRO, bf16) or
    the module itself (fp32, stage 0). Every rank calls it."""
    ckpt_root = run_dir / "checkpoints"
    sd = ckpt.full_state_dict(engine, ckpt_root, ckpt.latest_complete(ckpt_root))
    if dist.get_rank() == 0:
        model = engine.module
        prefix = next(n for n, m in model.named_modules() if m is model.encoder) + "."  # hpm: base.encoder.
        ckpt.export_encoder(sd, encoder_kwargs(cfg, model.encoder), run_dir / "encoder.safetensors", prefix=prefix)
        save_config(cfg, run_dir / "encoder_config.json")
    dist.barrier()
