"""Masking ablations (docs/ARCHITECTURE.md §4.5): a grid of ``--set`` overrides on a base pretraining
config, a few seeds per cell, each cell a real pretraining run through the ``deepspeed``
launcher followed by the chosen evaluations, summarised as a table and a plot. The spec's
``set`` overrides (``--set KEY=VALUE``) apply to every cell, before the cell's own grid values
(so a grid axis wins for the same key), and are validated with each cell.

Layout under the output folder (``output_dir``, alias ``out``), one folder per cell and seed,
named from its grid overrides only (the shared ``set`` ones are not in the names)::

    masking.strategy=block,objective.mask_ratio=0.5/seed0/
        pretrain/   finetune/   linear/   knn/     the runs (each eval writes results.json)
        pretrain.log  knn.log ...                  each launch's stdout + stderr
    baseline=scratch_own/seed0/finetune/         fine-tuning from scratch, its own schedule
    baseline=scratch_same/seed0/finetune/        ... and the pretrained cells' schedule
    ablation.json  jobs.json                     the resolved spec; --submit's job ids
    results.csv  results.md  results.png

With fine-tuning among the evaluations, two baselines per seed (``baselines``): the base
architecture fine-tuned from scratch on its own recipe (``scratch_config``: longer, timm's head
init) -- the fair comparison -- and on the pretrained cells' recipe (``finetune_config``), which
under-trains scratch and overstates pretraining's gain; results.md labels which is which.

A finished cell+seed is skipped on a rerun, a half-done pretraining run resumes from its last
checkpoint, and a failed run is recorded and does not stop the others. A preempted run (exit 75,
``mpp.train.preemption``), or SIGTERM / SIGUSR1 to the runner itself, stops the whole ablation
with exit 75: the same command continues it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import shlex
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from mpp.checkpoint.format import latest_complete
from mpp.config import (
    ConfigError,
    FinetuneConfig,
    ProbeConfig,
    load_config,
    resolve_config_path,
    validate,
)
from mpp.parallel.launch import deepspeed_cmd, default_launcher_args, launch
from mpp.train.preemption import PREEMPTED_EXIT, SIGNALS

# each job's command (python -m, or deepspeed --module)
SCRIPTS = {
    "pretrain": "mpp.commands.pretrain",
    "finetune": "mpp.commands.finetune",
    "linear": "mpp.commands.probe",
    "knn": "mpp.commands.knn",
}
EvalKind = Literal["finetune", "linear", "knn"]
# Model keys an evaluation keeps from its own config: how it runs and regularises, not the
# architecture the pretrained weights need (fine-tuning's drop path 0.1, docs/ARCHITECTURE.md §4.6).
SPEC_FILE = "ablation.json"  # the resolved spec, in the output folder
EVAL_OWN_MODEL_KEYS = {"attn_backend", "drop_path_rate", "init", "grad_checkpointing", "compile"}


class AblationSpec(BaseModel):
    """What ``--spec ablation.json`` holds (or the same from command-line flags)."""

    model_config = ConfigDict(extra="forbid")
    base: str  # the pretraining config: a path or a name in configs/
    grid: dict[str, list[Any]] = Field(default_factory=dict)  # dotted key -> values (JSON)
    # key -> a name per value, for the folders and tables (a whole section's default: its name)
    grid_names: dict[str, list[str]] = Field(default_factory=dict)
    # "KEY=VALUE" for every cell's pretraining, as the training CLIs' --set; the grid wins
    set: list[str] = Field(default_factory=list)
    seeds: int | list[int] = 1  # n: seeds 0..n-1
    eval: list[EvalKind] = ["finetune", "linear", "knn"]
    launcher_args: list[str] | None = None  # None: --num_gpus <GPU count>, or 2 CPU ranks
    finetune_config: str = "finetune_demo"
    probe_config: str = "linear_demo"  # linear probe and k-NN
    # fine-tuning from scratch, run when "finetune" is in eval (see BASELINES)
    baselines: list[Literal["scratch_own", "scratch_same"]] = ["scratch_own", "scratch_same"]
    scratch_config: str = "finetune_scratch_demo"  # scratch's own recipe (its epochs, head init)
    # few labels: every evaluation (and baseline) also runs with K labelled images per class
    # (data.labels_per_class=K, a subset per seed: data.label_seed=the seed), named "knn@K";
    # fine-tuning then on the few-label recipes (a schedule counted in steps)
    few_labels: int | None = Field(None, gt=0)
    few_finetune_config: str = "finetune_few_demo"
    few_scratch_config: str = "finetune_scratch_few_demo"
    # the report's title, and where to copy results.md and results.png (e.g. RESULTS.md)
    title: str | None = None
    publish_markdown: str | None = None
    publish_plot: str | None = None
    # default runs/ablation-<base name>; "out" is the older name of the key
    output_dir: str | None = Field(default=None, validation_alias=AliasChoices("output_dir", "out"))

    @model_validator(mode="after")
    def _check(self) -> AblationSpec:
        for key, values in self.grid.items():
            if not values:
                raise ValueError(f"grid.{key}: no values")
            whole = "." not in key and all(isinstance(v, dict) for v in values)
            if "=" in key or ("." not in key and not whole):
                raise ValueError(
                    f"grid key {key!r}: expected section.key (masking.strategy), or a section "
                    "whose values are whole sections (objective: [{...}, {...}])"
                )
        for key, names in self.grid_names.items():
            if len(names) != len(self.grid.get(key, [])) or len(set(names)) != len(names):
                raise ValueError(f"grid_names.{key}: one distinct name per value of grid.{key}")
        for item in self.set:
            if "=" not in item or not item.split("=", 1)[0].strip():
                raise ValueError(f"set: expected KEY=VALUE, got {item!r}")
        if isinstance(self.seeds, int) and self.seeds < 1 or self.seeds == []:
            raise ValueError(
                f"seeds must be >= 1 (or a non-empty list of seeds), got {self.seeds!r}"
            )
        if not self.eval or len(set(self.eval)) != len(self.eval):
            raise ValueError(
                f"eval: expected one or more of finetune, linear, knn, each once; got {self.eval}"
            )
        if len(set(self.baselines)) != len(self.baselines):
            raise ValueError(
                f"baselines: each of scratch_own, scratch_same once; got {self.baselines}"
            )
        return self

    @property
    def baseline_names(self) -> list[str]:
        """The baselines that run: fine-tuning's, so none without it."""
        return list(self.baselines) if "finetune" in self.eval else []

    @property
    def evaluations(self) -> list[str]:
        """Every pretrained cell's evaluations: ``eval``, then each at few labels (``knn@10``)."""
        few = [f"{kind}@{self.few_labels}" for kind in self.eval] if self.few_labels else []
        return [*self.eval, *few]

    @property
    def baseline_evaluations(self) -> list[str]:
        """A baseline's: fine-tuning, and at few labels."""
        return ["finetune", *([f"finetune@{self.few_labels}"] if self.few_labels else [])]

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.seeds)) if isinstance(self.seeds, int) else list(self.seeds)

    @property
    def out_dir(self) -> Path:
        return Path(self.output_dir or f"runs/ablation-{Path(self.base).stem}")

    @property
    def launcher(self) -> list[str]:
        """The deepspeed launcher's arguments: ``launcher_args``, else the machine's default."""
        return self.launcher_args if self.launcher_args is not None else default_launcher_args()


