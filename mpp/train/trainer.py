"""The trainer: DeepSpeed's engine and the step loop over it. ``Trainer.train`` reads on one
screen: a batch, ``train_step``, ``on_step_end`` (which ends in a checkpoint when one is due).
What the job around it wants at those points (previews, the monitor, a stop signal's
checkpoint) comes in as ``Hook`` objects that ``mpp.jobs`` registers; this module imports none.

The trainer knows nothing objective-specific: it calls ``objective(*objective.inputs(batch))
-> (loss, metrics)`` and the hooks of ``mpp.objectives.base.Objective``. It owns the run's
state (``RunState``: step, epoch, position, counters) and everything that moves it: the lr
``Schedule`` (``mpp.train.optim``), the ``Checkpointer`` (save, resume, rollback, the final
encoder), the ``MetricLog`` (metrics.jsonl, TensorBoard, W&B) and the loader. One name per object: ``engine`` is DeepSpeed's, ``objective`` the module it wraps.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mpp.checkpoint.manager import Checkpointer
from mpp.checkpoint.state import RunState, seed_everything
from mpp.config import RunConfig
from mpp.data import device_decode, make_train_loader
from mpp.data.prefetch import Prefetcher
from mpp.ops import normalize
from mpp.parallel import stage0, zero
from mpp.parallel.distributed import skip_shm_comm_op
from mpp.train.hooks import Hook
from mpp.train.metrics import MetricLog
from mpp.train.nonfinite import INJECT_ENV, NonFiniteLossError, roll_back, skip_bad_step
from mpp.train.optim import Schedule, build_optimizer
from mpp.train.plan import Plan

log = logging.getLogger(__name__)
EvalHook = Callable[[Any, RunState], "dict | None"]  # (DeepSpeed engine, state) -> values to log


class Trainer:
    """Train ``objective`` under DeepSpeed for ``plan.total_steps`` optimiser steps, resuming from
    ``resume`` (None, "auto" or a checkpoint path). ``evaluate(engine, state)`` (fine-tuning's
    evaluation) runs on every rank after each epoch, or every ``evaluate_every`` optimiser steps
    when given (few labels: an epoch of a small subset is a few steps), and at the end."""

    def __init__(
        self,
        cfg: RunConfig,
        objective: torch.nn.Module,
        plan: Plan,
        run_dir: Path,
        device: torch.device,
        resume: str | None = None,
        evaluate: EvalHook | None = None,
        evaluate_every: int | None = None,
        hooks: Sequence[Hook] = (),
    ) -> None:
        from tqdm import tqdm

        self.cfg, self.plan, self.run_dir, self.device = cfg, plan, run_dir, device
        self.evaluate, self.evaluate_every, self.hooks = evaluate, evaluate_every, list(hooks)
        self.rank = dist.get_rank()
        # ranks draw different masks; data has its own seeds
        seed_everything(cfg.train.seed + self.rank)
        self.stop = min(plan.total_steps, cfg.train.stop_at_step or plan.total_steps)
        self.engine, self.optimizer = start_engine(
            cfg, objective, plan.ds_config, device, self.stop
        )
        self.objective = self.engine.module
        self.gathers = zero.gather_stream(self.optimizer)  # ZeRO-3's on CUDA, else None
        # the plan's per-epoch figures, read every micro-step
        self.micro_per_epoch, self.total_epochs = plan.micro_per_epoch, plan.total_epochs
        t = cfg.train
        self.checkpointer = Checkpointer(self.engine, run_dir, plan, t.keep_last, t.seed)
        self.state = self.checkpointer.resume(resume)
        self.schedule = Schedule.of(cfg, plan)
        self.lr = self.schedule.apply(self.optimizer, self.state)
        # the trackers' config: as loaded, and the encoder built (RUN/model.json's facts)
        built = {"architecture": self.objective.encoder.architecture()}
        self.metrics = MetricLog(
            run_dir, self.rank, self.state, cfg.train.report_to, cfg.model_dump(mode="json") | built
        )
        self.bar = tqdm(
            total=plan.total_steps,
            initial=self.state.step,
            disable=self.rank != 0,
            dynamic_ncols=True,
            desc=cfg.name,
        )
        if self.rank == 0 and plan.census is not None:  # shard counts no shard folder could keep
            plan.census.write_run_cache(run_dir)
        # one loader, its workers kept across epochs (MAE's 1600 epochs would restart them 1600
        # times); data.log_keys: RUN/keys/rankN.jsonl
        self.loader = make_train_loader(
            plan.train_shards,
            plan.stream,
            rank=self.rank,
            num_workers=cfg.data.num_workers,
            persistent=True,
            key_log=run_dir / "keys" / f"rank{self.rank}.jsonl" if cfg.data.log_keys else None,
        )
        # data.decode=gpu: the workers' JPEGs decoded here, on the device
        self.decode = device_decode.nvjpeg(device) if plan.stream.defer_jpeg else None
        self.ready: Prefetcher | None = None  # the batches made ready ahead of the step
        # bad samples in the batches this rank trained since the last metrics record (the run's
        # count is state.skipped); the last wait for a batch
        self.skipped, self.data_wait = 0, 0.0

    @property
    def done(self) -> bool:
        return self.state.step >= self.stop

    def train(self) -> RunState:
        """The loop (``Preempted`` on a stop signal); then the final encoder, exported."""
        try:
            for hook in self.hooks:
                hook.start(self)
            while not self.done:
                try:
                    for batch in self.batches():
                        stepped = self.train_step(batch)
                        epoch_done = self.advance(stepped)
                        self.on_step_end(stepped, epoch_done)
                        if self.done:
                            break
                # train.on_nonfinite: roll back and go on, or stop
                except NonFiniteLossError as error:
                    self.recover(error)
        finally:  # a stopped run still leaves a closed log, no workers and a clean terminal
            self.close()
        self.checkpointer.export_encoder(self.cfg)
        return self.state

    def batches(self) -> Iterator[dict]:
        """This rank's micro-batches from the run's position on, epoch after epoch, made ready
        on the device ``data.prefetch`` batches ahead (``mpp.data.prefetch``); the time the step
        waited for each (``data_wait``) and the bad samples skipped in making it (``skipped``)."""
        state, pixels = self.state, self.plan.pixels
        # the workers go on into the next epochs themselves: no stall at an epoch's start
        self.loader.set_epoch(state.epoch, state.batch_in_epoch, onwards=True)
        prepare = partial(
            to_device, device=self.device, mean=pixels.mean, std=pixels.std, decode=self.decode
        )
        counted = 0  # the pass's count (the loader's, from 0) already added to self.skipped
        if self.ready is not None:  # a pass left by a rollback ends before the next starts
            self.ready.close()
        self.ready = Prefetcher(iter(self.loader), prepare, self.device, self.cfg.data.prefetch)
        with self.ready as ready:
            t_wait = time.perf_counter()
            for batch in ready:
                self.data_wait = time.perf_counter() - t_wait
                skipped = batch.pop("skipped")
                self.skipped, counted = self.skipped + skipped - counted, skipped
                if self.loader.key_log is not None:  # logged as trained, not as made ready
                    self.loader.log_keys(batch.pop("key"), state.epoch, state.batch_in_epoch)
                yield batch
                t_wait = time.perf_counter()

    def train_step(self, batch: dict) -> bool:
        """One micro-batch (on the device, normalised): forward, backward and DeepSpeed's step, which takes an optimiser step
        at the accumulation boundary. True when an optimiser step was taken and applied."""
        self.objective.set_progress(
            self.state.epoch + self.state.batch_in_epoch / self.micro_per_epoch,
            self.total_epochs,
        )
        out = micro_step(self.engine, batch, self.state, self.cfg.train.skip_nonfinite)
        if out is None:  # a non-finite loss on some rank: every rank skips it
            return skip_bad_step(self.state, self.cfg.train, self.rank)
        loss, metrics, boundary = out
        self.metrics.add({"loss": loss, **metrics}, self.data_wait)
        if boundary and not self.engine.was_step_applied():
            # fp16's loss scaler found an overflow and DeepSpeed skipped the update: the step,
            # the lr and the EMA teacher do not advance either
            self.state.overflow_steps += 1
            return False
        return boundary

    def on_step_end(self, stepped: bool, epoch_done: bool) -> None:
        """After an optimiser step: HPM's teacher, the next lr, the bar, a metrics record at log
        steps, the hooks; the evaluation when due; a checkpoint when due, then the hooks again."""
        t, step = self.cfg.train, self.state.step
        # the hooks due at this step (``Hook.every``): the others are not called
        due = [h for h in self.hooks if h.every and (step % h.every == 0 or step == self.stop)]
        if stepped:
            after_optimizer_step(self.engine, self.gathers)
            lr_done, self.lr = self.lr, self.schedule.apply(self.optimizer, self.state)
            self.metrics.step_done(lr_done)
            self.bar.update(1)
            if self.metrics.count and (
                self.state.step % t.log_every == 0 or self.state.step == self.stop
            ):
                record = self.metrics.flush(self.state, self.plan, lr_done, self.skipped)
                self.skipped = 0  # in state.skipped now
                self.bar.set_postfix(
                    loss=f"{record['loss']:.4f}", ips=f"{record['imgs_per_sec']:.1f}"
                )
            for hook in due:
                if type(hook).step_end is not Hook.step_end:  # Hook's own does nothing
                    hook.step_end(self)
        if self.evaluate is not None and self.evaluation_due(stepped, epoch_done):
            with self.autocast():
                values = self.evaluate(self.engine, self.state)
            self.metrics.write(self.state, self.plan, values)
        if stepped:
            saved = step % t.ckpt_every == 0 or step == self.stop
            if saved:
                self.checkpointer.save(self.state)
            for hook in due:
                hook.saved(self, saved)

    def advance(self, stepped: bool) -> bool:
        """One micro-batch consumed (and an optimiser step taken when ``stepped``); True at an epoch's end."""
        state = self.state
        state.batch_in_epoch += 1
        epoch_done = state.batch_in_epoch >= self.micro_per_epoch
        if epoch_done:
            state.epoch, state.batch_in_epoch = state.epoch + 1, 0
        if stepped:
            state.step += 1
            state.samples += self.cfg.train.batch_size
        return epoch_done

    def autocast(self) -> torch.autocast:
        """The forwards outside the engine's (monitor, preview, evaluation) in its precision:
        under ``bf16-autocast`` the module's weights are fp32, and they would run in fp32."""
        enabled = self.engine.torch_autocast_enabled()
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def evaluation_due(self, stepped: bool, epoch_done: bool) -> bool:
        """Every epoch (or ``evaluate_every`` optimiser steps), and after the last step."""
        if stepped and self.state.step == self.stop:
            return True
        if self.evaluate_every is None:
            return epoch_done
        return stepped and self.state.step % self.evaluate_every == 0

    def recover(self, error: NonFiniteLossError) -> None:
        """``train.on_nonfinite=rollback`` (``mpp.train.nonfinite.roll_back``), metrics.jsonl
        rewound to the step it went back to, the event recorded; re-raises otherwise."""
        # the batch that failed is behind us
        self.advance(stepped=False)
        roll_back(self.checkpointer, self.state, error, self.cfg.train)
        self.skipped = 0  # undone with the steps after the checkpoint (state.skipped is its)
        self.lr = self.schedule.apply(self.optimizer, self.state)
        self.metrics.rewind(self.state)
        event = {
            "event": "rollback",
            "failed_step": self.state.rollback_steps[-1],
            "to_step": self.state.step,
            "lr_scale": self.state.lr_scale,
        }
        self.metrics.write(self.state, self.plan, event)
        self.bar.n = self.state.step
        self.bar.refresh()

    def close(self) -> None:
        for hook in self.hooks:
            hook.close()
        if self.ready is not None:  # its thread first: it reads from the loader
            self.ready.close()
        self.loader.close()
        self.bar.close()
        self.metrics.close()


