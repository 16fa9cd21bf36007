"""Typed configuration objects built from ``params.yaml``.

Each DVC stage reads its own key of ``params.yaml`` into a frozen dataclass. Unknown keys and
wrong types are errors that name the key, so a typo in params never silently falls back to a
default.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A params value is missing, unknown or of the wrong type; the message names the key."""


def load_params(path: str | Path = "params.yaml") -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} not found: run from the repository root, or pass the params file path")
    with path.open(encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of stage names to their params")
    return data


def _check(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return _check(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: may not be null")
    if dataclasses.is_dataclass(tp):
        return from_mapping(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (arg, *_rest) = typing.get_args(tp) or (Any,)
        items = [_check(v, arg, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


FLAT = "flat"  # field metadata: a shared section whose keys sit in params beside the stage's own


def flat_section(default: Any) -> Any:
    """A dataclass field holding a shared config section (checkpoints, the optimizer, ...) whose keys
    are written in params at the stage's own level: ``train_ar.checkpoint_every``, not
    ``train_ar.checkpoint.checkpoint_every``."""
    return dataclasses.field(default=default, metadata={FLAT: True})


def without_keys(obj: Any, dotted: tuple[str, ...]) -> dict[str, Any]:
    """``dataclasses.asdict(obj)`` less the keys named (``a`` or ``a.b`` for a nested one)."""
    d = dataclasses.asdict(obj)
    for path in dotted:
        *parents, last = path.split(".")
        node = d
        for p in parents:
            node = node.get(p, {})
        node.pop(last, None)
    return d


def from_mapping(cls: type[T], data: Any, where: str) -> T:
    """Build dataclass ``cls`` from a mapping; ``where`` is the params key path for messages."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    flat = {name: [sub.name for sub in dataclasses.fields(hints[name])]
            for name, f in fields.items() if f.metadata.get(FLAT)}
    known = (set(fields) - set(flat)) | {key for keys in flat.values() for key in keys}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known keys are {sorted(known)}")
    kwargs = {}
    for name, field in fields.items():
        key = f"{where}.{name}"
        if name in flat:
            kwargs[name] = from_mapping(hints[name], {k: data[k] for k in flat[name] if k in data}, where)
        elif name in data:
            kwargs[name] = _check(data[name], hints[name], key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key} is required")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(where)
    return obj


def stage_config(cls: type[T], stage: str, params: dict[str, Any]) -> T:
    if stage not in params:
        raise ConfigError(f"params.yaml has no '{stage}' section")
    return from_mapping(cls, params[stage], stage)