def load_spec(path: str | None, cli: dict[str, Any]) -> AblationSpec:
    """The spec file (if any) with the command line's values on top; ConfigError names the key."""
    raw: dict[str, Any] = {}
    source = "<command line>"
    if path:
        source = path
        try:
            raw = json.loads(resolve_config_path(path).read_text())
        except ConfigError:
            raise ConfigError(f"{path}: spec file not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object at the top level")
    if "out" in raw and "output_dir" in raw:
        raise ConfigError(f"{source}: out: the older name of output_dir; set one of them")
    cli = {k: v for k, v in cli.items() if v is not None}
    if {"output_dir", "out"} & cli.keys():  # the command line's replaces the file's, by either name
        raw.pop("out", None)
        raw.pop("output_dir", None)
    raw.update(cli)
    if isinstance(raw.get("launcher_args"), str):
        raw["launcher_args"] = shlex.split(raw["launcher_args"])
    if "base" not in raw:
        raise ConfigError(
            f'{source}: base: the pretraining config is not set (--base or "base" in the spec)'
        )
    return validate(raw, source, AblationSpec)


# ---- the plan: cells x seeds ---------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One point of the grid: ((key, value as written after ``--set key=``), ...), and the
    names the tables give the values (the spec's ``grid_names``; else the value itself)."""

    values: tuple[tuple[str, str], ...]
    names: tuple[str | None, ...] = ()

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.values]

    @property
    def display(self) -> dict[str, str]:
        """Each grid value as the tables show it: its name, a whole section by its ``name``."""
        names = self.names or (None,) * len(self.values)
        return {k: n or _short(v) for (k, v), n in zip(self.values, names, strict=True)}

    @property
    def name(self) -> str:
        """The folder name: the values joined by commas (a section by its name); a hash of the
        overrides is added where characters had to go or a section was shortened."""
        name = ",".join(f"{k}={v}" for k, v in self.display.items()) or "base"
        full = ",".join(self.overrides) or "base"
        safe = re.sub(r"[^\w.=,+-]", "_", name)[:100]
        if safe == full:
            return safe
        return f"{safe}-{hashlib.sha1(full.encode()).hexdigest()[:8]}"