# ---- the pieces the trainer (and the GPU step benchmark) share ---------------------------------


def start_engine(
    cfg: RunConfig,
    objective: torch.nn.Module,
    ds_config: dict,
    device: torch.device | None = None,
    steps: int | None = None,
) -> tuple[Any, torch.optim.Optimizer]:
    """``deepspeed.initialize`` with our optimiser; at ZeRO stage 0 with fp32 weights its gradient
    all-reduce and clipping in multi-tensor ops (``mpp.parallel.stage0``); compiled when
    ``model.compile`` says so for a run of ``steps`` on ``device`` (``resolve_compile``)."""
    import deepspeed

    skip_shm_comm_op()  # a process group made without init_distributed: still no build
    optimizer = build_optimizer(cfg, objective)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=objective, optimizer=optimizer, config=ds_config
    )
    stage0.use_multi_tensor_path(engine)
    compiled, _ = resolve_compile(cfg.model.compile, device, steps)  # why: the run's summary
    if compiled:  # the training forward has no graph break (tests/test_compile.py)
        engine.compile()
    return engine, optimizer


COMPILE_MIN_STEPS = 5_000  # a cold compile (~60 s) over the step it saves (68 -> 53 ms on an H200)


def resolve_compile(
    setting: bool | str, device: torch.device | None, steps: int | None
) -> tuple[bool, str]:
    """``model.compile`` -> (compile or not, why): as set, or for ``auto`` on for CUDA runs of
    at least COMPILE_MIN_STEPS steps (the doctor's compile row and the GPU check's whole-run rows
    are the evidence, BENCHMARKS.md)."""
    if setting != "auto":
        return bool(setting), f"model.compile={setting}"
    if device is None or device.type != "cuda" or steps is None:
        return False, "eager (compile pays on a GPU: inductor's CPU kernels gain little here)"
    if steps < COMPILE_MIN_STEPS:
        return False, (
            f"eager: {steps} steps do not pay back a compile (about a minute cold; at x1.18-1.29 "
            f"per step it pays after ~{COMPILE_MIN_STEPS} steps); model.compile=true forces it"
        )
    return True, f"compiled ({steps} steps on CUDA; model.compile=false turns it off)"


