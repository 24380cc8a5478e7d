"""Readable lines for pydantic's validation errors: the dotted field, what it must be, an example, the value.

A value of the wrong type or out of range gets one line built from the field's own definition (its type, bounds
and choices) and an example from it (``Field(examples=[...])``, else its default), e.g.
``training.batch_size: must be a whole number >= 1, e.g. training.batch_size: 8 (got 'abc')``. The messages of
loralei's own validators are kept as they are, an unknown key gets a "did you mean" (:mod:`.renames`), and every
problem gets its own line.
"""

from __future__ import annotations

import math
import types
from collections.abc import Collection, Mapping, Sequence
from typing import Annotated, Any, Literal, NamedTuple, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import AliasChoices, BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .errors import did_you_mean
from .renames import FOREIGN_VALUES, unknown_key_hint

# Error types that carry a message of loralei's own validators.
_OWN_MESSAGES = {"value_error", "assertion_error"}
# Pydantic names the tried member of a union in an error's location ("bool", "list[FusedGroup]",
# "literal['auto']", "WandbSection"); these are not keys the user wrote.
_TYPE_TAGS = {"bool", "int", "float", "str", "none", "dict", "list", "tuple"}
_BOUNDS = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
)
_PLURALS = {int: "whole numbers", float: "numbers", str: "strings", bool: "true/false values"}


class Located(NamedTuple):
    """Where an error lies, in the user's terms."""

    # the keys (and list indices) the user wrote, down to the deepest field reached
    path: tuple[str | int, ...]
    field: FieldInfo | None  # that field's definition; None at the top
    trail: tuple[int, ...]  # list indices after that field (into a list of models)


def accepted_keys(model: type[BaseModel]) -> list[str]:
    """The keys ``model`` accepts: its field names, or every alias of fields that have several.

    Args:
        model: a pydantic model class.

    Returns:
        The keys, in field order.
    """
    keys = []
    for name, info in model.model_fields.items():
        alias = info.validation_alias
        keys += [str(k) for k in alias.choices] if isinstance(alias, AliasChoices) else [name]
    return keys


def _field(model: type[BaseModel], key: str) -> FieldInfo | None:
    for name, info in model.model_fields.items():
        alias = info.validation_alias
        if key == name or (isinstance(alias, AliasChoices) and key in alias.choices):
            return info
    return None