def _short(value: str) -> str:
    """A grid value as written after ``--set key=``; a whole section (JSON) by its name."""
    if value.startswith("{"):
        try:
            return str(json.loads(value).get("name", value))
        except (ValueError, AttributeError):
            return value
    return value


@dataclass(frozen=True)
class Job:
    cell: Cell
    seed: int
    dir: Path

    @property
    def label(self) -> str:
        return f"{self.cell.name}/seed{self.seed}"


# the baselines' labels in the tables, and the config each fine-tunes with
BASELINES = {
    "scratch_own": ("scratch, own schedule", "scratch_config"),
    "scratch_same": ("scratch, same schedule", "finetune_config"),
}


@dataclass(frozen=True)
class Baseline:
    """Fine-tuning the base architecture from scratch (one of BASELINES) with one seed."""

    name: str
    seed: int
    dir: Path

    @property
    def label(self) -> str:
        return f"baseline={self.name}/seed{self.seed}"


def plan_baselines(spec: AblationSpec) -> list[Baseline]:
    return [
        Baseline(n, s, spec.out_dir / f"baseline={n}" / f"seed{s}")
        for n in spec.baseline_names
        for s in spec.seed_list
    ]


def plan_cells(spec: AblationSpec) -> list[Cell]:
    """The grid's cells, first key varying slowest."""
    as_set = lambda v: v if isinstance(v, str) else json.dumps(v)  # noqa: E731  (what --set would read)
    axes = [
        [
            (key, as_set(v), (spec.grid_names.get(key) or [None] * len(values))[i])
            for i, v in enumerate(values)
        ]
        for key, values in spec.grid.items()
    ]
    return [
        Cell(tuple((k, v) for k, v, _ in combo), tuple(n for *_, n in combo))
        for combo in itertools.product(*axes)
    ]


def plan_jobs(spec: AblationSpec, cells: list[Cell]) -> list[Job]:
    return [Job(c, s, spec.out_dir / c.name / f"seed{s}") for c in cells for s in spec.seed_list]


def split_evaluation(name: str) -> tuple[str, int | None]:
    """``"knn@10"`` -> ("knn", 10); ``"knn"`` -> ("knn", None)."""
    kind, _, k = name.partition("@")
    return kind, int(k) if k else None


