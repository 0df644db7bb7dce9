"""The ``objective`` section of a config, typed: the union, keyed on ``name``, of every section in
the registry (``mpp.objectives.base.REGISTRY``, filled by ``@register`` in each objective's file,
all of which are imported here). pydantic names a bad or unknown key (``objective.decoder_dim``)
with the file, before anything is created."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Annotated, Any, Union

from pydantic import Field, ValidationError

from mpp.objectives.base import REGISTRY, PerPatchObjective, Section
from mpp.sections import refusal

for _module in pkgutil.iter_modules([str(Path(__file__).parent)]):
    importlib.import_module(f"mpp.objectives.{_module.name}")


def _union(sections: list[type[Section]]) -> Any:
    return Annotated[Union[tuple(sections)], Field(discriminator="name")]  # noqa: UP007


OBJECTIVE_CONFIGS: dict[str, type[Section]] = {n: REGISTRY[n][0] for n in sorted(REGISTRY)}
# what a section may nest as the objective it wraps (HPM's ``base``): the per-patch objectives'
PerPatchSection = _union(
    [
        c.base_section
        for _, c in map(REGISTRY.get, sorted(REGISTRY))
        if issubclass(c, PerPatchObjective)
    ]
)
for _section in OBJECTIVE_CONFIGS.values():
    _section.model_rebuild(_types_namespace={"PerPatchSection": PerPatchSection})
ObjectiveConfig = _union(list(OBJECTIVE_CONFIGS.values()))


def parse_objective(name: str, kwargs: dict[str, Any]) -> Section:
    """``name``'s typed section from a library call's flat arguments (``create_objective``);
    a bad argument raises ValueError naming it, as a config's key is named."""
    if name not in OBJECTIVE_CONFIGS:
        raise ValueError(f"unknown objective {name!r}; allowed: {sorted(OBJECTIVE_CONFIGS)}")
    section = OBJECTIVE_CONFIGS[name]
    try:
        return section.model_validate({**kwargs, "name": name})
    except ValidationError as err:
        key, msg = refusal(err, section, kwargs)
        raise ValueError(f"objective {name!r}: " + (f"{key}: {msg}" if key else msg)) from None