def _members(annotation: Any) -> list[Any]:
    """The members of a union (``X | None`` gives ``[X]``), or ``[annotation]``."""
    if get_origin(annotation) in (Union, types.UnionType):
        return [m for arg in get_args(annotation) if arg is not type(None) for m in _members(arg)]
    return [annotation]


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """``Annotated[int, Field(ge=1)]`` -> ``(int, [Ge(1)])``."""
    if get_origin(annotation) is not Annotated:
        return annotation, []
    base, *extra = get_args(annotation)
    return base, [m for item in extra for m in (item.metadata if isinstance(item, FieldInfo) else [item])]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The model classes a value of ``annotation`` may hold, at any depth of unions, lists and tuples."""
    found = []
    for member in _members(annotation):
        member, _ = _unwrap(member)
        if isinstance(member, type) and issubclass(member, BaseModel):
            found.append(member)
        elif get_origin(member) in (list, tuple):
            found.extend(m for arg in get_args(member) for m in _models_in(arg))
    return found


def _is_tag(part: str, candidates: list[type[BaseModel]]) -> bool:
    return "[" in part or part in _TYPE_TAGS or part in {m.__name__ for m in candidates}


def locate(model: type[BaseModel], loc: Sequence[str | int]) -> Located:
    """The deepest field of ``model`` that pydantic's location ``loc`` reaches, and the user's path to it.

    List indices are kept on the way into a list of models (``training.fused_shared_input_lora.0.parent_name``);
    indices and keys inside a plain list, tuple or mapping are not (the error is the whole field's).

    Args:
        model: the model that was validated.
        loc: an error's ``loc``: keys, list indices and the tags of tried union members.

    Returns:
        The path, the field's definition, and the list indices after it.
    """
    path: list[str | int] = []
    best = Located((), None, ())
    candidates = [model]
    for part in loc:
        if isinstance(part, int):
            path.append(part)
            best = best._replace(trail=(*best.trail, part))
            continue
        if _is_tag(part, candidates):
            candidates = [m for m in candidates if m.__name__ == part] or candidates
            continue
        info = next((f for m in candidates if (f := _field(m, part)) is not None), None)
        if info is None:
            break
        path.append(part)
        best = Located(tuple(path), info, ())
        candidates = _models_in(info.annotation)
    return best


def _choice(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def word_join(parts: Sequence[str], conjunction: str = "or") -> str:
    """``a, b or c`` (``conjunction`` before the last part)."""
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} {conjunction} {parts[-1]}"


def _bounds(metadata: Sequence[Any]) -> str:
    texts = [
        f"{sign} {getattr(m, attr)}" for m in metadata for cls, attr, sign in _BOUNDS if isinstance(m, cls)
    ]
    return " " + " and ".join(texts) if texts else ""


def _plural(annotation: Any) -> str:
    annotation, metadata = _unwrap(annotation)
    if get_origin(annotation) is Literal:
        return word_join([_choice(c) for c in get_args(annotation)])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"mappings with keys {word_join(list(annotation.model_fields), 'and')}"
    return _PLURALS.get(annotation, "values") + _bounds(metadata)


def _kind(annotation: Any, metadata: Sequence[Any], choices: Sequence[str] = ()) -> str:
    """One member of a field's type, in words: ``a whole number >= 1``, ``a list of strings``, ``a list of them``
    (of the field's ``choices``), ..."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is int:
        return "a whole number" + _bounds(metadata)
    if annotation is float:
        return "a number" + _bounds(metadata)
    if annotation is str:
        return "a string"
    if origin is list:
        least = next((m.min_length for m in metadata if isinstance(m, annotated_types.MinLen)), 0)
        items = _plural(args[0])
        if choices and items == word_join(choices):
            return f"a list of {f'at least {least} of ' if least else ''}them"
        return f"a list of {f'at least {least} ' if least else ''}{items}"
    if origin is tuple:
        return f"a list of {len(args)} {_plural(args[0])}"
    if origin is dict:
        return "a mapping of names to values"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"a mapping of settings such as {', '.join(list(annotation.model_fields)[:3])}"
    return f"a value of type {getattr(annotation, '__name__', annotation)}"


def describe(field: FieldInfo) -> str:
    """What a valid value of ``field`` is, in words: its choices (booleans and literals), then its other types.

    Args:
        field: a field's definition (its annotation and constraints).

    Returns:
        E.g. ``a whole number >= 1``, ``true, false or 'auto'``, ``a list of strings or a string``, ``'a', 'b' or a
        list of them``.
    """
    choices: list[str] = []
    kinds: list[str] = []
    for member in _members(field.annotation):
        member, metadata = _unwrap(member)
        if member is bool:
            choices += ["true", "false"]
        elif get_origin(member) is Literal:
            choices += [_choice(c) for c in get_args(member)]
        else:
            kinds.append(_kind(member, [*field.metadata, *metadata], choices))
    return word_join([*choices, *kinds])


def _choices(field: FieldInfo) -> list[str]:
    """The string values a field's literals allow (for a "did you mean" on a misspelt one)."""
    members = (_unwrap(m)[0] for m in _members(field.annotation))
    return [c for m in members if get_origin(m) is Literal for c in get_args(m) if isinstance(c, str)]


def example(field: FieldInfo) -> Any:
    """A good value of ``field``: its first ``examples`` entry, else its default when that shows something.

    Args:
        field: a field's definition.

    Returns:
        The value; ``None`` when the field has no examples and its default is None, empty, or a whole section.
    """
    if field.examples:
        return field.examples[0]
    default = field.default
    empty = isinstance(default, list | dict | tuple) and not default
    if default is PydanticUndefined or default is None or empty or isinstance(default, BaseModel):
        return None
    return default


def as_yaml(value: Any) -> str:
    """``value`` as it is written in a YAML config (flow style, one line), e.g. ``[q_proj, v_proj]``.

    Args:
        value: plain data (numbers, strings, booleans, None, lists, mappings).

    Returns:
        The YAML text.
    """
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf, sort_keys=False)
    return text.removesuffix("\n...\n").rstrip("\n")


def type_error_line(where: str, field: FieldInfo, value: Any) -> str:
    """The line for a value of the wrong type or out of range.

    Args:
        where: the printed location, e.g. ``training.batch_size``.
        field: the field's definition.
        value: what the user wrote.

    Returns:
        ``where: must be <what>, e.g. where: <example> (got <value>)``, plus what another tool's value is in
        loralei (:data:`.renames.FOREIGN_VALUES`) or a "did you mean" for a misspelt choice.
    """
    good = example(field)
    what = describe(field)
    if isinstance(value, float) and not math.isfinite(value):  # inf and nan are refused (allow_inf_nan=False)
        what = what.replace("a number", "a finite number", 1) if "a number" in what else f"finite, {what}"
    hint = ""
    if isinstance(value, str):
        foreign = FOREIGN_VALUES.get((where, value))
        hint = f" ({foreign})" if foreign else did_you_mean(value, _choices(field))
    shown = f", e.g. {where}: {as_yaml(good)}" if good is not None else ""
    return f"{where}: must be {what}{shown} (got {value!r}){hint}"


def _value_at(raw: Any, path: Sequence[str | int], fallback: Any) -> Any:
    """What the user wrote at ``path`` in ``raw`` (``fallback`` when ``path`` does not lead anywhere)."""
    for part in path:
        try:
            raw = raw[part]
        except (KeyError, IndexError, TypeError):
            return fallback
    return raw


def _problem(where: str, located: Located, errors: list[dict[str, Any]], raw: Any) -> str:
    """The line for the errors pydantic reported at one field."""
    value = _value_at(raw, located.path, errors[0].get("input"))
    own = [e["msg"].removeprefix("Value error, ") for e in errors if e["type"] in _OWN_MESSAGES]
    if own:
        # A check across fields (no location) names its fields itself; echoing the whole input adds noise.
        got = f" (got {value!r})" if located.path else ""
        return f"{where}: {'; '.join(dict.fromkeys(own))}{got}"
    if located.field is None:
        return f"{where}: {errors[0]['msg']}"
    if all(e["type"] == "missing" for e in errors):
        good = example(located.field)
        shown = f", e.g. {where}: {as_yaml(good)}" if good is not None else ""
        return f"{where}: is required but missing{shown}"
    return type_error_line(where, located.field, value)


def _unknown_key(
    err: dict[str, Any], model: type[BaseModel], section: str, sections: Mapping[str, Collection[str]]
) -> tuple[tuple[str | int, ...], str]:
    """The user's path to an unknown key, and the end of its line (after the location)."""
    parent = locate(model, err["loc"][:-1])
    holder = _models_in(parent.field.annotation)[0] if parent.field else model
    key = str(err["loc"][-1])
    path = (*parent.path, *parent.trail)
    written_in = ".".join(str(p) for p in (section, *path) if p != "")
    hint = unknown_key_hint(key, written_in, accepted_keys(holder), sections)
    return (*path, key), f"unknown key{hint}; remove it or fix its spelling"


def error_lines(
    errors: Sequence[dict[str, Any]],
    model: type[BaseModel],
    raw: Any,
    *,
    prefix: str = "",
    section: str = "",
    sections: Mapping[str, Collection[str]] | None = None,
) -> list[str]:
    """One line per problem of ``raw`` as validated by ``model``, in the order pydantic found them.

    Args:
        errors: ``ValidationError.errors()``.
        model: the model that was validated.
        raw: the input it was given (to quote whole values where pydantic points inside them).
        prefix: prepended to every printed location, e.g. ``"lora."``.
        section: the dotted config section that ``model`` stands for (``"lora"`` for ``LoRAConfig``), for the
            "did you mean" of unknown keys.
        sections: the accepted keys of every section known where ``raw`` was written, by dotted name
            (default: ``model``'s own, as ``section``).

    Returns:
        Lines like ``training.max_seq_length: must be a whole number >= 2, e.g. ... (got 1)``.
    """
    sections = sections if sections is not None else {section: accepted_keys(model)}
    # by the user's path, in the order pydantic found them: an unknown key's line, or a field's errors
    found: dict[tuple[str | int, ...], str | tuple[Located, list[dict[str, Any]]]] = {}
    for err in errors:
        if err["type"] == "extra_forbidden":
            path, text = _unknown_key(err, model, section, sections)
            found[path] = f"{_where(prefix, path)}: {text}"
        else:
            located = locate(model, err["loc"])
            entry = found.setdefault(located.path, (located, []))
            if isinstance(entry, tuple):
                entry[1].append(err)
    lines = []
    for path, entry in found.items():
        if isinstance(entry, str):
            lines.append(entry)
        # Where one member of a union got further into the value, its errors say more than the others'.
        elif not any(len(other) > len(path) and other[: len(path)] == path for other in found):
            lines.append(_problem(_where(prefix, path), *entry, raw))
    return lines


def _where(prefix: str, path: Sequence[str | int]) -> str:
    """The printed location: ``prefix`` + the dotted path, or the section itself (``"config"`` at the top)."""
    return prefix + ".".join(str(p) for p in path) if path else prefix.rstrip(".") or "config"