def eval_config(
    spec: AblationSpec, name: str, baseline: str | None = None
) -> tuple[str, type[BaseModel]]:
    """An evaluation's config and its type; a baseline's (``baseline``: its name) fine-tuning."""
    kind, few = split_evaluation(name)
    if baseline is not None:
        own = baseline == "scratch_own"
        if few:
            return (spec.few_scratch_config if own else spec.few_finetune_config), FinetuneConfig
        return getattr(spec, BASELINES[baseline][1]), FinetuneConfig
    if kind == "finetune":
        return (spec.few_finetune_config if few else spec.finetune_config), FinetuneConfig
    return spec.probe_config, ProbeConfig


def eval_overrides(name: str, model_sets: list[str], init: str | Path, seed: int) -> list[str]:
    """The pretrained weights, the pretraining's architecture and the seed, for one evaluation;
    at few labels the labelled subset too (one per seed: ``data.label_seed``)."""
    kind, few = split_evaluation(name)
    # the probes' config has no train section
    seed_key = "train.seed" if kind == "finetune" else "seed"
    labels = [f"data.labels_per_class={few}", f"data.label_seed={seed}"] if few else []
    return [f"init={json.dumps(str(init))}", *model_sets, f"{seed_key}={seed}", *labels]


def pretrain_overrides(spec: AblationSpec, cell: Cell, seed: int) -> list[str]:
    """A cell's pretraining overrides, in the order applied: the spec's ``set`` for every cell,
    the cell's grid values (which win for the same key), then the seed."""
    return [*spec.set, *cell.overrides, f"train.seed={seed}"]


def cli_args(config: str | Path, overrides: list[str], out: Path) -> list[str]:
    """A training command's ``--config C --set O ... --output-dir D``."""
    sets = [a for o in overrides for a in ("--set", o)]
    return ["--config", str(config), *sets, "--output-dir", str(out)]


def pretrain_args(spec: AblationSpec, job: Job) -> list[str]:
    """The arguments of one job's ``pretrain/run.py`` (after the launcher's)."""
    overrides = pretrain_overrides(spec, job.cell, job.seed)
    return [*cli_args(spec.base, overrides, job.dir / "pretrain"), "--resume", "auto"]


def check_cells(spec: AblationSpec, cells: list[Cell]) -> dict[Cell | None, list[str]]:
    """Validate every cell in-process, before any launch: its config (the spec's ``set`` and the
    cell's grid values), its objective (mask strategy, ratio, unit size) and its evaluations'
    configs with its model. Returns each cell's ``model.*`` overrides for the evaluations (from
    the resolved config, so ``set`` model keys are in them), and under None the base's (with
    ``set``, no grid value) for the baselines; ConfigError lists every bad cell."""
    from mpp.build import build_objective

    model_sets, bad = {}, []
    seed = spec.seed_list[0]
    for cell in [*cells, None]:
        # the baselines' after good cells only
        if cell is None and (bad or not spec.baseline_names):
            break
        try:
            cfg = load_config(spec.base, pretrain_overrides(spec, cell or Cell(()), seed))
            if cell is not None:
                build_objective(cfg)
            # in_chans: an evaluation whose data hold other channels is refused here, not later
            model = {
                **cfg.model.model_dump(mode="json"),
                "in_chans": cfg.model.in_chans or cfg.data.channels,
            }
            sets = [
                f"model.{k}={json.dumps(v)}"
                for k, v in model.items()
                if k not in EVAL_OWN_MODEL_KEYS
            ]
            if cell is not None:
                todo = [(name, None) for name in spec.evaluations]
            else:
                todo = [(n, b) for b in spec.baseline_names for n in spec.baseline_evaluations]
            for name, baseline in todo:
                path, cls = eval_config(spec, name, baseline)
                load_config(path, eval_overrides(name, sets, "scratch", seed), cls=cls)
            model_sets[cell] = sets
        except ConfigError as e:
            bad.append(f"  {cell.name if cell is not None else 'the baselines'}: {e}")
    if bad:
        head = f"{len(bad)} of {len(cells)} cells have a bad config; nothing was run:"
        if spec.set:
            bad.append(
                f"  (every cell's config has --set {shlex.join(spec.set)} before its grid values)"
            )
        raise ConfigError("\n".join([head, *bad]))
    return model_sets


