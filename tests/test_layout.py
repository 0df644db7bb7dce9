"""The library's shape (docs/ARCHITECTURE.md §2): every module imports on its own, no import circle in mpp/,
each layer imports only the layers below it (LAYERS), and nothing of the library imports the
tools. A file past ~400 lines or a function past ~60 is a warning naming it, not a failure."""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
import warnings
from importlib.util import find_spec
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mpp"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path) -> set[str]:
    """The mpp modules ``name`` imports anywhere in its body (function-level imports too):
    ``from a.b import c`` counts as a.b.c when that is a module, else as a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_in_mpp():
    graph = {name: imports_of(name, path) for name, path in MODULES.items()}
    assert graph["mpp.train.trainer"] >= {
        "mpp.train.plan",
        "mpp.train.optim",
        "mpp.train.metrics",
    }  # the walker sees imports
    # job control comes in as hooks that mpp.jobs registers (issue 37 §2)
    job_control = {"mpp.train.monitor", "mpp.train.preview", "mpp.train.preemption"}
    assert not graph["mpp.train.trainer"] & (job_control | {"mpp.train.runlock"})
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


# What each part of mpp/ may import of ours (a package, or one module of it), bottom to top. A
# part imports only what its row names; the tools sit on top and nothing imports them.
LAYERS = {
    "mpp.ops": set(),  # tensor helpers: nothing of ours
    "mpp.parallel": set(),  # process group, launcher, ZeRO internals, EMA, the DeepSpeed config
    # shards, decoding, augmentation; its scans split across the ranks (split_scan)
    "mpp.data": {"mpp.parallel.distributed"},
    "mpp.sections": set(),  # the typed sections' base and the one pydantic error formatter
    "mpp.quiet": set(),  # DeepSpeed's chatter off stdout unless --verbose
    "mpp.models": {"mpp.ops"},
    "mpp.masking": {"mpp.ops", "mpp.sections"},
    # frozen-encoder features and the k-NN vote: the probes' and the training monitor's
    "mpp.features": {"mpp.models", "mpp.ops"},
    # the typed sections: the objectives' and the masks' own, the deepspeed section's defaults
    "mpp.config": {
        "mpp.ops",
        "mpp.parallel.ds_config",
        "mpp.objectives.configs",
        "mpp.masking",
        "mpp.sections",
    },
    "mpp.objectives": {
        "mpp.models",
        "mpp.masking",
        "mpp.ops",
        "mpp.parallel.ema",
        "mpp.data.augment",
        "mpp.sections",
    },
    # the runtime: previews draw the objectives' own outputs (train.panels, train.preview)
    "mpp.train": {
        "mpp.config",
        "mpp.data",
        "mpp.features",
        "mpp.parallel",
        "mpp.objectives",
        "mpp.masking",
        "mpp.ops",
        "mpp.checkpoint",
    },
    # below train, imported one way only: the Trainer owns a Checkpointer; the RunState and the
    # RNG states it saves live here (checkpoint.state)
    "mpp.checkpoint": {"mpp.config", "mpp.parallel", "mpp.hub.encoder_file", "mpp.quiet"},
    "mpp.hub": {
        "mpp.models",
        "mpp.data",
        "mpp.ops",
        "mpp.checkpoint.format",
        "mpp.checkpoint.storage",
        "mpp.quiet",
    },
    # config -> objective and encoder, init weights included: above hub, so not inside objectives/
    "mpp.build": {
        "mpp.config",
        "mpp.hub",
        "mpp.masking",
        "mpp.models",
        "mpp.objectives",
        "mpp.checkpoint.storage",
    },
    # the CLIs' front end: below transfer, whose probe CLI core uses it
    "mpp.cli": {"mpp.config", "mpp.parallel", "mpp.train", "mpp.hub.encoder_file", "mpp.quiet"},
    "mpp.submit": {"mpp.cli", "mpp.parallel", "mpp.train"},
    "mpp.transfer": {
        "mpp.build",
        "mpp.checkpoint",
        "mpp.cli",
        "mpp.config",
        "mpp.data",
        "mpp.features",
        "mpp.hub",
        "mpp.masking",
        "mpp.models",
        "mpp.objectives",
        "mpp.ops",
        "mpp.parallel",
        "mpp.submit",
        "mpp.train",
    },
    # one call per job (run_pretrain, run_finetune): the CLIs, the API and the submitit job's
    "mpp.jobs": {
        "mpp.build",
        "mpp.checkpoint",
        "mpp.cli",
        "mpp.config",
        "mpp.parallel",
        "mpp.train",
        "mpp.transfer",
    },
}
TOOLS = {
    "mpp",  # the public API's facade (mpp.api) and the mpp command (mpp.commands) sit on top
    "mpp.api",
    "mpp.commands",
    "mpp.tools",  # ablations, demo, pictures, planner/, doctor/
}  # anything below


def part_of(module: str) -> str:
    """The row of LAYERS (or TOOLS) a module belongs to: its longest prefix there."""
    rows = [r for r in [*LAYERS, *TOOLS] if module == r or module.startswith(r + ".")]
    return max(rows, key=len)


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes up (or sideways out of its row), as 'a imports b'."""
    bad = []
    for name, targets in sorted(graph.items()):
        part = part_of(name)
        for target in sorted(targets):
            other = part_of(target)
            if (
                other == part
                or part in TOOLS
                and other not in TOOLS
                or part in TOOLS
                and other in TOOLS
            ):
                continue
            allowed = LAYERS.get(part, set())
            if other in TOOLS or not any(
                target == a or target.startswith(a + ".") for a in allowed
            ):
                bad.append(
                    f"{name} imports {target} ({part} may import {sorted(allowed) or 'nothing of ours'})"
                )
    return bad


