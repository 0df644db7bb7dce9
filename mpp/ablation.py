"""Masking ablations (DESIGN.md §4.5): a grid of ``--set`` overrides on a base pretraining
config, a few seeds per cell, each cell a real pretraining run through the ``deepspeed``
launcher followed by the chosen evaluations, summarised as a table and a plot.

Layout under the output folder, one folder per cell and seed, named from its overrides::

    masking.strategy=block,objective.mask_ratio=0.5/seed0/
        pretrain/   finetune/   linear/   knn/     the runs (each eval writes results.json)
        pretrain.log  knn.log ...                  each launch's stdout + stderr
    results.csv  results.md  results.png

Every cell is validated in-process (config + objective + the evaluations' configs) before
anything is launched. A finished cell+seed is skipped on a rerun, a half-done pretraining run
resumes from its last checkpoint, and a failed run is recorded and does not stop the others.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import re
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mpp.checkpoint import latest_complete
from mpp.config import (
    ConfigError,
    FinetuneConfig,
    ProbeConfig,
    load_config,
    resolve_config_path,
    validate,
)
from mpp.launch import REPO, deepspeed_cmd, default_launcher_args, launch

SCRIPTS = {
    "pretrain": "pretrain/run.py",
    "finetune": "downstream/finetune.py",
    "linear": "downstream/linear_probe.py",
    "knn": "downstream/knn.py",
}
EvalKind = Literal["finetune", "linear", "knn"]
# Model keys an evaluation keeps from its own config: how it runs and regularises, not the
# architecture the pretrained weights need (fine-tuning's drop path 0.1, DESIGN.md §4.6).
EVAL_OWN_MODEL_KEYS = {"attn_backend", "drop_path_rate"}


class AblationSpec(BaseModel):
    """What ``--spec ablation.json`` holds (or the same from command-line flags)."""

    model_config = ConfigDict(extra="forbid")
    base: str  # the pretraining config: a path or a name in configs/
    grid: dict[str, list[Any]] = Field(default_factory=dict)  # dotted key -> values (JSON)
    seeds: int | list[int] = 1  # n: seeds 0..n-1
    eval: list[EvalKind] = ["finetune", "linear", "knn"]
    launcher_args: list[str] | None = None  # None: --num_gpus <GPU count>, or 2 CPU ranks
    finetune_config: str = "finetune_demo"
    probe_config: str = "linear_demo"  # linear probe and k-NN
    out: str | None = None  # default runs/ablation-<base name>

    @model_validator(mode="after")
    def _check(self) -> AblationSpec:
        for key, values in self.grid.items():
            if "." not in key or "=" in key:
                raise ValueError(f"grid key {key!r}: expected section.key, e.g. masking.strategy")
            if not values:
                raise ValueError(f"grid.{key}: no values")
        if isinstance(self.seeds, int) and self.seeds < 1 or self.seeds == []:
            raise ValueError(f"seeds must be >= 1 (or a non-empty list of seeds), got {self.seeds!r}")
        if not self.eval or len(set(self.eval)) != len(self.eval):
            raise ValueError(f"eval: expected one or more of finetune, linear, knn, each once; got {self.eval}")
        return self

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.seeds)) if isinstance(self.seeds, int) else list(self.seeds)

    @property
    def out_dir(self) -> Path:
        return Path(self.out or f"runs/ablation-{Path(self.base).stem}")


def split_values(text: str) -> list[str]:
    """``random,block`` -> ["random", "block"]; commas inside [], {} or quotes stay (``[0.2,1.0],[0.5,1.0]``)."""
    values, depth, quote, current = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            values.append(current)
            current = ""
            continue
        current += ch
    return [*values, current]


def load_spec(path: str | None, cli: dict[str, Any]) -> AblationSpec:
    """The spec file (if any) with the command line's values on top; ConfigError names the key."""
    raw: dict[str, Any] = {}
    source = "<command line>"
    if path:
        source = path
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: spec file not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object at the top level")
    raw.update({k: v for k, v in cli.items() if v is not None})
    if isinstance(raw.get("launcher_args"), str):
        raw["launcher_args"] = shlex.split(raw["launcher_args"])
    if "base" not in raw:
        raise ConfigError(f"{source}: base: the pretraining config is not set (--base or \"base\" in the spec)")
    return validate(raw, source, AblationSpec)