# ---- running -------------------------------------------------------------------------------


def is_done(kind: str, run_dir: Path) -> bool:
    """Pretraining and fine-tuning export encoder.safetensors at the very end (fine-tuning
    rewrites results.json every epoch, so that alone would not do); a probe writes
    results.json last."""
    kind = split_evaluation(kind)[0]
    final = "encoder.safetensors" if kind in ("pretrain", "finetune") else "results.json"
    return (run_dir / final).is_file() and (
        kind == "pretrain" or (run_dir / "results.json").is_file()
    )


class AblationStopped(Exception):
    """A run was preempted, or the runner got SIGTERM / SIGUSR1: nothing more is launched."""


_stop_signal: list[int] = []  # set by the runner's handler


def _run(cmd: list[str], log: Path, what: str) -> int:
    """``launch`` one job; AblationStopped when it was preempted or a stop signal came."""
    if _stop_signal:
        raise AblationStopped(f"{signal.Signals(_stop_signal[0]).name} received before {what}")
    code = launch(cmd, log)
    if code == PREEMPTED_EXIT or _stop_signal:
        raise AblationStopped(f"{what} was preempted (exit {code}), log: {log}")
    return code


def run_job(
    spec: AblationSpec, job: Job, model_overrides: list[str], launcher_args: list[str], tag: str
) -> list[dict]:
    """Pretrain (or resume), then each evaluation not yet done; one row per evaluation."""
    if is_complete(spec, job):
        print(f"{tag} {job.label}: skip (complete)", flush=True)
        return [
            result_row(job, kind, "ok", job.dir / kind / "results.json")
            for kind in spec.evaluations
        ]
    pre = job.dir / "pretrain"
    if not is_done("pretrain", pre):
        resume_from = latest_complete(pre / "checkpoints")
        print(
            f"{tag} {job.label}: pretrain{f' (resume from {resume_from})' if resume_from else ''}",
            flush=True,
        )
        cmd = deepspeed_cmd(launcher_args, SCRIPTS["pretrain"], pretrain_args(spec, job))
        code = _run(cmd, job.dir / "pretrain.log", f"{job.label}: pretrain")
        if code:
            print(
                f"{tag} {job.label}: pretrain FAILED (exit {code}), log: {job.dir / 'pretrain.log'}",
                flush=True,
            )
            return [
                result_row(job, kind, "failed", job.dir / "pretrain.log")
                for kind in spec.evaluations
            ]
    return evaluate(spec, job, model_overrides, launcher_args, tag)


def evaluate(
    spec: AblationSpec,
    job: Job | Baseline,
    model_overrides: list[str],
    launcher_args: list[str],
    tag: str,
) -> list[dict]:
    """Each evaluation of a pretrained job (or a baseline's fine-tuning) not yet done; a row each."""
    rows = []
    init = job.dir / "pretrain" if isinstance(job, Job) else "scratch"
    for kind in evaluations(spec, job):
        out, log = job.dir / kind, job.dir / f"{kind}.log"
        if not is_done(kind, out):
            path, _ = eval_config(spec, kind, None if isinstance(job, Job) else job.name)
            args = cli_args(path, eval_overrides(kind, model_overrides, init, job.seed), out)
            script = SCRIPTS[split_evaluation(kind)[0]]
            if script == SCRIPTS["finetune"]:
                cmd = deepspeed_cmd(launcher_args, script, [*args, "--resume", "auto"])
            else:  # the probes run in one process on cached features
                cmd = [sys.executable, "-m", script, *args]
            code = _run(cmd, log, f"{job.label}: {kind}")
            if code:
                print(f"{tag} {job.label}: {kind} FAILED (exit {code}), log: {log}", flush=True)
                rows.append(result_row(job, kind, "failed", log))
                continue
        row = result_row(job, kind, "ok", out / "results.json")
        print(f"{tag} {job.label}: {kind} top1 {row['top1']:.2f}", flush=True)
        rows.append(row)
    return rows


