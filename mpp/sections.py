"""What the typed sections share (the config's, the objectives' and the masks'): their base, and
the one way a refusal of pydantic's is said, for a config file and a library call alike."""

from __future__ import annotations

import difflib
import re
import types
import typing
from typing import Any, Literal, NamedTuple

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


class Problems(ValueError):
    """Several findings of one check across keys (a model validator), each said on its own line
    of the refusal (``refusals``) rather than the first alone."""

    def __init__(self, *findings: str) -> None:
        super().__init__(*findings)

    @property
    def findings(self) -> list[str]:
        return list(self.args)

    def __str__(self) -> str:
        return "; ".join(self.args)


def refuse(findings: list[str]) -> None:
    """A model validator's end: ``Problems`` when it found any."""
    if findings:
        raise Problems(*findings)


def nearest(word: str, choices: Any, cutoff: float = 0.75) -> str | None:
    """The choice closest to a mistyped ``word`` (difflib's ratio above ``cutoff``), else None:
    the "did you mean" of an unknown key, config name or ``--explain`` key."""
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return near[0] if near else None


class Refused(NamedTuple):
    """One refusal: the dotted key, what is wrong, and whether the key is unknown (which an
    override of a key below it may have made)."""

    key: str
    msg: str
    unknown: bool = False


def refusal(err: ValidationError, cls: type[BaseModel], raw: Any = None) -> tuple[str, str]:
    """pydantic's first error in ``cls`` as (dotted key, what is wrong) (``refusals``)."""
    first = refusals(err, cls, raw)[0]
    return first.key, first.msg


def refusals(err: ValidationError, cls: type[BaseModel], raw: Any = None) -> list[Refused]:
    """Every error of pydantic's in ``cls``: one per key (a union's members refuse one value once
    each: the first is said) and one per finding of a ``Problems``."""
    found: list[Refused] = []
    said = set()  # the keys refused, a list's index aside (the str or the list of a union)
    for e in err.errors():
        error = (e.get("ctx") or {}).get("error")
        if isinstance(error, Problems):
            found += [_refusal_of({**e, "msg": msg}, cls, raw) for msg in error.findings]
            continue
        refused = _refusal_of(e, cls, raw)
        if (key := re.sub(r"(\.\d+)+$", "", refused.key)) not in said:
            said.add(key)
            found.append(refused)
    return found


def _refusal_of(e: dict[str, Any], cls: type[BaseModel], raw: Any = None) -> Refused:
    """One pydantic error as (dotted key, what is wrong): a tagged union's tag is no key
    (objective.base.bits, not objective.hpm.base.mpp.bits); an unknown key comes with the
    nearest key its section has, else with all of them; a refused value, with the value. With
    the ``raw`` input, a key of HPM's flat form is named as written (objective.bits)."""
    loc = [str(x) for x in e["loc"] if not str(x).startswith("function-after")]
    unknown = e["type"] == "extra_forbidden"
    keys, members = [], [cls]
    entered = [("", members)]  # each section the walk entered, after its key
    owners = {}  # where a "base" field sits in keys: the keys its section owns (HPM's)
    in_union = False  # the last key's value is a union of plain types: what follows names one
    for part in loc[:-1] if unknown else loc:
        fields = [m.model_fields[part] for m in members if part in m.model_fields]
        if fields:
            if part == "base":
                owners[len(keys)] = {n for m in members for n in m.model_fields}
            keys.append(part)
            in_union = typing.get_origin(fields[0].annotation) in (typing.Union, types.UnionType)
            if sections_in(fields[0].annotation):
                members = sections_in(fields[0].annotation)
                entered.append(("".join(k + "." for k in keys), members))
                in_union = False
        elif _tagged(members, part):  # a union's tag: the member it picks
            members = _tagged(members, part)
            entered[-1] = (entered[-1][0], members)
        elif in_union:  # the member that refused it (tuple[float, ...]): no key
            in_union = False
        else:  # a list's index, a dict's key
            keys.append(part)
    msg = e["msg"].removeprefix("Value error, ")
    if unknown:
        # the nearest key of its own section, else of one around it (HPM's flat form puts a
        # mistyped HPM key into its base)
        for where, around in reversed(entered):
            if near := nearest(loc[-1], _keys(around)):
                msg = f"unknown key (did you mean {where}{near}?)"
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
    return Refused(*_as_written(keys, msg, raw, owners), unknown)


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
