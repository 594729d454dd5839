"""Field specs of the config schema: the type comes from the dataclass annotation, the allowed values from
``metadata`` (a range or a choice list), so every section declares each key once.

``num(lo, hi, ...)`` and ``one_of(names)`` build a dataclass field with no default: the values live in the
YAML tree (``config/config.yaml`` and its option files), the schema only says what they may be. A choice
list is a callable evaluated when checking, so it can read a registry (advantage estimators, losses,
simulator adapters) that is filled on import.

:func:`check_fields` walks a section dataclass and its nested sections and raises one
:class:`~embodirl.errors.ConfigError` naming the first key whose value is out of range or not a choice;
:func:`instance` converts a node to the section's dataclass, the typed object the code then runs on.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from embodirl.errors import ConfigError

AUTO = "auto"


def num(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False,
        null: bool = False, auto: bool = False, integer: bool = False) -> Any:
    """A number in ``[lo, hi]`` (an end is excluded with ``lo_open``/``hi_open``); ``null``: None allowed;
    ``auto``: the string ``auto`` allowed; ``integer``: an integer even where the annotation is ``Any``."""
    return dataclasses.field(default=MISSING, metadata={"range": (lo, hi, lo_open, hi_open), "null": null,
                                                        "auto": auto, "integer": integer})


def one_of(choices: Callable[[], Iterable] | Iterable, *, null: bool = False,
           known: Callable[[Any], bool] | None = None) -> Any:
    """One of ``choices`` (a tuple, or a callable returning the names, e.g. a registry's); ``known(value)``, when
    given, accepts a value the list does not hold yet (a component outside embodirl that registers itself under its
    module's dotted name when that module is imported)."""
    return dataclasses.field(default=MISSING, metadata={"choices": choices, "null": null, "known": known})


def required() -> Any:
    """A typed key with no further rule."""
    return dataclasses.field(default=MISSING)


def section(cls: type) -> Any:
    """A nested section (its own dataclass); its keys come from the YAML like every other key."""
    return dataclasses.field(default_factory=cls)


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def range_text(spec: tuple, integer: bool) -> str:
    lo, hi, lo_open, hi_open = spec
    kind = "integer" if integer else "number"
    if hi is None and lo == 0:
        return f"a positive {kind}" if lo_open else f"a non-negative {kind}"
    if hi is None and lo is not None:
        return f"greater than {_fmt(lo)}" if lo_open else (f"a positive {kind}" if integer and lo == 1
                                                          else f"a {kind} >= {_fmt(lo)}")
    if lo is None:
        return f"less than {_fmt(hi)}" if hi_open else f"at most {_fmt(hi)}"
    return f"in {'(' if lo_open else '['}{_fmt(lo)}, {_fmt(hi)}{')' if hi_open else ']'}"


def check_value(key: str, value: Any, meta: Mapping, integer: bool) -> None:
    """Raise :class:`ConfigError` on ``key`` when ``value`` breaks its field's rule."""
    if value is None and meta.get("null"):
        return
    if meta.get("auto") and value == AUTO:
        return
    extra = (" or null" if meta.get("null") else "") + (" or auto" if meta.get("auto") else "")
    if "range" in meta:
        lo, hi, lo_open, hi_open = meta["range"]
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and not (
            isinstance(value, float) and math.isnan(value))
        ok = number and (not integer or isinstance(value, int))
        ok = ok and (lo is None or (value > lo if lo_open else value >= lo))
        ok = ok and (hi is None or (value < hi if hi_open else value <= hi))
        if not ok:
            raise ConfigError(key, f"must be {range_text(meta['range'], integer)}{extra}, got {value!r}")
    if "choices" in meta:
        if meta.get("known") is not None and meta["known"](value):
            return
        choices = meta["choices"]
        names = list(choices() if callable(choices) else choices)
        if value not in names:
            raise ConfigError(key, f"'{value}' is not one of {', '.join(map(_name, names))}{extra}")


def _name(choice: Any) -> str:
    """A choice as the YAML spells it (true/false, not Python's True/False)."""
    return str(choice).lower() if isinstance(choice, bool) else str(choice)


def _is_int(annotation: Any) -> bool:
    """``int`` or ``Optional[int]`` (a resolved annotation: :func:`typing.get_type_hints`)."""
    return annotation is int or (typing.get_origin(annotation) in (typing.Union, types.UnionType)
                                 and int in typing.get_args(annotation))


def check_fields(schema: type, node: object, prefix: str) -> None:
    """Every ranged or choice field of ``schema`` (and of its nested section dataclasses) in ``node`` (a mapping; anything
    else has none of them)."""
    hints = typing.get_type_hints(schema)   # real types also where a module postpones its annotations
    for f in dataclasses.fields(schema):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = node.get(f.name) if isinstance(node, Mapping) else None
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            check_fields(f.default_factory, value or {}, key)
        elif f.metadata:
            check_value(key, value, f.metadata, f.metadata.get("integer") or _is_int(hints.get(f.name, f.type)))


def check_finite(node: Any, prefix: str = "") -> None:
    """Every float anywhere in ``node`` (a plain container) is finite: NaN and infinity are no setting of any key
    (``env.train.reward_coef=nan`` would train on NaN rewards for as long as the run lasts)."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            check_finite(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            check_finite(value, f"{prefix}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(prefix, f"must be a finite number, got {node}")


@functools.cache
def template(schema: type):
    """``OmegaConf.structured(schema)``, built once per section class: merging onto it copies it, so every merge
    starts from the same untouched template (building one costs a few milliseconds, and a run converts its sections
    several times while it checks and starts)."""
    return OmegaConf.structured(schema)


def instance(schema: type, node: Any, prefix: str):
    """``node`` (a section of a composed config: a DictConfig or a plain mapping, as a worker process receives it) as
    an instance of its dataclass ``schema``, with its types, ranges and choices checked (one
    :class:`~embodirl.errors.ConfigError` naming the first bad key under ``prefix``). An instance passes through.
    Convert once, where the code first takes the section, and pass the instance on."""
    if isinstance(node, schema):
        return node
    try:
        merged = OmegaConf.merge(template(schema), node)
    except OmegaConfBaseException as exc:
        key = str(getattr(exc, "full_key", "") or "")
        raise ConfigError(f"{prefix}.{key}" if key and prefix else (key or prefix), str(exc).splitlines()[0].strip()) from None
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ConfigError(f"{prefix}.{missing[0]}" if prefix else missing[0], "is missing from the configuration (see config/)")
    check_fields(schema, merged, prefix)
    return OmegaConf.to_object(merged)
