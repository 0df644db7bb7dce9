"""DeepSpeed's config, derived from ours: the batch split, clipping, precision and the defaults the
GPU path needs (docs/ARCHITECTURE.md §5.1). A key set in the ``deepspeed`` section wins over
every default here (``bf16``/``fp16`` too, but for ``enabled``, which ``train.precision``
decides)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any


def derive(
    user: dict[str, Any],
    batch: int,
    micro: int,
    accum: int,
    grad_clip: float | None,
    precision: str,
    guarded: bool = True,
) -> dict[str, Any]:
    """The dict for ``deepspeed.initialize(config=...)`` from the config's ``deepspeed`` section.
    ``guarded``: mpp's own finite-loss check runs every micro-step (``train.skip_nonfinite``)."""
    ds = copy.deepcopy(user)
    ds.update(
        train_batch_size=batch,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accum,
        steps_per_print=10**9,  # our own logging; DeepSpeed's would repeat it
        zero_allow_untested_optimizer=True,  # a plain torch Adam/AdamW, so per-group lr stays ours
    )
    zero = ds.setdefault("zero_optimization", {"stage": 0})
    stage = zero.get("stage", 0)
    offload = (zero.get("offload_optimizer") or {}).get("device", "none") != "none"
    # always written: DeepSpeed's own default is 1.0 (deepspeed/runtime/constants.py), so a recipe
    # without clipping (MAE, HPM) had its gradients clipped to norm 1 and a norm computed per step
    ds["gradient_clipping"] = grad_clip or 0.0
    # DeepSpeed's throughput timer is on by default and synchronizes the device in every
    # forward and every step() (deepspeed/utils/timer.py): two host syncs per micro-step
    ds.setdefault("timers", {"throughput": {"enabled": False}})
    if stage > 0:
        # 5e8-element buckets exceed ViT-B's 86M parameters, so the reduction would start only
        # after the whole backward; at stage 3 the fp32 bucket alone held 1.86 GiB per GPU
        # (python -m mpp.tools.planner, measured on the engine), more than ZeRO-1's whole model states
        zero.setdefault("reduce_bucket_size", int(5e7))
    if stage in (1, 2):
        zero.setdefault("overlap_comm", True)  # stage 3 overlaps by default, stages 1/2 do not
    # not set: zero_optimization.compute_grad_norm=false (no fp64 norm per gradient where
    # nothing clips) makes DeepSpeed refuse every ZeRO-1/2 checkpoint saved with its default
    # clip of 1.0, i.e. all of them before issue 36; the recipes run stage 0, where it is moot
    if offload:
        # ZeRO-Offload asks for DeepSpeedCPUAdam by default; torch's fused CPU Adam/AdamW
        # keeps our per-group lr and needs no JIT build
        ds.setdefault("zero_force_ds_cpu_optimizer", False)
    if precision == "bf16":
        bf16 = ds["bf16"] = {**ds.get("bf16", {}), "enabled": True}
        if guarded:
            # bf16 has fp32's range: a non-finite gradient almost always comes with a
            # non-finite loss, which mpp's check stops on every rank before the backward.
            # DeepSpeed's own check, 7 ops per gradient and a host sync (runtime/utils.py
            # has_inf_or_nan), would also skip the rare step whose loss is finite and whose
            # gradients are not (a sqrt at 0): set it true to have that too
            bf16.setdefault("check_grad_overflow", False)
        ds.update({k: v for k, v in bf16_reduction_dtypes(stage).items() if k not in ds})
    elif precision == "bf16-autocast":
        autocast = {**ds.get("torch_autocast", {}), "enabled": True, "dtype": "bfloat16"}
        if stage > 0:
            # DeepSpeed reduces the gradients of its "lower precision safe" modules (Linear,
            # Conv) in bf16 at ZeRO 1-3; none listed: every gradient reduced in fp32, as above
            autocast.setdefault("lower_precision_safe_modules", [])
        ds["torch_autocast"] = autocast
    elif precision == "fp16":
        ds["fp16"] = {**ds.get("fp16", {}), "enabled": True}
    return ds


def bf16_reduction_dtypes(stage: int) -> dict[str, Any]:
    """fp32 gradient reduction under bf16, and fp32 accumulation at stages 2/3, where DeepSpeed
    0.19.8 allows it (docs/ARCHITECTURE.md §5.1: why not at stages 0/1)."""
    dtypes: dict[str, Any] = {"communication_data_type": "fp32"}
    if stage >= 2:
        dtypes["data_types"] = {"grad_accum_dtype": "fp32"}
    return dtypes


# the keys mpp's own configs set: a section of only these needs no DeepSpeed import to check
PLAIN = {"zero_optimization": {"stage"}}
# DeepSpeed's typed sections, by the title their ValidationError carries
SECTIONS = {
    "DeepSpeedZeroConfig": ["zero_optimization"],
    "DeepSpeedBF16Config": ["bf16"],
    "DeepSpeedFP16Config": ["fp16"],
    "HybridEngineConfig": ["hybrid_engine"],
    "TPTrainingConfig": ["tensor_parallel"],
}


def refusal_of(user: dict[str, Any], full: Callable[[], dict[str, Any]]) -> str | None:
    """Why a key of the ``deepspeed`` section (``user``) would be refused or ignored, from
    DeepSpeed's own parser run on the whole config mpp would give it (``full()``), before anything
    starts: a key its typed sections do not have (``zero_optimization.stgae``), or a top-level key
    it never asks for (``zero_optimisation``, with the key it is close to). None: no objection;
    an error of another kind is left to DeepSpeed where the engine starts."""
    if all(k in PLAIN and set(v or {}) <= PLAIN[k] for k, v in user.items()):
        return None
    import difflib
    from collections.abc import KeysView

    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    read: set[str] = set()

    class Recorded(dict):  # the top-level keys the parser asks for, however it asks
        def get(self, key, *default):
            read.add(key)
            return super().get(key, *default)

        def __getitem__(self, key):
            read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            read.add(key)
            return super().__contains__(key)

        def keys(self):
            return KeysView(self)  # `key in d.keys()` asks __contains__ too

    try:
        DeepSpeedConfig(Recorded(full()))
    except ValidationError as e:  # a whole-section check has no location: the section alone
        err = e.errors()[0]
        key = ".".join(["deepspeed", *SECTIONS.get(e.title, []), *map(str, err["loc"])])
        return f"{key}: {err['msg']} (DeepSpeed's {e.title})"
    except Exception:  # noqa: BLE001  anything else is DeepSpeed's to say where it starts
        return None
    for key in sorted(set(user) - read):
        close = difflib.get_close_matches(key, sorted(read), n=1, cutoff=0.8)
        hint = f"; did you mean {close[0]}?" if close else ""
        return (
            f"deepspeed.{key}: not a key DeepSpeed reads{hint} (DeepSpeed {deepspeed.__version__})"
        )
    return None