def test_every_module_belongs_to_a_layer_and_imports_only_below_it():
    graph = {name: imports_of(name, path) for name, path in MODULES.items()}
    assert not layer_violations(graph), "\n".join(layer_violations(graph))


def test_the_layering_rule_catches_an_import_going_up():
    """The rule, fed what a careless edit would write: a model importing the runtime, the data
    importing an objective, the runtime importing the tools, the checkpoints importing the
    planner, the weights' readers importing the Checkpointer."""
    graph = {
        "mpp.models.vit": {"mpp.train.engine", "mpp.ops"},
        "mpp.data.loader": {"mpp.objectives.mae"},
        "mpp.train.engine": {"mpp.tools.ablation", "mpp.parallel.zero"},
        "mpp.tools.demo": {"mpp.train.engine"},
        "mpp.checkpoint.manager": {"mpp.tools.planner.report", "mpp.train.plan"},
        "mpp.hub.pretrained": {"mpp.checkpoint.manager", "mpp.checkpoint.format"},
        "mpp.transfer.probe": {"mpp.commands.probe", "mpp.hub.pretrained"},
    }
    assert layer_violations(graph) == [
        "mpp.checkpoint.manager imports mpp.tools.planner.report (mpp.checkpoint may import "
        "['mpp.config', 'mpp.hub.encoder_file', 'mpp.parallel', 'mpp.quiet'])",
        "mpp.checkpoint.manager imports mpp.train.plan (mpp.checkpoint may import "
        "['mpp.config', 'mpp.hub.encoder_file', 'mpp.parallel', 'mpp.quiet'])",
        "mpp.data.loader imports mpp.objectives.mae (mpp.data may import "
        "['mpp.parallel.distributed'])",
        "mpp.hub.pretrained imports mpp.checkpoint.manager (mpp.hub may import "
        "['mpp.checkpoint.format', 'mpp.checkpoint.storage', 'mpp.data', 'mpp.models', 'mpp.ops', "
        "'mpp.quiet'])",
        "mpp.models.vit imports mpp.train.engine (mpp.models may import ['mpp.ops'])",
        "mpp.train.engine imports mpp.tools.ablation (mpp.train may import ['mpp.checkpoint', "
        "'mpp.config', 'mpp.data', 'mpp.features', 'mpp.masking', 'mpp.objectives', 'mpp.ops', "
        "'mpp.parallel'])",
        "mpp.transfer.probe imports mpp.commands.probe (mpp.transfer may import ['mpp.build', "
        "'mpp.checkpoint', 'mpp.cli', 'mpp.config', 'mpp.data', 'mpp.features', 'mpp.hub', "
        "'mpp.masking', 'mpp.models', 'mpp.objectives', 'mpp.ops', 'mpp.parallel', 'mpp.submit', "
        "'mpp.train'])",
    ]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports_on_its_own(name):
    importlib.import_module(name)


def test_files_and_functions_stay_small():
    """A warning naming each file past ~400 lines and function past ~60: a hint to split along a
    seam, not a limit to squeeze code under."""
    too_long = []
    for name, path in MODULES.items():
        source = path.read_text()
        if source.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}.{node.name}: {length} lines")
    for item in too_long:
        warnings.warn(f"long: {item}", stacklevel=1)


