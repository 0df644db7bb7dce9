"""What the typed sections share (the config's, the objectives' and the masks'): their base, and
the one way a refusal of pydantic's is said, for a config file and a library call alike."""

from __future__ import annotations

import difflib
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError


class Section(BaseModel):
    """Unknown keys refused, assignments checked, each field's docstring its description."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )


def sections_in(annotation: Any) -> list[type[BaseModel]]:
    """The models an annotation holds: itself, or the members of a union or an optional (each
    once)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return list(dict.fromkeys(s for a in typing.get_args(annotation) for s in sections_in(a)))


def _tag(field: Any) -> Any:
    """A union member's tag (objective.name, masking.strategy: a one-value Literal), else None."""
    args = typing.get_args(field.annotation)
    return args[0] if typing.get_origin(field.annotation) is Literal and len(args) == 1 else None


def _tagged(members: list[type[BaseModel]], tag: str) -> list[type[BaseModel]]:
    return [m for m in members if any(_tag(f) == tag for f in m.model_fields.values())]


def _keys(members: list[type[BaseModel]]) -> list[str]:
    """The keys a section (or a union's members) takes, its tag aside."""
    return sorted({n for m in members for n, f in m.model_fields.items() if _tag(f) is None})


def refusal(err: ValidationError, cls: type[BaseModel], raw: Any = None) -> tuple[str, str]:
    """pydantic's first error in ``cls`` as (dotted key, what is wrong): a tagged union's tag is
    no key (objective.base.bits, not objective.hpm.base.mpp.bits); an unknown key comes with the
    nearest key its section has, else with all of them; a refused value, with the value. With
    the ``raw`` input, a key of HPM's flat form is named as written (objective.bits)."""
    e = err.errors()[0]
    loc = [str(x) for x in e["loc"] if not str(x).startswith("function-after")]
    unknown = e["type"] == "extra_forbidden"
    keys, members = [], [cls]
    entered = [("", members)]  # each section the walk entered, after its key
    owners = {}  # where a "base" field sits in keys: the keys its section owns (HPM's)
    for part in loc[:-1] if unknown else loc:
        fields = [m.model_fields[part] for m in members if part in m.model_fields]
        if fields:
            if part == "base":
                owners[len(keys)] = {n for m in members for n in m.model_fields}
            keys.append(part)
            if sections_in(fields[0].annotation):
                members = sections_in(fields[0].annotation)
                entered.append(("".join(k + "." for k in keys), members))
        elif _tagged(members, part):  # a union's tag: the member it picks
            members = _tagged(members, part)
            entered[-1] = (entered[-1][0], members)
        else:  # a list's index, a dict's key
            keys.append(part)
    msg = e["msg"].removeprefix("Value error, ")
    if unknown:
        # the nearest key of its own section, else of one around it (HPM's flat form puts a
        # mistyped HPM key into its base)
        for where, around in reversed(entered):
            near = difflib.get_close_matches(loc[-1], _keys(around), n=1, cutoff=0.75)
            if near:
                msg = f"unknown key (did you mean {where}{near[0]}?)"
                break
        else:
            allowed = ", ".join(_keys(members)) or "none"
            msg = f"unknown key; allowed: {allowed}"
        keys.append(loc[-1])
    elif e["type"] == "union_tag_invalid":  # objective.name, base.name, masking.strategy
        tags = [t.strip() for t in e["ctx"]["expected_tags"].split(",")]
        keys.append(e["ctx"]["discriminator"].strip("'"))
        msg = f"Input should be {', '.join(tags[:-1])} or {tags[-1]} (got {e['ctx']['tag']!r})"
    elif "input" in e and e["type"] not in ("missing", "value_error"):
        msg += f" (got {e['input']!r})"
    return _as_written(keys, msg, raw, owners)


def _as_written(
    keys: list[str], msg: str, raw: Any, owners: dict[int, set[str]]
) -> tuple[str, str]:
    """HPM's flat form puts its base's keys beside its own, and its validator files each key it
    does not own under ``base``: such a key, found beside ``base`` in ``raw``, is named (its
    hint too) as the user wrote it."""
    node = raw
    for i, part in enumerate(keys[:-1]):
        if not isinstance(node, dict):
            break
        moved = keys[i + 1]
        if i in owners and moved in node and moved not in owners[i]:
            nested = "".join(k + "." for k in keys[: i + 1])
            written = nested.removesuffix("base.")
            msg = msg.replace(f"did you mean {nested}", f"did you mean {written}")
            if msg.startswith("unknown key; allowed: "):
                msg += f" (its base's); its own: {', '.join(sorted(owners[i] - {'name', 'base'}))}"
            return written + ".".join(keys[i + 1 :]), msg
        node = node.get(part)
    return ".".join(keys), msg
