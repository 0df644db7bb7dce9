"""The one checkpoint format: DeepSpeed checkpoints under ``RUN/checkpoints/step########``,
each made complete by a ``COMPLETE`` marker written last, and their fp32 weights read back
(``zero_to_fp32``, ``full_state_dict``; the exported ``encoder.safetensors`` is
``mpp.hub.encoder_file``'s).

A kill during a save leaves a tag directory without its marker: ``latest_complete`` skips
it, so ``--resume auto`` always resumes from a checkpoint that was written whole, and the run
that goes on removes it (``remove_incomplete``). The marker
lists every file's size and sha256 (``mpp.checkpoint.storage``): a checkpoint damaged after it was written
is found before it is loaded, and ``--resume auto`` falls back to the newest intact one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from mpp.checkpoint import storage
from mpp.checkpoint.storage import CheckpointError, DiskFullError
from mpp.parallel.distributed import from_rank0
from mpp.quiet import hushed_prints

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
TAG_PREFIX = "step"
# an objective's per-rank state (Objective.rank_state)
RANK_STATE = "rank_state_{rank:05d}.safetensors"


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step:08d}"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def complete_tags(ckpt_root: str | Path) -> list[str]:
    """Tags with a completion marker, oldest first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    tags = [
        p.name
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(TAG_PREFIX) and (p / MARKER).is_file()
    ]
    return sorted(tags)


def latest_complete(ckpt_root: str | Path) -> str | None:
    tags = complete_tags(ckpt_root)
    return tags[-1] if tags else None


