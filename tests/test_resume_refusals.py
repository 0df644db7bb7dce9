"""Resume or refuse, never crash (mpp/train/plan.py's check_resume and finished_run, mpp/jobs.py;
issue 50 §1): the same run directory run again with another objective, model, channel count or
image size is refused in one line naming the keys that changed and the ways out, before anything
is loaded or written; a run that had finished says so and rewrites nothing. On copies of the
suite's one-process run (conftest.one_rank_run: a 2-block ViT, MPP, 8 steps, encoder exported)."""

import shutil
import sys
import typing

import pytest
from conftest import run_cli
from pydantic import ValidationError

from mpp.models.vit import create_vit
from mpp.objectives.configs import OBJECTIVE_CONFIGS
from mpp.train.plan import WEIGHT_KEYS


def snapshot(root) -> dict:
    """Every path under ``root`` with its mtime and size: what a refusal must leave as it was."""
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")
    }


def pretrain(one_rank_run, run, *extra: str) -> list[str]:
    """The command that made the suite's run, on ``run``, with ``extra`` arguments."""
    cmd = [sys.executable, "pretrain/run.py", "--config", str(one_rank_run["config"])]
    return [*cmd, "--output-dir", str(run), *extra]


CHANGES = {
    # the case: a reused run directory, another objective (and patch size)
    "objective": (
        ["objective.name=mae", "objective.decoder_dim=32", "objective.decoder_depth=1"]
        + ["objective.decoder_heads=2", "model.patch_size=8"],
        ["objective.name 'mpp' -> 'mae'", "model.patch_size 4 -> 8"],
    ),
    "channels and size": (
        ["data.channels=1", "data.mean=[0.5]", "data.std=[0.25]", "model.img_size=32"],
        ["data.channels 3 -> 1", "model.img_size 16 -> 32"],
    ),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_resume_of_another_objective_or_model_is_refused_in_one_line(
    tmp_path, one_rank_run, change
):
    """Before: "going on from it", then ~50 lines of load_state_dict's RuntimeError, exit 1, the
    run's config.json and model.json already rewritten. Now: exit 2, one line naming each changed
    key (old -> new) and the ways out, the run directory untouched; --restart then starts over."""
    run = tmp_path / "run"
    shutil.copytree(one_rank_run["run"], run)
    before = snapshot(run)
    overrides, named = CHANGES[change]
    sets = [a for o in overrides for a in ("--set", o)]
    r = run_cli(pretrain(one_rank_run, run, *sets))
    assert r.returncode == 2, r.stderr[-3000:]
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: ") and "Traceback" not in r.stderr + r.stdout, r.stderr
    for key in named:
        assert key in line, line
    assert "model.in_chans" not in line  # what data.channels built: said once
    assert "step00000008" in line and "--restart starts over" in line and "--output-dir" in line
    assert "going on from it" not in line
    assert snapshot(run) == before
    if change != "objective":
        return
    # the way out it names: the earlier run moved aside, the new objective trained from scratch
    r = run_cli(pretrain(one_rank_run, run, *sets, "--set", "train.max_steps=1", "--restart"))
    assert r.returncode == 0, r.stderr[-3000:]
    (aside,) = tmp_path.glob("run.before-*")
    assert snapshot(aside) == before
    assert sorted(p.name for p in (run / "checkpoints").glob("step*")) == ["step00000001"]


def test_a_finished_run_run_again_says_so_and_rewrites_nothing(tmp_path, one_rank_run):
    """Before: "going on from it", a done line ("done: 8 steps, ...") and encoder.safetensors and
    curves.png written again. Now: one line saying it finished, at which step, where its outputs
    are; exit 0, nothing in the run directory touched."""
    run = tmp_path / "run"
    shutil.copytree(one_rank_run["run"], run)  # mtimes kept: the export after the last checkpoint
    before = snapshot(run)
    r = run_cli(pretrain(one_rank_run, run))
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [x for x in r.stdout.splitlines() if "finished" in x]
    assert line.startswith(f"finished before: {run} is at step 8 (step00000008)"), line
    assert f"-> {run}: encoder.safetensors, metrics.jsonl" in line and "--restart" in line
    assert "going on from it" not in r.stderr and "done: " not in r.stdout
    assert snapshot(run) == before


def variants(section, cls) -> typing.Iterator[tuple[str, dict]]:
    """(dotted key, the section's dump with that key set otherwise) for each key of ``section``
    and of its nested base, each to every other value its type suggests."""
    raw = section.model_dump()
    for name, value in raw.items():
        if isinstance(value, dict):  # HPM's base, its own section
            for key, other in variants(getattr(section, name), type(getattr(section, name))):
                yield f"{name}.{key}", {**raw, name: other}
            continue
        if isinstance(value, bool):
            others = [not value]
        elif isinstance(value, int):
            others = [value + 1, max(1, value // 2)]  # not doubled: 6 bits is 2^18 classes
        elif isinstance(value, float):
            others = [value / 2]
        else:  # a Literal's other choices
            choices = typing.get_args(cls.model_fields[name].annotation)
            others = [c for c in choices if c != value]
        for other in others:
            yield name, {**raw, name: other}


def test_every_objective_key_that_reshapes_the_weights_is_a_weight_key():
    """Each key of each objective (HPM's base's too) set to another valid value: where the
    objective's state dict then has other names or shapes, a resume with that key changed would
    end in load_state_dict's traceback, so check_resume must compare it (WEIGHT_KEYS)."""
    small = {"decoder_dim": 32, "decoder_depth": 1, "decoder_heads": 2}
    sections = [
        {"name": "mpp"},
        {"name": "mpp", "target": "downsampled"},  # its cells shape the head
        {"name": "mae", **small},
        {"name": "hpm", **small},
        {"name": "hpm", **small, "base": {"name": "mpp", "target": "downsampled"}},
    ]
    pixels = ((0.5,) * 3, (0.25,) * 3)

    def shapes(section) -> dict:
        encoder = create_vit("vit_tiny_patch4_16", depth=1, embed_dim=32, num_heads=2)
        built = section.build(encoder, None, pixels)
        return {k: tuple(v.shape) for k, v in built.state_dict().items()}

    reshaping = set()
    for raw in sections:
        cls = OBJECTIVE_CONFIGS[raw["name"]]
        section = cls.model_validate(raw)
        base = shapes(section)
        for key, other in variants(section, cls):
            try:  # a value the section or the objective refuses: no run has it
                changed = shapes(cls.model_validate(other))
            except (ValidationError, ValueError):  # probabilities off 1, cells off the patch
                continue
            if key != "name" and changed != base:
                reshaping.add(f"objective.{key}")
    assert reshaping >= {"objective.decoder_dim", "objective.bits", "objective.base.bits"}
    assert reshaping <= set(WEIGHT_KEYS), reshaping - set(WEIGHT_KEYS)
    assert {"objective.name", "objective.base.name", "data.channels"} <= set(WEIGHT_KEYS)