# ---- the plan: cells x seeds ---------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One point of the grid: ((key, value as written after ``--set key=``), ...)."""

    values: tuple[tuple[str, str], ...]

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.values]

    @property
    def name(self) -> str:
        """The folder name: the overrides joined by commas; a hash is added where characters had to go."""
        name = ",".join(self.overrides) or "base"
        safe = re.sub(r"[^\w.=,+-]", "_", name)[:100]
        return safe if safe == name else f"{safe}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class Job:
    cell: Cell
    seed: int
    dir: Path

    @property
    def label(self) -> str:
        return f"{self.cell.name}/seed{self.seed}"


def plan_cells(spec: AblationSpec) -> list[Cell]:
    """The grid's cells, first key varying slowest."""
    as_set = lambda v: v if isinstance(v, str) else json.dumps(v)  # noqa: E731  (what --set would read)
    axes = [[(key, as_set(v)) for v in values] for key, values in spec.grid.items()]
    return [Cell(tuple(combo)) for combo in itertools.product(*axes)]


def plan_jobs(spec: AblationSpec, cells: list[Cell]) -> list[Job]:
    return [Job(c, s, spec.out_dir / c.name / f"seed{s}") for c in cells for s in spec.seed_list]


def eval_config(spec: AblationSpec, kind: str) -> tuple[str, type[BaseModel]]:
    return (spec.finetune_config, FinetuneConfig) if kind == "finetune" else (spec.probe_config, ProbeConfig)


def eval_overrides(kind: str, model_sets: list[str], init: str | Path, seed: int) -> list[str]:
    """The pretrained weights, the pretraining's architecture and the seed, for one evaluation."""
    seed_key = "train.seed" if kind == "finetune" else "seed"  # the probes' config has no train section
    return [f"init={json.dumps(str(init))}", *model_sets, f"{seed_key}={seed}"]


def check_cells(spec: AblationSpec, cells: list[Cell]) -> dict[Cell, list[str]]:
    """Validate every cell in-process, before any launch: its config, its objective (mask
    strategy, ratio, unit size) and its evaluations' configs with its model. Returns each
    cell's ``model.*`` overrides for the evaluations; AblationError lists every bad cell."""
    from mpp.build import build_objective

    model_sets, bad = {}, []
    for cell in cells:
        try:
            cfg = load_config(spec.base, [*cell.overrides, f"train.seed={spec.seed_list[0]}"])
            build_objective(cfg)
            model = cfg.model.model_dump(mode="json")
            sets = [f"model.{k}={json.dumps(v)}" for k, v in model.items() if k not in EVAL_OWN_MODEL_KEYS]
            for kind in spec.eval:
                path, cls = eval_config(spec, kind)
                load_config(path, eval_overrides(kind, sets, "scratch", spec.seed_list[0]), cls=cls)
            model_sets[cell] = sets
        except ConfigError as e:
            bad.append(f"  {cell.name}: {e}")
    if bad:
        raise ConfigError(f"{len(bad)} of {len(cells)} cells have a bad config; nothing was run:\n" + "\n".join(bad))
    return model_sets


# ---- running -------------------------------------------------------------------------------


def is_done(kind: str, run_dir: Path) -> bool:
    """Pretraining and fine-tuning export encoder.safetensors at the very end (fine-tuning
    rewrites results.json every epoch, so that alone would not do); a probe writes
    results.json last."""
    final = "encoder.safetensors" if kind in ("pretrain", "finetune") else "results.json"
    return (run_dir / final).is_file() and (kind == "pretrain" or (run_dir / "results.json").is_file())


def run_job(spec: AblationSpec, job: Job, model_overrides: list[str], launcher_args: list[str], tag: str) -> list[dict]:
    """Pretrain (or resume), then each evaluation not yet done; one row per evaluation."""
    if all(is_done(kind, job.dir / kind) for kind in spec.eval):
        print(f"{tag} {job.label}: skip (complete)", flush=True)
        return [result_row(job, kind, "ok", job.dir / kind / "results.json") for kind in spec.eval]
    pre = job.dir / "pretrain"
    if not is_done("pretrain", pre):
        resume_from = latest_complete(pre / "checkpoints")
        print(f"{tag} {job.label}: pretrain{f' (resume from {resume_from})' if resume_from else ''}", flush=True)
        args = ["--config", str(spec.base), *[a for o in job.cell.overrides for a in ("--set", o)],
                "--set", f"train.seed={job.seed}", "--output-dir", str(pre), "--resume", "auto"]
        code = launch(deepspeed_cmd(launcher_args, SCRIPTS["pretrain"], args), job.dir / "pretrain.log")
        if code:
            print(f"{tag} {job.label}: pretrain FAILED (exit {code}), log: {job.dir / 'pretrain.log'}", flush=True)
            return [result_row(job, kind, "failed", job.dir / "pretrain.log") for kind in spec.eval]
    rows = []
    for kind in spec.eval:
        out, log = job.dir / kind, job.dir / f"{kind}.log"
        if not is_done(kind, out):
            path, _ = eval_config(spec, kind)
            args = ["--config", str(path), *[a for o in eval_overrides(kind, model_overrides, pre, job.seed) for a in ("--set", o)],
                    "--output-dir", str(out)]
            if kind == "finetune":
                code = launch(deepspeed_cmd(launcher_args, SCRIPTS[kind], [*args, "--resume", "auto"]), log)
            else:  # the probes run in one process on cached features
                code = launch([sys.executable, str(REPO / SCRIPTS[kind]), *args], log)
            if code:
                print(f"{tag} {job.label}: {kind} FAILED (exit {code}), log: {log}", flush=True)
                rows.append(result_row(job, kind, "failed", log))
                continue
        row = result_row(job, kind, "ok", out / "results.json")
        print(f"{tag} {job.label}: {kind} top1 {row['top1']:.2f}", flush=True)
        rows.append(row)
    return rows