def result_row(job: Job | Baseline, kind: str, status: str, path: Path) -> dict:
    """One row of results.csv: the cell's grid values (a baseline's: its name), seed, eval, top-1/5."""
    res = json.loads(path.read_text()) if status == "ok" else {}
    where = job.cell.display if isinstance(job, Job) else {"baseline": job.name}
    return {
        **where,
        "seed": job.seed,
        "eval": kind,
        "top1": res.get("top1"),
        "top5": res.get("top5"),
        "max_top1": res.get("max_top1"),
        "status": status,
        "path": str(path),
    }


def evaluations(spec: AblationSpec, item: Job | Baseline) -> list[str]:
    """What a pretrained cell (every evaluation) or a baseline (its fine-tuning) runs."""
    return spec.evaluations if isinstance(item, Job) else spec.baseline_evaluations


def is_complete(spec: AblationSpec, item: Job | Baseline) -> bool:
    return all(is_done(kind, item.dir / kind) for kind in evaluations(spec, item))


def resolved(spec: AblationSpec) -> AblationSpec:
    """The spec with its configs as absolute paths (the runs start in the repository root)."""
    needed = [
        "base",
        *{"finetune_config" if kind == "finetune" else "probe_config" for kind in spec.eval},
    ]
    needed += [BASELINES[name][1] for name in spec.baseline_names]
    if spec.few_labels:
        needed += ["few_finetune_config"] * ("finetune" in spec.eval)
        needed += ["few_scratch_config"] * ("scratch_own" in spec.baseline_names)
    return spec.model_copy(
        update={k: str(resolve_config_path(getattr(spec, k)).resolve()) for k in needed}
    )


def prepare(spec: AblationSpec) -> tuple[AblationSpec, list[Job], list[Baseline], dict]:
    """Resolve and validate (ConfigError before anything is created), then save the spec as
    ``ablation.json`` (what ``--status`` reads): (spec, jobs, baselines, model overrides)."""
    spec = resolved(spec)
    cells = plan_cells(spec)
    model_sets = check_cells(spec, cells)
    spec.out_dir.mkdir(parents=True, exist_ok=True)
    path, text = spec.out_dir / SPEC_FILE, spec.model_dump_json(indent=2) + "\n"
    if not path.is_file() or path.read_text() != text:  # a rerun rewrites nothing
        path.write_text(text)
    return spec, plan_jobs(spec, cells), plan_baselines(spec), model_sets


def run_ablation(spec: AblationSpec) -> tuple[list[dict], int]:
    """``prepare``, then every cell and baseline run on this machine; (rows, how many failed)."""
    spec, jobs, baselines, model_sets = prepare(spec)
    launcher_args = spec.launcher
    rows, n = [], len(jobs) + len(baselines)
    # the cluster's stop signal reaches every process of the job: the running cell checkpoints
    # and exits 75; the runner waits for it instead of dying, then stops (AblationStopped)
    previous = {
        s: signal.signal(s, lambda signum, frame: _stop_signal.append(signum)) for s in SIGNALS
    }
    try:
        for i, job in enumerate(jobs, 1):
            rows += run_job(spec, job, model_sets[job.cell], launcher_args, f"[{i}/{n}]")
        for i, base in enumerate(baselines, len(jobs) + 1):
            rows += evaluate(spec, base, model_sets[None], launcher_args, f"[{i}/{n}]")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return rows, sum(r["status"] != "ok" for r in rows)
