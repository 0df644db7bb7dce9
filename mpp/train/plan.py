"""The plan of a run, resolved before anything is created (data, batch, schedule, DeepSpeed's
config; any problem a ConfigError naming the key), and the run's position in it."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mpp.config import ConfigError, FinetuneConfig, Refusals, RunConfig, source_of
from mpp.data import StreamConfig, device_decode, digits_shards, expand_shards, shard_index
from mpp.data.census import Census, census, known_counts
from mpp.data.labels import LabelledSubset, choose, from_key_file, label_index
from mpp.data.stats import Pixels, first_dtype, pixel_stats
from mpp.data.transforms import PixelFormat, SampleFormatError
from mpp.ops import IMAGENET_MEAN, IMAGENET_STD
from mpp.parallel.distributed import device_type, world_from_env

log = logging.getLogger(__name__)


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
    stream: StreamConfig  # the training stream's settings; the engine adds rank, epoch and position
    pixels: Pixels  # the data's statistics: the config's, "auto" measured (RUN/data.json)
    missing_shards: int = 0
    census: Census | None = None  # every shard's sample count and where it came from
    subset: LabelledSubset | None = None  # few labels: the samples trained on (data.labels_*)
    # train.epochs' own steps where train.min_steps lifted the schedule above them, else None
    epochs_steps: int | None = None

    @property
    def micro_per_epoch(self) -> int:  # micro-batches per rank per epoch
        return self.steps_per_epoch * self.grad_accum

    @property
    def total_epochs(self) -> float:
        return self.total_steps / self.steps_per_epoch


def plan_run(
    cfg: RunConfig, world_size: int, dev_type: str, img_size: int, num_classes: int | None = None
) -> Plan:
    """Resolve data, batch and schedule. Every problem found is a ConfigError naming its key, all
    of them in one (``Refusals``); with no training shard found nothing of the data is read, so
    that refusal comes with the layout's alone. ``num_classes`` (supervised runs): the stream
    yields labels, and drops those outside it."""
    refused = Refusals()
    batch = refused(layout, cfg, world_size, dev_type)
    defer_jpeg = refused(decode_on_device, cfg, dev_type)
    found = refused(_there, cfg, *_spec(cfg, "train", img_size), warn=True)
    if found is None:
        refused.raise_any()
    shards, missing = found
    pixels = refused(measure_pixels, cfg, shards)
    subset = None
    if num_classes is not None and cfg.data.label_subset_key is not None:
        # few labels: the epoch is the subset, read from the shards holding it
        subset = refused(labelled_subset, cfg, shards, num_classes)
        counted, epoch = None, subset
    else:
        # every shard's sample count (a collective); the run's summary says it (mpp.train.summary)
        counted = epoch = census(shards, cfg.data.allow_pipe, run_dir=run_dir_of(cfg))
        refused(check_num_samples, cfg, counted)
    if epoch is not None:
        refused(check_epoch, cfg, epoch.total)
    refused.raise_any()
    (micro, accum, ds_config), samples = batch, epoch.total
    shards = epoch.shards
    steps_per_epoch = samples // cfg.train.batch_size
    t = cfg.train
    total, warmup, epochs_steps = schedule(cfg, steps_per_epoch, samples)
    if t.on_nonfinite == "rollback" and accum > 1:
        log.warning(
            "train.on_nonfinite=rollback with %d micro-batches per step: a rollback at a step's later "
            "micro-batch keeps the gradients of its earlier ones in DeepSpeed's buffers",
            accum,
        )
    stream = StreamConfig.from_data(
        cfg.data,
        epoch,
        batch_size=micro,
        img_size=img_size,
        world_size=world_size,
        num_batches=steps_per_epoch * accum,
        with_labels=num_classes is not None,
        num_classes=num_classes,
        seed=t.seed,
        global_batch=t.batch_size,
        pixels=pixels.format,
        defer_jpeg=defer_jpeg,
        randaug=cfg.randaug,
        # the member indexes the census kept in the run (shards in a folder it cannot write)
        index_dir=shard_index.run_index_dir(run_dir_of(cfg)),
    )
    return Plan(
        train_shards=shards,
        samples_per_epoch=samples,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        warmup_steps=warmup,
        epochs_steps=epochs_steps,
        micro_batch=micro,
        grad_accum=accum,
        world_size=world_size,
        img_size=img_size,
        ds_config=ds_config,
        stream=stream,
        pixels=pixels,
        missing_shards=len(missing),
        census=counted,
        subset=subset,
    )


# an epochs schedule of fewer fine-tuning steps gets a hint: the issue-50 walk's 20 steps on 162
# images read 57.5 % where a linear probe of the same encoder read 85.0 % (docs/data.md)
SHORT_FINETUNE = 100


def schedule(cfg: RunConfig, steps_per_epoch: int, samples: int) -> tuple[int, int, int | None]:
    """(total steps, warm-up steps, train.epochs' own steps where train.min_steps lifted them).
    ``train.max_steps`` sets the schedule; else ``train.epochs`` does, stretched to
    ``train.min_steps`` where it is shorter (an epoch of small data is a step or two), its
    ``optim.warmup_epochs`` stretched alike, said in one line (rank 0)."""
    t, o = cfg.train, cfg.optim
    if t.max_steps is not None:
        total, stretch = t.max_steps, 1.0
    else:
        total = math.ceil(t.epochs * steps_per_epoch)
        stretch = max(1.0, (t.min_steps or 0) / total)
    warmup = (
        o.warmup_steps
        if o.warmup_steps is not None
        else round((o.warmup_epochs or 0.0) * steps_per_epoch * stretch)
    )
    if stretch == 1.0:
        if hasattr(cfg, "finetune") and t.max_steps is None and total < SHORT_FINETUNE:
            if world_from_env()[0] == 0:  # fine-tuning on a few hundred images: a hint
                log.warning(
                    "a short fine-tune: train.epochs %g of %s samples is %d steps (batch %d). On a "
                    "few hundred images a linear probe of the same encoder often reads higher "
                    "(`mpp probe --config linear_demo --set init=...`); train.min_steps puts a "
                    "floor under the epochs, train.max_steps sets the schedule",
                    t.epochs,
                    f"{samples:,}",
                    total,
                    t.batch_size,
                )
        return total, warmup, None
    if world_from_env()[0] == 0:
        log.warning(
            "train.epochs %g of %s samples is %d steps, under train.min_steps %d (%s): training "
            "%d steps (%.4g epochs), %d of them warm-up; train.max_steps sets the schedule exactly",
            t.epochs,
            f"{samples:,}",
            total,
            t.min_steps,
            source_of(cfg, "train.min_steps"),
            t.min_steps,
            t.min_steps / steps_per_epoch,
            warmup,
        )
    return t.min_steps, warmup, total


def check_data(cfg: RunConfig, img_size: int) -> None:
    """What can be checked before the process group exists, every refusal in one ConfigError
    (``Refusals``): the batch on this world size and the precision on this device, the training
    shards (some may be missing: the plan says which), what their images hold
    (``check_value_range``), every held-out shard the run reads, and the batch
    against the samples of an epoch when the shards' counts are known without reading the shards
    (sizes.json, img2dataset's stats, a cache); the plan checks it again on the census. With no
    training shard found, nothing of the training data is checked."""
    refused = Refusals()
    refused(layout, cfg, world_from_env()[1], device_type())
    train = refused(shards, cfg, "train", img_size)
    if train is not None:
        refused(check_value_range, cfg, train)
        known = known_counts(train, run_dir_of(cfg))
        if len(known) == len(train) and cfg.data.label_subset_key is None:
            counted = Census(train, [known[s] for s in train])
            refused(check_num_samples, cfg, counted)
            refused(check_epoch, cfg, counted.total)
    # the held-out shards read: fine-tuning's score; pretraining's monitor when on and previews
    # when drawn (a key nothing reads is not looked for: it may be a later fine-tune's val set)
    held = [("monitor", monitor_on(cfg)), ("val", previews_on(cfg))]
    roles = ["val"] if isinstance(cfg, FinetuneConfig) else [r for r, on in held if on]
    if roles == ["monitor", "val"] and not cfg.monitor.val_shards:
        roles = ["val"]  # both read data.val_shards: listed once
    for role in roles:
        refused(shards, cfg, role, img_size)
    refused.raise_any()


def layout(cfg: RunConfig, world_size: int, dev_type: str) -> tuple[int, int, dict]:
    """(micro batch, accumulation steps, DeepSpeed's config) on ``world_size`` ranks of
    ``dev_type``; ConfigError naming train.batch_size (the engine's config follows from a batch
    that splits), else train.precision."""
    fail = _failer(cfg)
    try:
        micro, accum = cfg.micro_batch(world_size)
    except ValueError as e:
        raise fail("train.batch_size", str(e)) from None
    try:
        return micro, accum, cfg.deepspeed_config(world_size, dev_type)
    except ValueError as e:
        raise fail("train.precision", str(e)) from None


def decode_on_device(cfg: RunConfig, dev_type: str) -> bool:
    """``data.decode`` on ``dev_type``: whether the training JPEGs are decoded there
    (``mpp.data.device_decode.resolve``); ConfigError naming the key."""
    try:
        return device_decode.resolve(cfg.data.decode, torch.device(dev_type))
    except ValueError as e:
        raise _failer(cfg)("data.decode", str(e)) from None


def check_epoch(cfg: RunConfig, samples: int) -> None:
    """An epoch of ``samples`` holds at least one global batch; ConfigError naming the key."""
    if samples < cfg.train.batch_size:
        raise _failer(cfg)(
            "train.batch_size",
            f"{cfg.train.batch_size} exceeds the {samples} samples of an epoch: set it to at "
            f"most {samples}, or give more data",
        )


def check_value_range(cfg: RunConfig, shards: list[str]) -> None:
    """What the first images of the first shard hold against the data section, every finding
    in one ConfigError: when none of them fits ``data.channels`` / ``layout`` (16-bit grey under
    3 channels, RGB JPEGs under 1), that key, with the channel count that fits and the
    ``data.mean`` / ``std`` that would not fit it; images that are not 8-bit with
    ``data.value_range`` unset, whatever else is "auto"."""
    d, fail = cfg.data, _failer(cfg)
    if d.train_shards is None:  # the digits
        return
    try:
        dtype = first_dtype(shards, PixelFormat(d.channels, d.layout, None), d.allow_pipe)
        misfit = None
    except SampleFormatError as e:  # no image fits d.channels / d.layout
        dtype, misfit = e.dtype, e
    found = []
    if misfit is not None:
        key = misfit.key
        held = channels_held(cfg, shards) if key == "data.channels" else None
        fix = f"set {key}={held}" if held else f"set {key} to what the images hold"
        found.append(
            fail(
                key,
                f"{getattr(d, key.removeprefix('data.')) or 'unset'}, but the first image of "
                f"{shards[0]} {str(misfit).removesuffix(f' ({key})')}: {fix}",
            )
        )
        for name in ("mean", "std") if held else ():
            value = getattr(d, name)
            if value != "auto" and len(value) != held:
                values = f"{len(value)} value{'s' * (len(value) != 1)}"
                hint = " (ImageNet's)" if value in (IMAGENET_MEAN, IMAGENET_STD) else ""
                found.append(
                    fail(
                        f"data.{name}",
                        f"{values}{hint}, but the images hold {held} channel(s): give {held} or "
                        '"auto" (measured on the training shards)',
                    )
                )
    if d.value_range is None and dtype is not None and dtype != np.uint8:
        top = np.iinfo(dtype).max if dtype.kind in "ui" else 1
        found.append(
            fail(
                "data.value_range",
                f"unset, but {shards[0]} holds {dtype} images: say what maps to [0, 1] (e.g. "
                f'[0, {top}]), or "auto" to use the range measured on the shards',
            )
        )
    if found:
        raise ConfigError(*(line for error in found for line in error.findings))


def channels_held(cfg: RunConfig, shards: list[str]) -> int | None:
    """The channel count (1 to 4) the first images of ``shards`` fit, None when none does."""
    d = cfg.data
    for channels in sorted({1, 2, 3, 4} - {d.channels}):
        try:
            first_dtype(shards, PixelFormat(channels, d.layout, None), d.allow_pipe)
            return channels
        except SampleFormatError:
            continue
    return None


def measure_pixels(cfg: RunConfig, shards: list[str]) -> Pixels:
    """The statistics the run uses: the config's, with ``data.mean`` / ``std`` / ``value_range``
    "auto" measured on the training shards (``mpp.data.stats``; a collective, cached). The config
    is left as loaded. ConfigError names the key."""
    d = cfg.data
    check_value_range(cfg, shards)
    vr = None if d.value_range in ("auto", None) else tuple(d.value_range)
    if not d.auto_stats:
        return Pixels(tuple(d.mean), tuple(d.std), PixelFormat(d.channels, d.layout, vr))
    try:
        fmt = PixelFormat(d.channels, d.layout, vr)
        stats, source = pixel_stats(shards, fmt, d.stats_samples, run_dir_of(cfg), d.allow_pipe)
    except ValueError as e:
        auto = [k for k in ("mean", "std", "value_range") if getattr(d, k) == "auto"]
        raise _failer(cfg)(f"data.{auto[0]}", f'"auto": {e}') from None
    if d.value_range == "auto":
        vr = tuple(stats.value_range)
    pixels = Pixels(
        tuple(stats.mean) if d.mean == "auto" else tuple(d.mean),
        tuple(stats.std) if d.std == "auto" else tuple(d.std),
        PixelFormat(d.channels, d.layout, vr),
    )
    if not dist.is_initialized() or dist.get_rank() == 0:
        values = lambda v: "[" + ", ".join(f"{x:.4g}" for x in v) + "]"  # noqa: E731
        log.info(
            "data: mean %s, std %s of [0, 1] pixels, range %s -> [0, 1] (%s)",
            values(pixels.mean),
            values(pixels.std),
            values(vr or stats.value_range),
            source,
        )
    return pixels


def labelled_subset(
    cfg: RunConfig, shards: list[str], num_classes: int | None = None
) -> LabelledSubset | None:
    """``data.labels_per_class`` / ``label_fraction`` / ``label_keys``: the labelled subset of
    ``shards`` (``mpp.data.labels``; a collective under a process group), logged once with a
    warning for each class short of K; None when none is asked for. Labels outside
    ``[0, num_classes)`` are left out (the stream would skip them). ConfigError names the key."""
    d, fail = cfg.data, _failer(cfg)
    key = d.label_subset_key
    if key is None:
        return None
    index = label_index(shards, d.allow_pipe)
    if num_classes is not None:
        index = type(index)(
            index.shards, [[(k, c) for k, c in s if 0 <= c < num_classes] for s in index.samples]
        )
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    try:
        if key == "label_keys":
            subset = from_key_file(index, d.label_keys)
        else:
            subset, short = choose(index, d.labels_per_class, d.label_fraction, d.label_seed)
            for line in short if rank0 else []:
                log.warning("data.%s: %s", key, line)
    except OSError as e:
        raise fail(f"data.{key}", f"cannot read {d.label_keys}: {e.strerror or e}") from None
    except KeyError as e:
        raise fail(f"data.{key}", e.args[0]) from None
    except ValueError as e:
        raise fail(f"data.{key}", str(e)) from None
    if rank0:
        log.info("data: %s", subset.summary())
    return subset


def check_num_samples(cfg: RunConfig, counted: Census) -> None:
    """``data.num_samples``, when set, agrees with the count; ConfigError naming the key."""
    n = cfg.data.num_samples
    if n is not None and n != counted.total:
        raise _failer(cfg)(
            "data.num_samples",
            f"{n}, but the shards hold {counted.total} samples with an image "
            f"({counted.summary()}): remove the key, or correct it",
        )


def run_dir_of(cfg) -> Path:
    """The run directory a validated config names (its output_dir, ``{name}`` filled in)."""
    template = cfg.train.output_dir if hasattr(cfg, "train") else cfg.output_dir
    return Path(template.format(name=cfg.name))


def newest_checkpoint(cfg: RunConfig) -> str | None:
    """The run directory's newest complete tag (``resolve_resume("auto")``); None: a fresh run."""
    from mpp.checkpoint.format import resolve_resume

    found = resolve_resume("auto", run_dir_of(cfg) / "checkpoints", verified=False)
    return found and found[1]


def finished_run(cfg: RunConfig, plan: Plan) -> tuple[str, int] | None:
    """(tag, step) of the run directory's newest complete checkpoint when this config would
    train it no further: the checkpoint at or past the last step (the trainer's: the schedule's
    end, or train.stop_at_step), the encoder exported after it and no stop signal recorded since
    (``mpp.hub.pretrained.init_record``'s test); None when there is training left to do."""
    from mpp.checkpoint.format import MARKER, saved_layout

    run_dir = run_dir_of(cfg)
    root, tag = run_dir / "checkpoints", newest_checkpoint(cfg)
    if tag is None:
        return None
    step = saved_layout(root, tag).get("step", int(tag.removeprefix("step")))
    last = min(plan.total_steps, cfg.train.stop_at_step or plan.total_steps)
    export = run_dir / "encoder.safetensors"
    if step < last or not export.is_file() or (run_dir / "preempted.json").exists():
        return None
    # a copy that kept no mtimes (cp -r) may say no: the run then goes on and exports again
    return (tag, step) if export.stat().st_mtime >= (root / tag / MARKER).stat().st_mtime else None


# What a checkpoint's tensors follow from besides the encoder's architecture (RUN/model.json):
# another value gives the objective other parameters (MAE's decoder, MPP's head of colour classes,
# HPM's base) or runs them otherwise (the decoder's heads), or feeds them other images, and no
# resume can go on from it. The rest of the objective (ratios, weights, schedules) may change.
# tests/test_resume_refusals.py checks that every objective key that reshapes the weights is here.
WEIGHT_KEYS = (
    "objective.name",
    "objective.base.name",  # HPM's base
    "objective.decoder_dim",
    "objective.decoder_depth",
    "objective.decoder_heads",
    "objective.mlp_ratio",
    "objective.target",
    "objective.bits",
    "objective.downsample_cells",
    "objective.base.target",
    "objective.base.bits",
    "objective.base.downsample_cells",
    "data.channels",
)
# the encoder's architecture keys a config sets elsewhere than in model: a classifier's head
HEAD_KEYS = {"num_classes": "finetune.num_classes", "global_pool": "finetune.global_pool"}
_MISSING = object()


def weight_changes(cfg: RunConfig, ckpt_root: str | Path, encoder: Any = None) -> dict[str, str]:
    """{key: "key old -> new"} for each key that changes what the checkpoints in ``ckpt_root``
    hold, against the run that wrote them: ``WEIGHT_KEYS`` against its config.json, and with
    ``encoder`` (this run's, built) its architecture against that run's model.json (the model's
    name alone is no change). Empty when nothing changed or nothing was recorded."""
    from mpp.checkpoint.format import written_by

    saved, model = written_by(ckpt_root)
    now = cfg.model_dump(mode="json")
    pairs = []
    for key in WEIGHT_KEYS if saved else ():
        was, new = _at(saved, key), _at(now, key)
        if key == "objective.name" or _MISSING not in (was, new):  # a pretraining or not
            pairs.append((key, None if was is _MISSING else was, None if new is _MISSING else new))
    if model and encoder is not None:
        built = encoder.architecture()
        pairs.append(("model.name", model.get("name", cfg.model.name), cfg.model.name))
        for name in dict.fromkeys([*built, *HEAD_KEYS]):
            key = HEAD_KEYS.get(name, f"model.{name}")
            if name in model or name in HEAD_KEYS:  # other keys: model.json from before them
                pairs.append((key, model.get(name), built.get(name)))
    changes = {key: f"{key} {was!r} -> {new!r}" for key, was, new in pairs if was != new}
    if "data.channels" in changes:
        changes.pop("model.in_chans", None)  # what data.channels built
    return {} if list(changes) == ["model.name"] else changes  # another name, the same model


def _at(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def check_resume(cfg: RunConfig, resume: str | None, encoder: Any = None) -> None:
    """Before anything runs or is written: a resume must keep the objective and the model
    (``weight_changes``; ``encoder``, this run's, for its architecture), the precision and the
    global batch (another world size, micro batch or accumulation is fine:
    ``mpp.checkpoint.manager`` re-partitions the checkpoint). ConfigError otherwise, one line."""
    from mpp.checkpoint.format import resolve_resume, saved_layout

    try:
        # the engine verifies
        found = resolve_resume(resume, run_dir_of(cfg) / "checkpoints", verified=False)
    except FileNotFoundError:
        return  # said by the engine on every rank
    if not found:
        return
    if changes := weight_changes(cfg, found[0], encoder):
        fix = (
            "--restart starts over (the earlier run moved aside), or --output-dir names a new run"
            if resume == "auto"
            else "--resume a checkpoint of this objective and model, or leave it out"
        )
        raise ConfigError(
            f"{source_of(cfg, next(iter(changes)))}: {', '.join(changes.values())}: the "
            f"checkpoint {found[0]}/{found[1]} holds another objective or model, which no resume "
            f"can load: {fix}"
        )
    saved = saved_layout(*found)
    try:
        now = cfg.resolved_precision(device_type())
    except ValueError:  # fp16 on a CPU: plan_run says so, naming the key
        return
    # checkpoints before issue 36 say no precision: there "auto" was bf16 on a GPU
    was = saved.get("precision", "bf16" if now == "bf16-autocast" and saved else now)
    if was != now:
        raise _failer(cfg)(
            "train.precision",
            f"{now} (ZeRO stage {cfg.zero_stage}), but the checkpoint {found[0]}/{found[1]} was "
            f"trained in {was} at stage {saved.get('zero_stage')}: set train.precision={was} (and "
            f"deepspeed.zero_optimization.stage={saved.get('zero_stage')}) to go on with it, "
            "or --restart to start over",
        )
    if saved.get("batch_size", cfg.train.batch_size) != cfg.train.batch_size:
        raise _failer(cfg)(
            "train.batch_size",
            f"{cfg.train.batch_size}, but the checkpoint {found[0]}/{found[1]} was "
            f"trained with {saved['batch_size']}: a resume keeps the global batch (the world size, "
            f"micro batch and accumulation may change); --restart starts over",
        )


def shards(
    cfg: Any, role: str, img_size: int, *, look: bool = True, warn: bool = False
) -> list[str] | None:
    """The shards a job reads as ``role``, the one answer every reader takes: "train"
    (data.train_shards, else the built-in digits' training split), "val" (data.val_shards, else
    the digits' validation split when training on them: fine-tuning's score, the probes', the
    previews') or "monitor" (monitor.val_shards, else "val"'s); None when the config names none.
    ``look``: the ones there, a missing training shard left out (``warn``: named in a warning,
    once per run: the plan's), none left or any missing held-out one refused (a score on part of
    a validation set is another number); else the ones named, not looked for (a submission's:
    they may be visible on the compute nodes only). ConfigError names the key."""
    spec, key = _spec(cfg, role, img_size)
    if spec is None:
        return None
    return _there(cfg, spec, key, warn)[0] if look else _named(cfg, spec, key)


def _spec(cfg: Any, role: str, img_size: int) -> tuple[Any, str]:
    """(the spec ``role``'s shards are named by, the key that names it)."""
    d = cfg.data
    if role == "monitor" and cfg.monitor.val_shards:
        return cfg.monitor.val_shards, "monitor.val_shards"
    if role == "train" and d.train_shards is not None:
        return d.train_shards, "data.train_shards"
    if role != "train" and (d.val_shards or d.train_shards is not None):
        return d.val_shards or None, "data.val_shards"
    return digits_shards(img_size)[role if role == "train" else "val"], "data.builtin"


def _there(cfg: Any, spec: Any, key: str, warn: bool = False) -> tuple[list[str], list[str]]:
    """(the shards ``spec`` names that are there, those not found): see ``shards``."""
    fail, named = _failer(cfg), _named(cfg, spec, key)
    try:
        missing = [s for s in named if not _exists(s)]
    except Exception as e:  # noqa: BLE001  a bad bucket, credential or endpoint: one line
        raise fail(key, f"cannot list {named[0]}: {type(e).__name__}: {e}") from None
    if missing and key not in ("data.train_shards", "data.builtin"):
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        lost = f"{len(missing)} of {len(named)} shard(s) not found: {', '.join(missing[:3])}{more}"
        raise fail(key, f"{lost} (a validation set is scored whole)")
    if len(missing) == len(named):
        raise fail(key, f"{len(missing)} shard(s) not found, first: {missing[0]}")
    if missing and warn:  # a lost shard costs its samples, not the run; counted in metrics
        lost = f"{len(missing)} of {len(named)} shards not found"
        log.warning("%s, training without them: %s", lost, ", ".join(missing[:10]))
    return [s for s in named if s not in set(missing)], missing


def monitor_on(cfg: Any) -> bool:
    """Whether the run's monitor measures (``mpp.train.monitor``): a monitor section and
    ``train.monitor_every`` above 0."""
    return bool(getattr(cfg, "monitor", None) is not None and cfg.train.monitor_every)


def previews_on(cfg: Any) -> bool:
    """Whether the run's previews draw (``mpp.train.preview``): ``train.preview_every`` above 0
    and somewhere to report them (``train.report_to``)."""
    return bool(cfg.train.preview_every and cfg.train.report_to)


def _named(cfg: Any, spec: Any, key: str) -> list[str]:
    """The shards ``spec`` expands to, not looked for; ConfigError naming ``key`` for a bad
    pattern or pipes not allowed."""
    fail = _failer(cfg)
    try:
        named = expand_shards(spec)
    except ValueError as e:
        raise fail(key, str(e)) from None
    if any(s.startswith("pipe:") for s in named) and not cfg.data.allow_pipe:
        raise fail(key, "pipe: shards run shell commands; set data.allow_pipe=true to allow them")
    return named


def _exists(url: str) -> bool:
    """A local shard's file, an object in storage (asked through fsspec); URLs and pipes are
    taken as given (their reader names them if they fail)."""
    from mpp.data.sources import OBJECT_SCHEMES, _scheme, object_exists

    if _scheme(url) in OBJECT_SCHEMES:
        return object_exists(url)
    return "://" in url or url.startswith("pipe:") or Path(url).is_file()


def _failer(cfg: RunConfig):
    return lambda key, msg: ConfigError(f"{source_of(cfg, key)}: {key}: {msg}")


# a stand-in for the shards a shipped *_b16 config leaves to the user: the planner needs the
# model and the batch, not the data (steps per epoch are then unknown)
PLACEHOLDER_SHARDS = "planned-without-data-{000000..000000}.tar"


# the classes a fine-tuning config is planned with when neither it nor its data says (ImageNet's)
PLACEHOLDER_CLASSES = 1000


def load_plan_config(config: str, overrides: list[str]) -> tuple[RunConfig, bool]:
    """(the validated config, whether its data is known) for planning a pretraining or a
    fine-tuning config: one without ``data.train_shards`` (the shipped ``*_b16``) is planned with
    a stand-in, a fine-tuning one from scratch (the step is the same whatever the weights) and
    with ImageNet's 1000 classes unless it says. A probe config is refused, named as such: it
    trains no DeepSpeed step. ConfigError as ``load_config``."""
    from mpp.config import apply_overrides, load_config, resolve_config_path

    path = resolve_config_path(config)
    raw = apply_overrides(json.loads(path.read_text()), overrides)
    if "probe" in raw:
        raise ConfigError(
            f"{path}: a probe config: the planner plans training steps under DeepSpeed "
            "(pretraining and fine-tuning); a probe extracts features once and trains a head on them"
        )
    data = raw.get("data") or {}
    known = data.get("train_shards") is not None or data.get("builtin") is not None
    extra = [] if known else [f"data.train_shards={PLACEHOLDER_SHARDS}"]
    if "finetune" not in raw:
        return load_config(config, [*overrides, *extra]), known
    finetune = raw.get("finetune") or {}
    if not (finetune.get("num_classes") or data.get("num_classes")) and not known:
        extra.append(f"finetune.num_classes={PLACEHOLDER_CLASSES}")
    if not known and data.get("val_shards") is None:  # a fine-tuning run scores its own val set
        extra.append(f"data.val_shards={PLACEHOLDER_SHARDS}")
    extra.append("init=scratch")
    return load_config(config, [*overrides, *extra], cls=FinetuneConfig), known