def micro_step(
    engine: Any, batch: dict, state: RunState, skip_nonfinite: bool
) -> tuple[Any, dict, bool] | None:
    """One micro-batch through DeepSpeed: forward; under ``train.skip_nonfinite`` the all-ranks
    finiteness check (None: non-finite somewhere, nothing applied); backward and ``engine.step()``.
    (loss, metrics, whether this was an accumulation boundary)."""
    objective = engine.module
    loss, metrics = engine(*objective.inputs(batch))
    if skip_nonfinite and not all_finite(loss, state):
        return None
    engine.backward(loss)
    boundary = engine.is_gradient_accumulation_boundary()
    engine.step()
    return loss, metrics, boundary


def after_optimizer_step(engine: Any, gathers: Any = None) -> None:
    """The objective's hook (HPM's EMA teacher), then ZeRO-3's ``gathers`` stream
    (``mpp.parallel.zero.gather_stream``) ordered after its writes of the shards."""
    engine.module.after_optimizer_step()
    if gathers is not None:
        gathers.wait_stream(torch.cuda.current_stream())


def all_finite(loss: torch.Tensor, state: RunState) -> bool:
    """True when the loss is finite on every rank. One small all-reduce and host sync per
    micro-step: the price of never applying a NaN update (``train.skip_nonfinite``). The fault
    injection MPP_INJECT_NONFINITE_AT_STEP=k reports one at optimiser step k's first try."""
    bad = (~torch.isfinite(loss.detach())).float().reshape(1)
    if state.step + 1 == int(os.environ.get(INJECT_ENV, 0)) and not state.rollback_steps:
        bad.fill_(1.0)
    dist.all_reduce(bad)
    return bad.item() == 0.0


def to_device(
    batch: dict, device: torch.device, mean, std, decode: device_decode.Decoder | None = None
) -> dict:
    """The loader's uint8 images normalised on the device, in fp32 whatever the precision (the
    model casts them at its patch embedding; targets come from the exact pixels); tensors moved.
    JPEGs the workers left undecoded (``data.decode=gpu``) are decoded there by ``decode`` first."""
    deferred = batch.pop("deferred", None)
    out = {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }
    if deferred is not None:
        out["image"] = device_decode.fill_deferred(out.get("image"), deferred, decode, device)
    out["image"] = normalize(out["image"], mean, std)
    return out
