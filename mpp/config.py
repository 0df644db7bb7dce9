"""The run configuration: JSON in, validated into typed sections, ``--set`` overrides,
resolved copy saved in the run directory. Every default lives here, nowhere else.

Sections: model, objective, masking, data, optim, train, deepspeed. ``objective`` is typed
per objective (``mpp.objectives.configs``: every registered objective, keyed on ``name``);
``masking`` is typed per strategy (``mpp.masking.MaskingConfig``, keyed on ``strategy``). ``deepspeed`` holds DeepSpeed's own keys, passed to ``deepspeed.initialize``;
the batch, precision and clipping keys are derived from ``train``/``optim`` (one source).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from mpp.masking import MASKING_CONFIGS, MaskingConfig, RandomMasking
from mpp.objectives.configs import OBJECTIVE_CONFIGS, ObjectiveConfig
from mpp.ops import IMAGENET_MEAN, IMAGENET_STD
from mpp.parallel.ds_config import derive, refusal_of
from mpp.sections import Section, nearest, refusals, refuse

# the shipped configs: configs/ at the top of the clone, linked as mpp/configs, which a wheel holds
CONFIG_DIR = (Path(__file__).parent / "configs").resolve()

# DeepSpeed keys that the train/optim sections own; setting them twice would let them disagree.
DERIVED_DS_KEYS = {
    "train_batch_size": "train.batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.micro_batch_size",
    "gradient_clipping": "optim.grad_clip",
    "bf16.enabled": "train.precision",
    "fp16.enabled": "train.precision",
    "torch_autocast.enabled": "train.precision",
    "torch_autocast.dtype": "train.precision",
    "optimizer": "optim",
    "scheduler": "optim (the engine computes warm-up + cosine per iteration)",
}


# DINO's weighted k-NN (k = 20, temperature 0.07): the k-NN probe's and the monitor's defaults
KNN_K, KNN_TEMPERATURE = 20, 0.07
# the data keys that ask for a labelled subset (few labels): one at most
LABEL_SUBSET_KEYS = ("labels_per_class", "label_fraction", "label_keys")


class ConfigError(ValueError):
    """A bad configuration: a line per finding, each naming the key and the file (or the
    override over it) and what to do; several are said at once, under a line that counts them."""

    def __init__(self, *findings: str) -> None:
        super().__init__(*findings)

    @property
    def findings(self) -> list[str]:
        return [str(f) for f in self.args]

    def __str__(self) -> str:
        if len(self.args) == 1:
            return str(self.args[0])
        shown = "\n".join(f"  {f}" for f in self.findings)
        return f"{len(self.args)} problems (all of them, each with its fix):\n{shown}"


T = TypeVar("T")


class Refusals:
    """Checks run one after another with every refusal kept, so that one ConfigError lists them
    all: a user once fixed a 16-bit image set in four runs, one refusal at a time."""

    def __init__(self) -> None:
        self.findings: list[str] = []

    def __call__(self, check: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """``check(*args, **kwargs)``, or None with its refusal kept."""
        try:
            return check(*args, **kwargs)
        except ConfigError as e:
            self.findings += e.findings
            return None

    def raise_any(self) -> None:
        """One ConfigError listing every refusal kept (each once), if any was."""
        if self.findings:
            raise ConfigError(*dict.fromkeys(self.findings))


class ModelConfig(Section):
    name: str = "vit_base_patch16_224"
    """The ViT variant (timm's names: vit_base_patch16_224, vit_tiny_patch4_32, ...); the keys below
    override its size."""
    img_size: int | None = Field(None, gt=0)
    """The input side in pixels; None: the variant's. A new size resamples pretrained position
    embeddings."""
    patch_size: int | None = Field(None, gt=0)
    """The patch side in pixels; None: the variant's."""
    in_chans: int | None = Field(None, gt=0)
    """None: data.channels."""
    embed_dim: int | None = Field(None, gt=0)
    """The token width; None: the variant's."""
    depth: int | None = Field(None, gt=0)
    """The number of blocks; None: the variant's."""
    num_heads: int | None = Field(None, gt=0)
    """Attention heads per block; None: the variant's."""
    pos_embed: Literal["learned", "sincos"] = "learned"
    """Learned 1-D position embeddings (ViT) or the fixed 2-D sin-cos table (MAE, HPM)."""
    attn_backend: Literal["auto", "xformers", "sdpa", "math"] = "auto"
    """auto: xformers' memory-efficient attention on CUDA when importable, else PyTorch SDPA; or one
    of them, or math (the explicit reference)."""
    drop_path_rate: float = Field(0.0, ge=0.0, lt=1.0)
    """Stochastic depth, linear from 0 to this over the blocks (fine-tuning's 0.1)."""
    norm_eps: float | None = Field(None, gt=0.0)
    """None: what the init weights state (a Hugging Face folder's layer_norm_eps, 1e-12 in Google's
    checkpoints), else the ViT's own 1e-6 / True; a value here that contradicts the file is an
    error."""
    qkv_bias: bool | None = None
    """Bias on the qkv projection; None: what the init weights state, else True."""
    grad_checkpointing: bool = False
    """Activation checkpointing per block (timm's name), encoder and decoders: recompute each
    block's activations in the backward instead of keeping them; not architecture."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile through DeepSpeed's engine.compile(): x1.18-1.29 per step on an H200
    (BENCHMARKS.md). auto: on for CUDA runs of at least 5,000 steps, where its compile at each
    start (about a minute cold) is paid back; off on the CPU and for shorter runs (one log line
    says which and why, mpp.train.trainer.resolve_compile)."""
    init: str | None = None
    """Pretraining only: continue from published weights (an encoder file, a Hugging Face ViT
    folder, MAE's / HPM's release .pth whose decoder also initialises an MAE decoder, a run)"""
    init_chans_policy: Literal["adapt", "error"] = "adapt"
    """Weights in with another channel count (RGB weights on data.channels=C): "adapt" as timm's
    adapt_input_conv (1 channel: summed; C > 3: tiled, scaled by 3 / C), or "error"."""

    def vit_kwargs(self) -> dict[str, Any]:
        """Overrides for ``create_vit(self.name, **overrides)``: only what was set."""
        runtime = {"name", "init", "init_chans_policy", "grad_checkpointing", "compile"}
        return self.model_dump(exclude=runtime, exclude_none=True)


class DataConfig(Section):
    train_shards: str | list[str] | None = None
    """Brace patterns, paths or http(s) URLs."""
    val_shards: str | list[str] | None = None
    """The validation shards (fine-tuning's evaluation, the probes, the monitor's held-out images);
    the same forms. Fine-tuning and the probes on train_shards refuse to run without them."""
    builtin: Literal["digits"] | None = None
    """Used when train_shards is not given."""
    num_samples: int | None = Field(None, gt=0)
    """For shards without sizes.json."""
    num_classes: int | None = Field(None, gt=0)
    """The label count; None: from the shards' class list (sizes.json)."""
    num_workers: int = Field(2, ge=0)
    """DataLoader workers per rank (each decodes and augments its share of every micro-batch)."""
    prefetch: int = Field(2, ge=1)
    """Micro-batches made ready on the device ahead of the step, in a thread of the training
    process (mpp.data.prefetch): copied, decoded (data.decode=gpu) and normalised while it runs."""
    shuffle_buffer: int = Field(16, ge=1)
    """Samples shuffled together in each stream of the global batch (mpp.data.order)"""
    crop_scale: tuple[float, float] = (0.2, 1.0)
    """RandomResizedCrop's range of the image area kept."""
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    """RandomResizedCrop's range of aspect ratios."""
    hflip: float = Field(0.5, ge=0.0, le=1.0)
    """The probability of a horizontal flip."""
    decode: Literal["auto", "cpu", "gpu"] = "auto"
    """Training JPEGs decoded by the loader's workers (cpu) or in a batch on the GPU with nvJPEG
    (gpu: torchvision's; the workers still read them and draw each crop, mpp.data.device_decode);
    auto: the GPU where torchvision's nvJPEG runs. Other formats are decoded by the workers."""
    channels: int = Field(3, gt=0)
    """What every sample holds (mpp.data.transforms): its channels; the layout of arrays whose shape
    cannot say; for data that is not 8-bit, the values that map to [0, 1] ("auto": the observed
    range); never an implicit 255."""
    layout: Literal["HWC", "CHW"] | None = None
    """HWC or CHW, for arrays whose shape cannot say (a 4 x 16 x 4 array); None: read from the
    shape."""
    value_range: tuple[float, float] | Literal["auto"] | None = None
    """For data that is not 8-bit: the [low, high] that maps to [0, 1] (clipped), or "auto" for the
    observed range; never an implicit 255."""
    mean: tuple[float, ...] | Literal["auto"] = IMAGENET_MEAN
    """Per channel, of [0, 1] pixels; "auto": measured on stats_samples training images
    (mpp.data.stats, cached beside the shard counts), then saved in RUN/data.json."""
    std: tuple[float, ...] | Literal["auto"] = IMAGENET_STD
    """Per channel, of [0, 1] pixels; "auto": measured with the mean."""
    stats_samples: int = Field(1024, gt=0)
    """How many training images "auto" statistics are measured on."""
    display_channels: tuple[int, ...] | None = None
    """Which channels the previews and pictures show (3, or 1 as grey); None: the first three."""
    allow_pipe: bool = False
    """`pipe:` URLs run shell commands: only when asked for."""
    labels_per_class: int | None = Field(None, gt=0)
    """Few labels (fine-tuning, the linear probe and k-NN; mpp.data.labels): K labelled samples per
    class, a fraction p of them (K = round(p N / C) per class) or a file of keys, chosen from the
    training shards with label_seed; the validation shards always stay whole."""
    label_fraction: float | None = Field(None, gt=0.0, le=1.0)
    """Few labels: a fraction p of the labelled samples, as K = round(p N / C) per class (balanced)."""
    label_keys: str | None = None
    """Few labels: a file of sample keys, one per line (RUN/label_keys.txt, or a published list)."""
    label_seed: int = 0
    """The seed that chooses the labelled subset (the same subset on every rank and world size)."""
    log_keys: bool = False
    """RUN/keys/rankN.jsonl: every trained sample's key, by (epoch, micro-batch)"""

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        found = []
        lo, hi = self.crop_scale
        if not 0.0 < lo <= hi <= 1.0:
            found.append(f"crop_scale must satisfy 0 < min <= max <= 1, got {self.crop_scale}")
        if not 0.0 < self.crop_ratio[0] <= self.crop_ratio[1]:
            found.append(f"crop_ratio must satisfy 0 < min <= max, got {self.crop_ratio}")
        chosen = [k for k in LABEL_SUBSET_KEYS if getattr(self, k) is not None]
        if len(chosen) > 1:
            found.append(f"set one of {', '.join(chosen)}, not several")
        refuse(found)
        return self

    @property
    def auto_stats(self) -> bool:
        """Whether the mean, std or value range is to be measured on the data."""
        return "auto" in (self.mean, self.std, self.value_range)

    @property
    def label_subset_key(self) -> str | None:
        """The key that asks for a labelled subset (``data.labels_per_class``, ...), if any."""
        return next((k for k in LABEL_SUBSET_KEYS if getattr(self, k) is not None), None)


class OptimConfig(Section):
    name: Literal["adam", "adamw"] | None = None
    """None: the objective's paper (Adam for mpp, AdamW otherwise)"""
    lr: float | None = Field(None, gt=0.0)
    """Absolute peak lr; else blr * batch_size / 256."""
    blr: float | None = Field(None, gt=0.0)
    """Base lr: the peak is blr x batch_size / 256 (MAE's rule); set lr or blr."""
    betas: tuple[float, float] | None = None
    """None: the paper's (0.9, 0.999) for Adam, (0.9, 0.95) for AdamW."""
    eps: float = Field(1e-8, gt=0.0)
    """Adam's epsilon."""
    weight_decay: float = Field(0.05, ge=0.0)
    """Decoupled weight decay (AdamW) or L2 (Adam); none on biases, norms, position embeddings and
    tokens."""
    warmup_steps: int | None = Field(None, ge=0)
    """Linear warm-up from 0, in optimiser steps; or warmup_epochs."""
    warmup_epochs: float | None = Field(None, ge=0.0)
    """Linear warm-up from 0, in epochs (fractions allowed); or warmup_steps."""
    min_lr: float = Field(0.0, ge=0.0)
    """The cosine decay's floor."""
    grad_clip: float | None = Field(None, gt=0.0)
    """Clip the global gradient norm to this; None: no clipping."""
    layer_decay: float = Field(1.0, gt=0.0, le=1.0)
    """Lr x decay^(depth - layer): fine-tuning's 0.65 / 0.8."""

    @model_validator(mode="after")
    def _check(self) -> OptimConfig:
        found = []
        if self.lr is None and self.blr is None:
            found.append("one of lr or blr must be set")
        if self.lr is not None and self.blr is not None:
            found.append(f"set lr or blr, not both (lr={self.lr}, blr={self.blr})")
        if self.warmup_steps is not None and self.warmup_epochs is not None:
            found.append("set warmup_steps or warmup_epochs, not both")
        if self.betas is not None and not all(0.0 <= b < 1.0 for b in self.betas):
            found.append(f"betas must be in [0, 1), got {self.betas}")
        refuse(found)
        return self


class TrainConfig(Section):
    batch_size: int = Field(256, gt=0)
    """Global: micro_batch_size x grad accumulation x world size."""
    micro_batch_size: int | None = Field(None, gt=0)
    """Per rank, exactly; None: derived (below)"""
    max_micro_batch_size: int | None = Field(None, gt=0)
    """The most one rank holds at once (its memory): micro batch and accumulation follow from the
    world size, so one config runs on 8 and on 64 GPUs (4096 = 8 x 2 x 256 = 64 x 1 x 64)"""
    epochs: float | None = Field(None, gt=0.0)
    """How long the schedule is, in epochs (fractions allowed); or max_steps."""
    max_steps: int | None = Field(None, gt=0)
    """Optimiser steps; overrides epochs (sets the schedule)"""
    min_steps: int | None = Field(None, gt=0)
    """The floor of an epochs schedule, in optimiser steps: shorter, it is stretched to this (its
    warmup_epochs alike), with one line. An epoch of small data is a step or two: 10 epochs of
    162 images fine-tuned 20 steps, 27.5 points under a linear probe of the same encoder."""
    stop_at_step: int | None = Field(None, gt=0)
    """Stop early, schedule unchanged (time-limited jobs)"""
    output_dir: str = "runs/{name}"
    """The run directory; {name} is the config's name. --output-dir replaces it."""
    log_every: int = Field(10, gt=0)
    """A metrics.jsonl record (averaged over ranks) every this many optimiser steps."""
    ckpt_every: int = Field(1000, gt=0)
    """A checkpoint every this many optimiser steps, and one at the end."""
    keep_last: int = Field(2, gt=0)
    """Complete checkpoints kept; older ones are removed once a newer one is complete."""
    seed: int = 0
    """Initial weights, masks and augmentation: the same seed gives the same run."""
    precision: Literal["auto", "fp32", "bf16", "bf16-autocast", "fp16"] = "auto"
    """bf16: DeepSpeed's (a bf16 module, fp32 master weights in the optimiser); bf16-autocast: fp32
    weights, the forward under torch.autocast in bf16 (timm's and MAE's AMP; DeepSpeed's
    torch_autocast). Auto: on CUDA bf16-autocast at ZeRO stage 0 (the multi-tensor path, and
    the same 16 bytes per parameter), bf16 at stages 1-3 (2-byte weights); fp32 on CPU."""
    max_bad_steps: int = Field(10, ge=0)
    """Non-finite losses skipped before the run stops (or rolls back)"""
    on_nonfinite: Literal["skip", "rollback", "stop"] = "skip"
    """Past max_bad_steps non-finite losses: stop, or roll back to the last checkpoint and go on
    (skip: only skip)."""
    rollback_lr_scale: float = Field(1.0, gt=0.0, le=1.0)
    """Lr x this after each rollback."""
    max_rollbacks: int = Field(3, ge=0)
    """Rollbacks before the run stops (on_nonfinite=rollback)."""
    skip_nonfinite: bool = True
    """Check every micro-step's loss (one host sync) and skip NaN/Inf steps."""
    preview_every: int = Field(1000, ge=0)
    """Pictures of the objective on fixed val images (mpp.train.preview); 0: none."""
    monitor_every: int = Field(1000, ge=0)
    """The monitor (mpp.train.monitor, the monitor section): every this many optimiser steps and
    after the last, a k-NN top-1 of the encoder and the objective's held-out signal; 0: never.
    At 1000 it costs ~1-1.5 % of a ViT-B/16 recipe's FLOPs with ImageNet's 50,000 held-out images
    (BENCHMARKS.md, monitor); the demo configs, 690 steps long, set 200."""
    report_to: list[Literal["tensorboard", "wandb"]] = ["tensorboard"]
    """Where metrics go besides metrics.jsonl: TensorBoard (RUN/tb) and/or W&B."""

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        found = []
        if self.epochs is None and self.max_steps is None:
            found.append("one of epochs or max_steps must be set")
        if self.on_nonfinite != "skip" and not self.skip_nonfinite:
            found.append(
                f"on_nonfinite={self.on_nonfinite!r} needs skip_nonfinite=true (the check that "
                "sees a NaN)"
            )
        if self.micro_batch_size is not None and self.max_micro_batch_size is not None:
            found.append("set micro_batch_size (exact) or max_micro_batch_size (a bound), not both")
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:
            found.append(
                f"batch_size {self.batch_size} is not divisible by micro_batch_size "
                f"{self.micro_batch_size}"
            )
        refuse(found)
        return self


def _channels_disagree(cfg: Any) -> list[str]:
    """Where the pixel keys do not fit ``data.channels``, or ``model.in_chans``, when set, does
    not agree with it (unset, the encoder is built with data.channels): a finding each."""
    data, c = cfg.data, cfg.data.channels
    found = []
    init = getattr(cfg, "init", None) or getattr(getattr(cfg, "model", None), "init", None)
    init = None if init == "scratch" else init  # fine-tuning's and the probes' "no weights"
    given = data.model_fields_set
    for key in ("mean", "std"):
        value = getattr(data, key)
        if init is not None and (key not in given or "channels" not in given):
            continue  # the init's facts fill what is unset (mpp.build.with_init_facts checks again)
        if value != "auto" and len(value) != c:
            hint = " (ImageNet's)" if value in (IMAGENET_MEAN, IMAGENET_STD) else ""
            found.append(
                f"data.{key}: {len(value)} values{hint} for data.channels={c}: give {c} "
                'or "auto" (measured on the training shards)'
            )
    if data.std != "auto" and any(v <= 0 for v in data.std):
        found.append(f"data.std must be positive, got {list(data.std)}")
    vr = data.value_range
    if isinstance(vr, tuple) and not vr[0] < vr[1]:
        found.append(f"data.value_range: need low < high, got {list(vr)}")
    shown = data.display_channels
    if shown is not None and (len(shown) not in (1, 3) or not all(0 <= i < c for i in shown)):
        found.append(
            f"data.display_channels: 3 channels (or 1, grey) of 0..{c - 1}, got {list(shown)}"
        )
    if cfg.model.in_chans not in (None, c):
        found.append(
            f"model.in_chans={cfg.model.in_chans} but data.channels={c}: the patch embedding must "
            "take what the data holds (set one, or both alike)"
        )
    return found


def _not_scored_on_its_own_data(cfg: Any) -> list[str]:
    """Fine-tuning and the probes score ``data.val_shards``; unset, the built-in digits'
    validation split, which only a run on the built-in digits may be scored on."""
    if cfg.data.train_shards is not None and cfg.data.val_shards is None:
        return [
            "data.val_shards: not set beside data.train_shards; the scores would come from the "
            "built-in digits' validation split: give your data's validation shards"
        ]
    return []


class RunConfig(Section):
    """What every DeepSpeed run has: a model, data, an optimiser, a loop and DeepSpeed's keys."""

    name: str = "run"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig
    train: TrainConfig
    deepspeed: dict[str, Any] = Field(default_factory=dict)
    _source: str = PrivateAttr("<config>")  # the file it came from, for error messages
    _overrides: list[str] = PrivateAttr(default_factory=list)  # the --set items over it
    _given: str = PrivateAttr("cli")  # how the overrides were given (GIVEN)

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        refuse(self._across_keys())
        return self

    def _across_keys(self) -> list[str]:
        """What the sections say together, a finding each (a kind of run adds its own)."""
        found, not_objects = [], set()  # a section that is no object: said once
        for key, owner in DERIVED_DS_KEYS.items():
            section, _, leaf = key.partition(".")
            held = self.deepspeed.get(section) if leaf else self.deepspeed
            if leaf and held is not None and not isinstance(held, dict):
                if section not in not_objects:
                    not_objects.add(section)
                    found.append(
                        f"deepspeed.{section} must be an object of DeepSpeed's keys; its {leaf} "
                        f"is derived from {owner}"
                    )
            elif isinstance(held, dict) and (leaf or section) in held:
                found.append(f"deepspeed.{key} is derived from {owner}; set it there")
        stage = self.zero_stage
        if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage <= 3:
            found.append(f"deepspeed.zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
        if self.data.train_shards is None and self.data.builtin is None:
            found.append("data.train_shards is not set (give shards, or data.builtin='digits')")
        found += _channels_disagree(self)
        # DeepSpeed's parser on what a GPU run would give it (on a CPU only the precision
        # differs); only on a deepspeed section that the checks above let through
        if not any(f.startswith("deepspeed.") for f in found) and (
            why := refusal_of(self.deepspeed, lambda: self.deepspeed_config(1, "cuda"))
        ):
            found.append(why)
        return found

    @property
    def randaug(self) -> tuple[int, int] | None:
        """The training stream's RandAugment (n, m): fine-tuning's; None in pretraining."""
        return None

    @property
    def zero_stage(self) -> Any:
        return (self.deepspeed.get("zero_optimization") or {}).get("stage", 0)

    # ---- runtime checks (need the world size / device), before any run directory exists ----

    def micro_batch(self, world_size: int) -> tuple[int, int]:
        """(micro batch per rank, gradient accumulation steps) for this world size."""
        t = self.train
        if t.micro_batch_size is None:
            if t.batch_size % world_size:
                raise ValueError(
                    f"train.batch_size {t.batch_size} is not divisible by the world size {world_size}"
                )
            per_rank = t.batch_size // world_size
            bound = t.max_micro_batch_size or per_rank
            # the fewest accumulation steps whose micro batch fits the bound and splits evenly
            accum = next(
                a for a in range(1, per_rank + 1) if per_rank % a == 0 and per_rank // a <= bound
            )
            return per_rank // accum, accum
        if t.batch_size % (t.micro_batch_size * world_size):
            raise ValueError(
                f"train.batch_size {t.batch_size} is not divisible by train.micro_batch_size "
                f"{t.micro_batch_size} x world size {world_size}"
            )
        return t.micro_batch_size, t.batch_size // (t.micro_batch_size * world_size)

    def resolved_precision(self, device_type: str) -> str:
        p = self.train.precision
        if p == "auto":
            if device_type != "cuda":
                return "fp32"
            return "bf16-autocast" if self.zero_stage == 0 else "bf16"
        if device_type != "cuda" and p == "fp16":
            raise ValueError(
                "train.precision 'fp16' needs a GPU (the CPU accelerator runs fp32 and bf16)"
            )
        return p

    def deepspeed_config(self, world_size: int, device_type: str) -> dict[str, Any]:
        """The dict for ``deepspeed.initialize(config=...)`` (``mpp.parallel.ds_config``)."""
        micro, accum = self.micro_batch(world_size)
        return derive(
            self.deepspeed,
            self.train.batch_size,
            micro,
            accum,
            self.optim.grad_clip,
            self.resolved_precision(device_type),
            guarded=self.train.skip_nonfinite,
        )


class MonitorSection(Section):
    """What pretraining measures every ``train.monitor_every`` steps (``mpp.train.monitor``): the
    weighted k-NN of ``downstream/knn.py``, and the objective's own signal on held-out images."""

    bank_per_class: int = Field(20, gt=0)
    """The k-NN bank: this many labelled training images per class."""
    val_shards: str | list[str] | None = None
    """None: data.val_shards, else the built-in dataset's validation split."""
    seed: int = 0
    """The seed that chooses the bank."""
    pool: Literal["token", "avg"] = "token"
    """The feature: the last block's cls token or mean patch token (knn.py's probe.pool)."""
    k: int = Field(KNN_K, gt=0)
    """Neighbours that vote."""
    temperature: float = Field(KNN_TEMPERATURE, gt=0.0)
    """Each neighbour votes exp(similarity / T)."""


class Config(RunConfig):
    """Pretraining: the objective and its masking."""

    objective: ObjectiveConfig = OBJECTIVE_CONFIGS["mpp"]()
    masking: MaskingConfig = RandomMasking()
    monitor: MonitorSection = MonitorSection()

    def _across_keys(self) -> list[str]:
        """Pretraining trains on every image: a labelled subset is the evaluations'."""
        found = super()._across_keys()
        if (key := self.data.label_subset_key) is not None:
            found.append(
                f"data.{key}: a labelled subset is for fine-tuning and the probes; pretraining "
                "trains on every image (the monitor's labelled bank is monitor.bank_per_class)"
            )
        return found

    @field_validator("objective", mode="before")
    @classmethod
    def _mpp_unless_named(cls, raw: Any) -> Any:
        """An objective section without ``name`` is MPP's (the default objective)."""
        return {"name": "mpp", **raw} if isinstance(raw, dict) and "name" not in raw else raw

    @model_validator(mode="before")
    @classmethod
    def _hpm_masks_itself(cls, raw: Any) -> Any:
        """HPM's mask is its teacher's choice: neither a ``masking.strategy`` of its own nor
        a masking section beside ``objective.name="hpm"``."""
        if not isinstance(raw, dict) or not isinstance(raw.get("masking"), dict):
            return raw
        objective = raw.get("objective") if isinstance(raw.get("objective"), dict) else {}
        name = objective.get("name", "mpp")
        if raw["masking"].get("strategy") == "hpm":
            raise ValueError(
                'masking.strategy: "hpm" masks the patches a teacher predicts to be hard, which '
                f'only HPM has: set objective.name="hpm" (objective.base="{name}") instead; '
                f"strategies: {', '.join(sorted(MASKING_CONFIGS))}"
            )
        if name == "hpm" and raw["masking"] not in ({}, {"strategy": "random"}):
            raise ValueError(
                'masking: objective.name="hpm" chooses its own masks (its teacher); '
                "remove the masking section"
            )
        return raw


class FinetuneSection(Section):
    """The supervised recipe (MAE/BEiT fine-tuning, docs/ARCHITECTURE.md §4.6)."""

    num_classes: int | None = Field(None, gt=0)
    """None: from the shards' class list / data.num_classes."""
    global_pool: Literal["avg", "token"] = "avg"
    """avg: the mean of the patch tokens through fc_norm (MAE's fine-tuning); token: the cls token
    after the final norm."""
    label_smoothing: float = Field(0.1, ge=0.0, lt=1.0)
    """Label smoothing of the soft targets."""
    mixup: float = Field(0.8, ge=0.0)
    """Beta(alpha, alpha); 0 disables."""
    cutmix: float = Field(1.0, ge=0.0)
    """CutMix's Beta(a, a); 0 disables."""
    mixup_prob: float = Field(1.0, ge=0.0, le=1.0)
    """The probability a batch is mixed at all."""
    mixup_switch_prob: float = Field(0.5, ge=0.0, le=1.0)
    """With both on, the probability of CutMix rather than mixup."""
    randaug_n: int = Field(2, ge=0)
    """RandAugment(n ops, magnitude m / 10); n=0 disables."""
    randaug_m: int = Field(9, ge=0, le=30)
    """RandAugment's magnitude (of 30; timm's m9)."""
    reprob: float = Field(0.25, ge=0.0, le=1.0)
    """Random erasing."""
    eval_batch_size: int | None = Field(None, gt=0)
    """The evaluation's batch per rank; None: the micro-batch."""
    eval_every: int | None = Field(None, gt=0)
    """Evaluate every this many optimiser steps (and at the end); None: every epoch. With few labels
    an epoch is a few steps: evaluate on a schedule of steps instead."""
    head_init_std: float = Field(2e-5, gt=0.0)
    """The fresh head's init: MAE's fine-tuning (2e-5, so the first steps do not push large random
    gradients into pretrained blocks); timm's supervised recipe from scratch uses 0.02."""


class FinetuneConfig(RunConfig):
    """Supervised fine-tuning from ``init``: a run dir, a DeepSpeed checkpoint, a .safetensors or 'scratch'."""

    init: str = "scratch"
    finetune: FinetuneSection = FinetuneSection()

    def _across_keys(self) -> list[str]:
        return super()._across_keys() + _not_scored_on_its_own_data(self)

    @property
    def randaug(self) -> tuple[int, int] | None:
        f = self.finetune
        return (f.randaug_n, f.randaug_m) if f.randaug_n > 0 else None


class ProbeSection(Section):
    """Frozen-encoder evaluations (docs/ARCHITECTURE.md §4.6): linear probe and k-NN on cached features."""

    pool: Literal["token", "avg"] = "token"
    """The feature: the cls token (MAE's linear probe) or the mean of the patch tokens."""
    batch_size: int = Field(256, gt=0)
    """The head's batch (the mae protocol: the global step, across ranks)."""
    epochs: int = Field(90, gt=0)
    """Passes over the training features."""
    blr: float = Field(0.1, gt=0.0)
    """SGD lr = blr x batch / 256 (MAE: 0.1)"""
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    """SGD's (or LARS') momentum."""
    weight_decay: float = Field(0.0, ge=0.0)
    """The head's weight decay (MAE's: 0)."""
    warmup_epochs: int = Field(10, ge=0)
    """Linear warm-up of the head's lr, in epochs."""
    k: int = Field(KNN_K, gt=0)
    """k-NN: neighbours that vote."""
    temperature: float = Field(KNN_TEMPERATURE, gt=0.0)
    """k-NN: each neighbour votes exp(similarity / T)."""
    protocol: Literal["fast", "mae", "dinov2"] = "fast"
    """The linear probe's recipe (docs/downstream.md, "Probe protocols"): cached features + SGD, MAE's (BatchNorm
    + LARS, augmented images through the frozen encoder), DINOv2's (a grid in one pass)"""
    layers: Literal["last", "all"] = "last"
    """last: the last block's feature; all: every block's, in one feature pass (a table per block)."""
    holdout: float = Field(0.1, gt=0.0, lt=1.0)
    """Dinov2: the share of train that picks the grid's best head."""


class ProbeConfig(Section):
    name: str = "probe"
    init: str = "scratch"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    probe: ProbeSection = ProbeSection()
    output_dir: str = "runs/{name}"
    seed: int = 0
    _source: str = PrivateAttr("<config>")
    _overrides: list[str] = PrivateAttr(default_factory=list)  # the --set items over it
    _given: str = PrivateAttr("cli")  # how the overrides were given (GIVEN)

    @model_validator(mode="after")
    def _check(self) -> ProbeConfig:
        refuse(_channels_disagree(self) + _not_scored_on_its_own_data(self))
        return self


# ---- loading -------------------------------------------------------------------------------


def resolve_config_path(path: str | Path) -> Path:
    """A path as given, or a bare name (``mpp_b16`` / ``mpp_b16.json``) looked up in configs/."""
    p = Path(path)
    if p.is_file():
        return p
    for cand in (CONFIG_DIR / p.name, CONFIG_DIR / f"{p.name}.json"):
        if p.parent == Path(".") and cand.is_file():
            return cand
    shipped = sorted(c.stem for c in CONFIG_DIR.glob("*.json"))
    near = nearest(p.stem, shipped) if p.parent == Path(".") else None
    hint = f"did you mean {near}? " if near else ""
    raise ConfigError(
        f"{path}: config file not found (looked here and in {CONFIG_DIR}); {hint}shipped: "
        + ", ".join(shipped)
    )


# how an error names the override that made a key's value: the command line's --set, the
# Python API's arguments (mpp.pretrain(..., train={"max_steps": 50}))
GIVEN = {"cli": "--set {item}", "api": "the argument {item}"}


def apply_overrides(
    raw: dict[str, Any], overrides: list[str], given: str = "cli"
) -> dict[str, Any]:
    """A copy of ``raw`` with each ``a.b=value`` set, the value parsed as JSON, else the string."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{GIVEN[given].format(item=repr(item))}: expected key=value")
        key, value = item.split("=", 1)
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
        keys = key.strip().split(".")
        node = raw
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{GIVEN[given].format(item=repr(item))}: {k} is not a section")
        node[keys[-1]] = value
    return raw


def as_overrides(values: dict[str, Any]) -> list[str]:
    """``{"train.max_steps": 50}`` (the API's overrides) as ``key=value`` items, each value as
    JSON (``read_config(..., given="api")``)."""
    return [f"{key}={json.dumps(value)}" for key, value in values.items()]


def attributed(
    source: str, key: str, overrides: list[str], unknown: bool = False, given: str = "cli"
) -> str:
    """Where ``key``'s value came from: the override that made it (over the file; a ``--set``,
    or an argument of the API: ``given``), else the file (the last such override: it is the one
    that holds). ``unknown``: an unknown key, which an override of a key below it may have
    made."""
    for item in reversed(overrides):
        name = item.split("=", 1)[0].strip()
        if key and (
            key == name or key.startswith(name + ".") or (unknown and name.startswith(key + "."))
        ):
            return f"{GIVEN[given].format(item=item)} (over {source})"
    return source


def source_of(cfg: Any, key: str) -> str:
    """``attributed`` for a loaded config's key: where a later check's error says it came from."""
    return attributed(
        getattr(cfg, "_source", "<config>"),
        key,
        getattr(cfg, "_overrides", []),
        given=getattr(cfg, "_given", "cli"),
    )


def validate(
    raw: dict[str, Any],
    source: str = "<config>",
    cls: type[BaseModel] = Config,
    overrides: list[str] = (),
    given: str = "cli",
) -> Any:
    """``raw`` as ``cls``; a refusal is a ConfigError of every error found, a line each: where
    (the file, or the override that made it), the key, what is wrong (``mpp.sections.refusals``)."""
    try:
        return cls.model_validate(raw)
    except ValidationError as err:
        found = []
        for key, msg, unknown in refusals(err, cls, raw):
            # a check across keys has no key of its own: the keys its message names, in order
            named = [key] if key else re.findall(r"\b[a-z_]+(?:\.[a-z_]+)+\b", msg)
            where = (attributed(source, k, overrides, unknown, given) for k in named)
            where = next((s for s in where if s != source), source)
            found.append(f"{where}: {key}: {msg}" if key else f"{where}: {msg}")
        raise ConfigError(*found) from None


def load_config(
    path: str | Path, overrides: list[str] | None = None, cls: type[BaseModel] = Config
) -> Any:
    """Read, override, validate. Errors are ``ConfigError`` naming the key and the file, or the
    ``--set`` over it."""
    return read_config(path, overrides, cls)


def read_config(
    path: str | Path,
    overrides: list[str] | None = None,
    cls: type[BaseModel] = Config,
    given: str = "cli",
) -> Any:
    """``load_config`` with the overrides' origin (``given``): "cli", a ``--set``; "api", an
    argument of ``mpp.pretrain``... (the errors name it)."""
    p = resolve_config_path(path)
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a JSON object at the top level")
    raw = apply_overrides(raw, overrides or [], given)
    cfg = validate(raw, str(p), cls, overrides or [], given)
    cfg._source = str(p)
    if hasattr(cfg, "_overrides"):
        cfg._overrides = list(overrides or [])
        cfg._given = given
    return cfg


def save_config(cfg: BaseModel, path: str | Path) -> None:
    Path(path).write_text(json.dumps(cfg.model_dump(mode="json"), indent=2) + "\n")
