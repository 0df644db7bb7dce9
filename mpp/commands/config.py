"""``mpp config``: what a config key means, from the typed sections' own docstrings, or a config
as it resolves (every default filled in).

    mpp config --explain data.value_range            # type, default, what it does
    mpp config --explain objective.teacher_view      # a key of an objective: HPM's here
    mpp config mae_demo --set train.epochs=3         # the resolved config, as RUN/config.json has it
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

from pydantic import BaseModel

from mpp.cli import add_set_argument
from mpp.config import Config, ConfigError, FinetuneConfig, ProbeConfig, load_config
from mpp.sections import nearest, sections_in

KINDS = {"pretrain": Config, "finetune": FinetuneConfig, "probe": ProbeConfig}


def explain(key: str) -> list[str]:
    """A paragraph per definition of ``key`` (``section.field``, ``objective.base.bits``): its
    type, default and docstring, and which configs (pretraining, fine-tuning, probe) have it."""
    parts = key.split(".")
    found: dict[str, list[str]] = {}  # the paragraph -> the kinds of config that have it
    for kind, root in KINDS.items():
        frontier: list[tuple[type[BaseModel], str]] = [(root, "")]
        for depth, part in enumerate(parts):
            nxt = []
            for model, where in frontier:
                field = model.model_fields.get(part)
                if field is None:
                    continue
                if depth < len(parts) - 1:
                    nxt += [(m, m.__name__) for m in sections_in(field.annotation)]
                    continue
                default = field.get_default(call_default_factory=True)
                shown = "a section" if isinstance(default, BaseModel) else json.dumps(default)
                owner = f" ({where})" if where and model is not root else ""
                text = textwrap.fill(" ".join((field.description or "(undocumented)").split()), 94)
                text = textwrap.indent(text, "  ").lstrip()
                para = f"  type: {_type(field.annotation)}{owner}\n  default: {shown}\n  {text}"
                found.setdefault(para, []).append(kind)
            frontier = nxt
    return [f"{key}  [{', '.join(kinds)}]\n{para}" for para, kinds in found.items()]


def every_key(model: type[BaseModel] | None = None, prefix: str = "") -> set[str]:
    """Every dotted key of the pretraining, fine-tuning and probe configs (``objective.bits``,
    ``objective.base.bits``): what ``--explain`` can explain."""
    if model is None:
        return set().union(*(every_key(root) for root in KINDS.values()))
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(prefix + name)
        for section in sections_in(field.annotation):
            keys |= every_key(section, f"{prefix}{name}.")
    return keys


def suggest(key: str) -> str:
    """' (did you mean X?)' for a key no config has: the same key of another section
    (train.warmup_steps: optim.warmup_steps), else the nearest key; '' when none is near."""
    keys = every_key()
    leaf = key.rsplit(".", 1)[-1]
    moved = sorted(k for k in keys if k.rsplit(".", 1)[-1] == leaf)
    near = moved[:3] or [nearest(key, keys)]
    return f" (did you mean {' or '.join(near)}?)" if near != [None] else ""


def _type(annotation: Any) -> str:
    return str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="mpp config", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "config", nargs="?", help="a config to show resolved (a file, or a name in configs/)"
    )
    add_set_argument(p)
    p.add_argument(
        "--explain", metavar="KEY", help="what KEY means: its type, default and description"
    )
    args = p.parse_args(argv)
    if args.explain:
        found = explain(args.explain)
        if not found:
            print(
                f"error: {args.explain}: no such key in a pretraining, fine-tuning or probe config"
                + suggest(args.explain),
                file=sys.stderr,
            )
            return 2
        print("\n\n".join(found))
        return 0
    if not args.config:
        p.print_usage(sys.stderr)
        return 2
    from mpp.config import resolve_config_path

    try:
        raw = json.loads(resolve_config_path(args.config).read_text())
        kind = FinetuneConfig if "finetune" in raw else ProbeConfig if "probe" in raw else Config
        cfg = load_config(args.config, args.set, cls=kind)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(cfg.model_dump(mode="json"), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