def test_objectives_never_name_deepspeed_internals():
    """ZeRO-3's partitioning is the engine's business (mpp.parallel.zero, mpp.parallel.ema), not an objective's."""
    for path in (PACKAGE / "objectives").glob("*.py"):
        source = path.read_text()
        for word in ("ds_tensor", "ds_numel", "GatheredParameters", "deepspeed"):
            assert word not in source, f"{path.name} names {word}"


# ---- dotted names in prose resolve ---------------------------------------------------------

# mpp.<module>.<name> not inside a path or a file name (RUN/.mpp_stats.json, configs/mpp_b16.json, mpp/x.py)
DOTTED_NAME = re.compile(r"(?<![\w./\\-])mpp(?:\.[A-Za-z_]\w*)+")
FILE_SUFFIXES = {"py", "json", "jsonl", "md", "txt", "tar", "pt", "pth", "safetensors", "png"}
PROSE_FILES = (
    "README.md",
    "BENCHMARKS.md",
    *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))),
)


def prose_of_python(path: Path) -> str:
    """A Python file's docstrings (any bare string statement: module, class, function and
    attribute docstrings) and comments, the code left out."""
    source = path.read_text()
    parts = [
        node.value.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    parts += [t.string for t in tokens if t.type == tokenize.COMMENT]
    return "\n".join(parts)


def dotted_names(text: str) -> set[str]:
    return {
        m.group()
        for m in DOTTED_NAME.finditer(text)
        if m.group().rpartition(".")[2] not in FILE_SUFFIXES
        and not text.startswith("/", m.end())  # a folder: mpp.something/
    }


def resolves(name: str) -> bool:
    """Whether the longest importable module prefix of ``name`` imports and the rest are its
    attributes (a pydantic or dataclass field counts as an attribute of its class); an old name
    that no longer exists does not."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i in range(1, len(parts)):
        sub = ".".join(parts[: i + 1])
        if isinstance(obj, ModuleType) and hasattr(obj, "__path__") and find_spec(sub):
            obj = importlib.import_module(sub)
        elif hasattr(obj, parts[i]):
            obj = getattr(obj, parts[i])
        elif parts[i] in {
            **getattr(obj, "model_fields", {}),
            **getattr(obj, "__dataclass_fields__", {}),
        }:
            return i == len(parts) - 1  # a field: nothing can follow it
        else:
            return False
    return True


def test_dotted_names_in_docstrings_comments_and_docs_resolve():
    """Every ``mpp.<module>.<name>`` named in the docstrings and comments of mpp/, pretrain/, downstream/ and
    tests/, and in docs/ARCHITECTURE.md, README.md and BENCHMARKS.md, still exists: a move or a
    rename that leaves a stale name behind fails here, naming the file."""
    where: dict[str, set[str]] = {}
    for folder in ("mpp", "pretrain", "downstream", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            names = dotted_names(prose_of_python(path))
            for name in names:
                where.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    for rel in PROSE_FILES:
        for name in dotted_names((ROOT / rel).read_text()):
            where.setdefault(name, set()).add(rel)
    assert "mpp.train.plan.check_resume" in where  # the scan sees names
    stale = [f"{n} ({', '.join(sorted(where[n]))})" for n in sorted(where) if not resolves(n)]
    assert not stale, "names that do not resolve:\n" + "\n".join(stale)


def test_the_name_scan_skips_paths_and_file_names():
    text = "mpp/x.py, configs/mpp_b16.json, RUN/.mpp_stats.json, mpp.json; see mpp.ops.patchify."
    assert dotted_names(text) == {"mpp.ops.patchify"}
    assert resolves("mpp.ops.patchify") and resolves("mpp.config.TrainConfig.batch_size")
    assert not resolves("mpp.hub.no_such_module") and not resolves("mpp.ops.no_such_helper")


def test_readme_names_the_plot_extra_where_it_names_curves():
    """README said nothing of the ``plot`` extra that draws ``RUN/curves.png`` (issue 50,
    finding 9): the paragraph naming curves.png names the extra, as pyproject.toml defines it."""
    assert 'plot = ["matplotlib' in (ROOT / "pyproject.toml").read_text()
    paragraphs = (ROOT / "README.md").read_text().split("\n\n")
    named = [p for p in paragraphs if "curves.png" in p]
    assert named and all("pip install '.[plot]'" in p for p in named), named