def remove_incomplete(ckpt_root: str | Path) -> list[str]:
    """Rank 0, when a run starts, before any rank saves: remove the tag folders that saves cut
    off before their marker left (``latest_complete`` skips them, rotation keeps only complete
    ones, so they would stay for good); DeepSpeed's ``latest``, when it names one of them, then
    names the newest complete tag (or goes: there is none). Complete tags, damaged or not, and
    the elastic conversions (``universal/``) are left alone. Returns the removed tags."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    removed = []
    for p in sorted(root.iterdir()):
        tag = p.name
        if not (tag.startswith(TAG_PREFIX) and tag[len(TAG_PREFIX) :].isdigit()):
            continue
        if p.is_symlink() or not p.is_dir() or (p / MARKER).is_file():
            continue
        try:
            shutil.rmtree(p)
        except OSError as e:
            log.warning("cannot remove the incomplete checkpoint %s: %s", p, e)
            continue
        removed.append(tag)
    latest = root / "latest"
    if removed and latest.is_file() and latest.read_text().strip() in removed:
        if newest := latest_complete(root):
            _write_atomic(latest, newest)  # as DeepSpeed writes it: the tag alone
        else:
            latest.unlink()
    return removed


def verify(ckpt_root: str | Path, tag: str) -> str | None:
    """Why ``ckpt_root/tag`` is not what its marker recorded, or None (also for markers from before
    the manifest, which cannot be checked)."""
    return storage.damage(Path(ckpt_root) / tag, saved_layout(ckpt_root, tag).get("files"))


def layout(engine: Any) -> dict:
    """How the run that writes a checkpoint splits its global batch (the COMPLETE marker keeps it)."""
    return {
        "world_size": dist.get_world_size(),
        "micro_batch": engine.train_micro_batch_size_per_gpu(),
        "grad_accum": engine.gradient_accumulation_steps(),
        "batch_size": engine.train_batch_size(),
        "zero_stage": int(engine.zero_optimization_stage()),
        "precision": engine_precision(engine),
    }


def engine_precision(engine: Any) -> str:
    """The ``train.precision`` an engine runs (what a resume must keep: the weights' dtype and
    the optimizer's states differ between them)."""
    if engine.bfloat16_enabled():
        return "bf16"
    if engine.fp16_enabled():
        return "fp16"
    return "bf16-autocast" if engine.torch_autocast_enabled() else "fp32"


def saved_layout(ckpt_root: str | Path, tag: str) -> dict:
    """The marker's record: step, and (checkpoints since elastic resume) ``layout``'s keys."""
    try:
        return json.loads((Path(ckpt_root) / tag / MARKER).read_text())
    except (OSError, ValueError):
        return {}


def written_by(ckpt_root: str | Path) -> tuple[dict, dict]:
    """What the run that wrote the checkpoints in ``ckpt_root`` (its ``RUN/checkpoints``) recorded
    beside them, read without touching a checkpoint: its config.json and its model.json (the
    encoder it built), {} for each it lacks."""
    from mpp.hub.encoder_file import MODEL_FILE

    run_dir = Path(ckpt_root).parent
    records = []
    for name in ("config.json", MODEL_FILE):
        try:
            records.append(json.loads((run_dir / name).read_text()))
        except (OSError, ValueError):
            records.append({})
    return records[0], records[1]


def save_checkpoint(
    engine: Any,
    ckpt_root: str | Path,
    step: int,
    client_state: dict,
    keep_last: int,
    rank_state: dict[str, torch.Tensor] | None = None,
) -> str:
    """Save on every rank (DeepSpeed requires it), then mark complete and prune on rank 0.
    ``rank_state`` (the objective's, may be empty) goes to the tag's rank_state_RANK.safetensors.
    The marker records the step, the batch layout (``layout``, read by an elastic resume) and
    every file's size and sha256. No room for it: ``DiskFullError`` before anything is written,
    or, when the disk fills during the save, after its partial files are removed."""
    root, tag = Path(ckpt_root), tag_for(step)
    size, problem = from_rank0(room(engine, root, keep_last, tag) if dist.get_rank() == 0 else None)
    if problem:
        raise DiskFullError(problem)
    try:
        engine.save_checkpoint(str(root), tag=tag, client_state=client_state)
        if rank_state:
            tensors = {k: v.detach().cpu().contiguous() for k, v in rank_state.items()}
            save_file(tensors, str(root / tag / RANK_STATE.format(rank=dist.get_rank())))
    except (OSError, RuntimeError) as e:
        if not storage.is_disk_full(e, root, size):
            raise
        # the other ranks stop too: the launcher ends the job
        raise DiskFullError(storage.filled_up(root, tag, size, latest_complete(root))) from None
    dist.barrier()  # every rank's shard is on disk before the marker says so
    files = storage.manifest(root / tag)  # hashed by every rank, a share each
    problem = (
        _mark_complete(engine, root, tag, step, files, keep_last) if dist.get_rank() == 0 else None
    )
    problem = from_rank0(problem)  # every rank learns it (and waits for the marker)
    if problem:
        # rank 0's kind
        raise (DiskFullError if "filled up" in problem else CheckpointError)(problem)
    return tag


def _mark_complete(
    engine: Any, root: Path, tag: str, step: int, files: dict, keep_last: int
) -> str | None:
    """Rank 0: the COMPLETE marker once every rank's files are seen and read back, then the prune."""
    problem = missing_rank_files(
        root / tag, dist.get_world_size(), engine.zero_optimization_stage()
    )
    problem = problem or next(
        (f"{root / tag / n}: {r['error']}" for n, r in files.items() if "error" in r), None
    )
    if problem:
        return problem
    try:
        _write_atomic(
            root / tag / MARKER, json.dumps({"step": step, **layout(engine), "files": files}) + "\n"
        )
    except OSError:
        return storage.filled_up(root, tag, storage.checkpoint_bytes(files), latest_complete(root))
    for old in complete_tags(root)[:-keep_last]:
        shutil.rmtree(root / old, ignore_errors=True)
    return None


def room(engine: Any, root: Path, keep_last: int, tag: str | None = None) -> tuple[int, str | None]:
    """Rank 0, before a save (``tag``) or at the start: (a checkpoint's size, the line a save that
    cannot fit stops with). The size is the newest complete checkpoint's, else an estimate from the
    model; a warning when fewer than ``keep_last + 1`` fit."""
    tags = complete_tags(root)
    recorded = [saved_layout(root, t).get("files") for t in tags]
    size = (
        storage.checkpoint_bytes(recorded[-1])
        if recorded and recorded[-1]
        else storage.estimate_bytes(engine.module)
    )
    storage.warn_room(root, size, sum(storage.checkpoint_bytes(r) for r in recorded), keep_last)
    return size, storage.no_room(root, tag, size, tags[-1] if tags else None) if tag else None


def missing_rank_files(tag_dir: Path, world_size: int, stage: int) -> str | None:
    """Why rank 0 cannot vouch for the checkpoint in ``tag_dir``, or None. Under ZeRO every rank
    writes its own optimiser shard; rank 0 must see all of them before it writes the marker."""
    if stage == 0:
        return None  # rank 0 writes the whole checkpoint itself
    seen = {p.name for p in tag_dir.glob("*optim_states.pt")}
    missing = [
        r for r in range(world_size) if not any(f"zero_pp_rank_{r}_" in name for name in seen)
    ]
    if not missing:
        return None
    return (
        f"checkpoint {tag_dir}: rank 0 sees no optimiser shard of rank(s) {missing[:8]} (of {world_size}); "
        f"the output directory must be on storage every node shares (not node-local disk)"
    )


def load_rank_state(ckpt_root: str | Path, tag: str) -> dict[str, torch.Tensor]:
    """This rank's saved ``rank_state``, else rank 0's (state every rank shares is saved once), else {}."""
    for rank in (dist.get_rank(), 0):
        path = Path(ckpt_root) / tag / RANK_STATE.format(rank=rank)
        if path.is_file():
            return load_file(str(path))
    return {}


def find_checkpoint(
    path: str | Path, complete_only: bool = False
) -> tuple[Path, str | None] | None:
    """The one path resolver: (checkpoint root, tag) for a tag folder, a checkpoint root (its
    newest complete tag, else the tag DeepSpeed's ``latest`` names: None here) or a run
    directory (its ``checkpoints/``); None when ``path`` is none of these. ``complete_only``:
    only tags with the COMPLETE marker count (resuming)."""
    path = Path(path)
    if (path / MARKER).is_file() or (not complete_only and any(path.glob("*model_states.pt"))):
        return path.parent, path.name
    for root in (path, path / "checkpoints"):
        if tag := latest_complete(root):
            return root, tag
        if not complete_only and (root / "latest").is_file():
            return root, None
    return None


def resolve_resume(
    resume: str | None, ckpt_root: str | Path, verified: bool = True
) -> tuple[str, str] | None:
    """The run to resume from, the one answer (the engine's resume and rollback ask it verified,
    on rank 0: ``mpp.checkpoint.manager.resolve_on_rank0``; the checks before a run do not:
    ``mpp.train.plan``). ``auto`` -> the newest complete tag in ``ckpt_root`` (None on a fresh
    run); a path -> that checkpoint, or its newest complete one (``find_checkpoint``).
    ``verified``: only an intact one (its files checked against its marker; a warning names each
    damaged newer one), CheckpointError naming the file otherwise."""
    if resume is None:
        return None
    root = ckpt_root
    if resume != "auto":
        found = find_checkpoint(resume, complete_only=True)
        if found is None:
            raise FileNotFoundError(f"--resume {resume}: no complete checkpoint there")
        if (Path(resume) / MARKER).is_file():  # this very checkpoint was asked for
            if verified and (problem := verify(*found)):
                raise CheckpointError(f"--resume {resume}: {problem}")
            return str(found[0]), found[1]
        root = found[0]
    damaged = []
    for tag in reversed(complete_tags(root)):
        if not verified or (problem := verify(root, tag)) is None:
            if damaged:
                log.warning(
                    "checkpoint %s is damaged (%s): using %s", damaged[0][0], damaged[0][1], tag
                )
            return str(root), tag
        damaged.append((tag, problem))
    if damaged:
        raise CheckpointError(
            f"no intact checkpoint in {root}: {damaged[0][1]}"
            + (f" (and {len(damaged) - 1} older damaged)" if len(damaged) > 1 else "")
        )
    return None


# ---- reading checkpoints without unpickling arbitrary objects ---------------------------------


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """DeepSpeed's readers (``load_checkpoint``, zero-to-fp32) call ``torch.load(weights_only=False)``.
    Inside this context every ``torch.load`` runs with ``weights_only=True`` and only DeepSpeed's
    own checkpoint classes allow-listed, so a pickled payload in a checkpoint is refused."""
    # the classes DeepSpeed pickles into its own checkpoint files (found by loading ZeRO-0..3
    # checkpoints with weights_only=True); nothing else may be constructed on load
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    original = torch.load

    def safe_load(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        return original(*args, **kwargs)

    allowed = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
    with torch.serialization.safe_globals(allowed):
        torch.load = safe_load
        try:
            yield
        finally:
            torch.load = original


def zero_to_fp32(ckpt_root: str | Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The fp32 weights of a DeepSpeed checkpoint of any ZeRO stage, read safely.

    Stage 1-3 through DeepSpeed's zero-to-fp32 (the fp32 master weights). A stage-0 checkpoint
    has no ZeRO files and no parameter names for its master weights: its module weights,
    upcast (exact for fp32 runs; bf16/fp16 runs export their exact masters at the end of
    training instead, see ``full_state_dict``)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root = Path(ckpt_root)
    tag = tag or (root / "latest").read_text().strip()
    if problem := verify(root, tag):
        raise CheckpointError(f"{problem}: the checkpoint cannot be read")
    with weights_only_loads():
        if any((root / tag).glob("*optim_states.pt")):
            with hushed_prints():  # its dozen "Processing zero checkpoint ..." lines
                return get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
        module = torch.load(
            root / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True
        )["module"]
    return {k: v.float() for k, v in module.items()}


# ---- the fp32 weights of a run ---------------------------------------------------------------


def full_state_dict(
    engine: Any, ckpt_root: str | Path | None = None, tag: str | None = None
) -> dict[str, torch.Tensor] | None:
    """The model's fp32 weights on rank 0 (None elsewhere).

    ZeRO runs keep their fp32 master weights partitioned in the optimiser: read them through
    DeepSpeed's zero-to-fp32 converter from the checkpoint just written. Stage 0 holds them
    in memory: the module (fp32) or the bf16/fp16 optimiser's flat master copy.
    """
    stage = engine.zero_optimization_stage()
    if stage == 0:  # every rank holds everything; rank 0 reads it from memory
        return _stage0_state_dict(engine) if dist.get_rank() == 0 else None
    dist.barrier()
    sd = None
    if dist.get_rank() == 0:
        sd = zero_to_fp32(ckpt_root, tag)
        # frozen buffers/params the converter leaves out (e.g. sin-cos tables) come from the module
        for k, v in engine.module.state_dict().items():
            if k not in sd and v.numel() > 0:
                sd[k] = v.detach().float().cpu().clone()
    dist.barrier()
    return sd


def _stage0_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """fp32 weights of a stage-0 engine: the module's, with each trained parameter replaced by
    its fp32 master copy when DeepSpeed's bf16/fp16 optimiser keeps one (flat, per group)."""
    from torch._utils import _unflatten_dense_tensors

    module, opt = engine.module, engine.optimizer
    sd = {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}
    if next(module.parameters()).dtype != torch.float32:
        names = {id(p): n for n, p in module.named_parameters()}
        if hasattr(opt, "fp32_groups_flat"):  # FP16_Optimizer: one flat fp32 copy per group
            masters = [
                _unflatten_dense_tensors(f, ps)
                for f, ps in zip(opt.fp32_groups_flat, opt.fp16_groups, strict=True)
            ]
        else:  # FP16_UnfusedOptimizer (a torch optimiser): one fp32 copy per parameter
            masters = opt.fp32_groups
        for params, copies in zip(opt.fp16_groups, masters, strict=True):
            for p, master in zip(params, copies, strict=True):
                sd[names[id(p)]] = master.detach().float().cpu().clone()
    return sd


# ---- weights for evaluation snapshots -------------------------------------------------------


def gathered_state_dict(engine: Any) -> dict[str, torch.Tensor] | None:
    """The module's weights in fp32 on rank 0 (None elsewhere), gathering ZeRO-3 shards on the
    fly; every rank must call it. For evaluation snapshots ("best"), not for exact resumes."""
    import deepspeed

    module = engine.module
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        if dist.get_rank() != 0:
            return None
        return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}