def result_row(job: Job, kind: str, status: str, path: Path) -> dict:
    res = json.loads(path.read_text()) if status == "ok" else {}
    return {**dict(job.cell.values), "seed": job.seed, "eval": kind, "top1": res.get("top1"), "top5": res.get("top5"),
            "status": status, "path": str(path)}


def run_ablation(spec: AblationSpec) -> tuple[list[dict], int]:
    """Validate every cell, then run them all; (rows, number of failed rows). ConfigError
    before anything is created when a cell is bad."""
    needed = ["base", *{"finetune_config" if kind == "finetune" else "probe_config" for kind in spec.eval}]
    spec = spec.model_copy(update={k: str(resolve_config_path(getattr(spec, k)).resolve()) for k in needed})
    cells = plan_cells(spec)
    model_sets = check_cells(spec, cells)
    launcher_args = spec.launcher_args if spec.launcher_args is not None else default_launcher_args()
    jobs = plan_jobs(spec, cells)
    rows = []
    for i, job in enumerate(jobs, 1):
        rows += run_job(spec, job, model_sets[job.cell], launcher_args, f"[{i}/{len(jobs)}]")
    return rows, sum(r["status"] != "ok" for r in rows)


# ---- report: results.csv, results.md, results.png ------------------------------------------


def write_csv(rows: list[dict], keys: list[str], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, [*keys, "seed", "eval", "top1", "top5", "status", "path"])
        w.writeheader()
        w.writerows(rows)


def summarize(rows: list[dict], keys: list[str], metric: str) -> dict[tuple, tuple[float, float, int]]:
    """(cell values..., eval) -> (mean, sample std over seeds (0 for one), seeds that finished)."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        values = groups.setdefault((*[r[k] for k in keys], r["eval"]), [])
        if r["status"] == "ok":
            values.append(float(r[metric]))
    return {g: (statistics.fmean(v) if v else float("nan"), statistics.stdev(v) if len(v) > 1 else 0.0, len(v))
            for g, v in groups.items()}


def write_markdown(rows: list[dict], keys: list[str], evals: list[str], path: Path, title: str) -> None:
    cells = list(dict.fromkeys(tuple(r[k] for k in keys) for r in rows))
    lines = [f"# {title}", "", "mean ± std (n) over seeds; std is the sample standard deviation, n the seeds that finished."]
    for metric in ("top1", "top5"):
        stats = summarize(rows, keys, metric)
        lines += ["", f"## {metric} (%)", "", "| " + " | ".join([*keys, *evals]) + " |", "|" + "---|" * (len(keys) + len(evals))]
        for cell in cells:
            entries = []
            for kind in evals:
                mean, std, n = stats[(*cell, kind)]
                entries.append(f"{mean:.2f} ± {std:.2f} ({n})" if n else "failed (0)")
            lines.append("| " + " | ".join([*cell, *entries]) + " |")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["", "## Failed", ""]
        lines += [f"- {', '.join(r[k] for k in keys) or 'base'}, seed {r['seed']}, {r['eval']}: `{r['path']}`" for r in failed]
    path.write_text("\n".join(lines) + "\n")


PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]


def plot(rows: list[dict], keys: list[str], evals: list[str], path: Path, group_key: str = "masking.strategy") -> None:
    """Top-1 per cell as bars with ± std error bars (PIL only): one panel per evaluation, bars
    grouped by ``group_key`` (the strategy; else the first grid key) and coloured by the others."""
    from PIL import Image, ImageDraw, ImageFont

    font, small = ImageFont.load_default(size=15), ImageFont.load_default(size=12)
    gkey = group_key if group_key in keys else (keys[0] if keys else None)
    others = [k for k in keys if k != gkey]
    stats = summarize(rows, keys, "top1")
    groups = list(dict.fromkeys(r[gkey] for r in rows)) if gkey else ["base"]
    series = list(dict.fromkeys(tuple(r[k] for k in others) for r in rows))
    cell_of = lambda g, s: tuple(g if k == gkey else s[others.index(k)] for k in keys)  # noqa: E731
    bar, left, plot_h, panel_h = 26, 80, 200, 275
    width = max(460, left + len(groups) * max(len(series) * bar + 30, 90) + 20)
    group_w = (width - left - 20) / len(groups)
    labels = [", ".join(f"{k}={v}" for k, v in zip(others, s, strict=True)) or "mean top-1" for s in series]
    labels.append("± std over seeds (n finished)")
    per_row = max(1, (width - left) // 200)
    legend_h = 24 * -(-len(labels) // per_row) + 12
    img = Image.new("RGB", (width, 40 + legend_h + panel_h * len(evals)), "white")
    d = ImageDraw.Draw(img)
    d.text((left, 10), "top-1 (%) per cell, mean ± std over seeds", fill="black", font=font)
    for j, label in enumerate(labels):  # legend: a colour per setting of the other grid keys, then the error bar
        x, y = left + (j % per_row) * 200, 38 + 24 * (j // per_row)
        if j < len(series):
            d.rectangle([x, y, x + 14, y + 14], fill=PALETTE[j % len(PALETTE)])
        else:
            d.line([x + 7, y, x + 7, y + 14], fill="black", width=2)
            d.line([x + 2, y, x + 12, y], fill="black", width=2)
            d.line([x + 2, y + 14, x + 12, y + 14], fill="black", width=2)
        d.text((x + 20, y), label, fill="black", font=small)
    ylabel = Image.new("RGB", (plot_h, 16), "white")
    ImageDraw.Draw(ylabel).text((plot_h // 2, 0), "top-1 (%)", fill="black", font=small, anchor="ma")
    ylabel = ylabel.rotate(90, expand=True)
    for p, kind in enumerate(evals):
        y0 = 40 + legend_h + p * panel_h + 24  # top of this panel's plot area
        found = [m + sd for (*_, k), (m, sd, n) in stats.items() if k == kind and n]
        ymax = max(10.0, -(-max(found, default=10.0) // 10) * 10)
        y_of = lambda v, y0=y0, ymax=ymax: y0 + plot_h - min(v, ymax) / ymax * plot_h  # noqa: E731
        d.text((left, y0 - 22), kind, fill="black", font=font)
        for t in range(0, int(ymax) + 1, 10 if ymax <= 50 else 20):
            d.line([left, y_of(t), width - 20, y_of(t)], fill=(225, 225, 225))
            d.text((left - 8, y_of(t)), f"{t}", fill="black", font=small, anchor="rm")
        img.paste(ylabel, (14, y0))
        d.line([left, y0, left, y0 + plot_h, width - 20, y0 + plot_h], fill="black")
        for gi, g in enumerate(groups):
            gx = left + gi * group_w + (group_w - len(series) * bar) / 2
            for j, s in enumerate(series):
                mean, std, n = stats[(*cell_of(g, s), kind)]
                x, cx = gx + j * bar, gx + j * bar + bar / 2
                if not n:
                    d.text((cx, y0 + plot_h - 4), "failed", fill=(200, 0, 0), font=small, anchor="mb")
                    continue
                d.rectangle([x + 2, y_of(mean), x + bar - 2, y0 + plot_h], fill=PALETTE[j % len(PALETTE)])
                lo, hi = y_of(max(0.0, mean - std)), y_of(mean + std)
                for line in ([cx, lo, cx, hi], [cx - 5, lo, cx + 5, lo], [cx - 5, hi, cx + 5, hi]):
                    d.line(line, fill="black", width=2)
            d.text((left + (gi + 0.5) * group_w, y0 + plot_h + 6), str(g), fill="black", font=small, anchor="mt")
        d.text(((left + width) / 2, y0 + plot_h + 24), gkey or "", fill="black", font=small, anchor="mt")
    img.save(path)


def write_report(spec: AblationSpec, rows: list[dict]) -> list[Path]:
    keys, out = list(spec.grid), spec.out_dir
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.csv", out / "results.md", out / "results.png"]
    write_csv(rows, keys, paths[0])
    write_markdown(rows, keys, spec.eval, paths[1], f"Ablation of {Path(spec.base).name}")
    plot(rows, keys, spec.eval, paths[2])
    return paths
