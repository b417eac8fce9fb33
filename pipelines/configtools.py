"""Between Hydra's mutable DictConfig and the frozen dataclasses that stages receive.

Hydra cannot apply overrides to a frozen structured config ("Cannot set value of read-only config
node"), yet stages must get frozen configs. So the frozen dataclasses are the single source of
truth; `hydra_schema` derives a mutable twin for the ConfigStore (types and defaults only), and
`from_dict` builds the frozen objects back from the composed config, running each class's
`__post_init__` checks and rejecting keys no schema knows (Hydra accepts `+foo=1` silently).

A `TargetConfig` group (model, data: Hydra's `_target_` plus the factory's own keyword arguments)
is open: its schema twin is a plain dict, `from_dict` keeps the keys it declares and hands every
other one to the factory as `kwargs`, and `to_jsonable` writes it back in that same flat form.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Union

from common.errors import ConfigError
from training.config import TARGET_KEY, TargetConfig

_NONE = type(None)


class Tagged:
    """A config group whose options each have a schema of their own, chosen by the group's `name`
    key (the launchers: Ray's and Slurm's options are theirs alone). Hydra sees the group as an open
    mapping; `from_dict` builds the option's own schema and names, for a key that belongs to
    another option, the option that has it. Subclasses are frozen dataclasses with a `name` field."""

    @classmethod
    def schemas(cls) -> dict[str, type]:
        raise NotImplementedError


def _is_tagged(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, Tagged)


def tagged_schema(cls: type, data: dict[str, Any], path: str) -> type:
    """The schema of the option `data` names; a key it lacks but another option has is an error
    naming that option (before `from_dict`'s generic unknown-key error)."""
    schemas = cls.schemas()
    name = data.get("name", cls().name)
    schema = schemas.get(name, cls)  # an unknown name: the base's __post_init__ says so
    own = {f.name for f in dataclasses.fields(schema)}
    for key in sorted(set(data) - own):
        others = [n for n, other in schemas.items() if key in {f.name for f in dataclasses.fields(other)}]
        if others:
            from pipelines.redact import redact_tree

            group = path.rsplit(".", 1)[-1] if path else "name"
            raise ConfigError(f"{path}.{key}" if path else key, redact_tree(data[key], key),
                              f"an option of {group}={' and '.join(others)}, not of {group}={name}")
    return schema


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not _NONE]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


@functools.cache
def hydra_schema(cls: type) -> type:
    """A mutable dataclass with the same fields, types and defaults as frozen `cls`."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        tp = _twin_type(hints[f.name])
        if f.default is not dataclasses.MISSING:
            specs.append((f.name, tp, dataclasses.field(default=f.default)))
        elif f.default_factory is not dataclasses.MISSING:
            factory = f.default_factory
            if _is_target_config(factory) or _is_tagged(factory):
                # The declared keys' defaults, but no _target_: a group option must name its own.
                defaults = {k: v for k, v in to_jsonable(factory()).items() if k != TARGET_KEY}
                specs.append((f.name, tp, dataclasses.field(default_factory=lambda d=defaults: dict(d))))
                continue
            if dataclasses.is_dataclass(factory):
                twin = hydra_schema(factory)
                specs.append((f.name, tp, dataclasses.field(default_factory=twin)))
            else:
                specs.append((f.name, tp, dataclasses.field(default_factory=factory)))
        else:
            specs.append((f.name, tp))
    return dataclasses.make_dataclass(cls.__name__, specs)


def _twin_type(tp: Any) -> Any:
    inner, optional = _unwrap_optional(tp)
    if _is_target_config(inner) or _is_tagged(inner):
        return typing.Optional[dict[str, Any]] if optional else dict[str, Any]  # noqa: UP045
    if dataclasses.is_dataclass(inner):
        twin = hydra_schema(inner)
        return typing.Optional[twin] if optional else twin  # noqa: UP045 (OmegaConf needs Optional)
    origin = typing.get_origin(inner)
    if origin is dict:
        key, value = typing.get_args(inner)
        inner = dict[key, _twin_type(value)]
    elif origin is list:
        (item,) = typing.get_args(inner)
        inner = list[_twin_type(item)]
    return typing.Optional[inner] if optional else inner  # noqa: UP045


def _is_target_config(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, TargetConfig)


def _split_target(cls: type, data: dict[str, Any], path: str) -> dict[str, Any]:
    """`{_target_, <declared keys>, <anything else>}` -> the dataclass's fields, the rest as kwargs."""
    declared = {f.name for f in dataclasses.fields(cls)} - {"target", "kwargs"}
    if "target" in data or "kwargs" in data:
        bad = "target" if "target" in data else "kwargs"
        raise ConfigError(f"{path}.{bad}" if path else bad, data[bad], f"is reserved; name the factory with "
                          f"{TARGET_KEY} and give its arguments as keys of {path or 'the group'}")
    if TARGET_KEY not in data:
        raise ConfigError(f"{path}.{TARGET_KEY}" if path else TARGET_KEY, None,
                          "is missing: name the factory that builds it, e.g. my_pkg.models.build")
    fields = {k: v for k, v in data.items() if k in declared}
    fields["target"] = data[TARGET_KEY]
    fields["kwargs"] = {k: v for k, v in data.items() if k not in declared and k != TARGET_KEY}
    return fields


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build frozen dataclass `cls` from plain data, with errors that name the full key."""
    if not isinstance(data, dict):
        raise ConfigError(path or cls.__name__, data, f"must be a mapping of {cls.__name__} fields")
    if _is_target_config(cls):
        data = _split_target(cls, data, path)
    if _is_tagged(cls):
        cls = tagged_schema(cls, data, path)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        key = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ConfigError(key, data[unknown[0]], f"unknown key; valid keys here: {', '.join(names)}")
    kwargs = {
        name: _convert(hints[name], data[name], f"{path}.{name}" if path else name)
        for name in names
        if name in data
    }
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.prefixed(path) from None


def _convert(tp: Any, value: Any, path: str) -> Any:
    inner, optional = _unwrap_optional(tp)
    if value is None:
        if optional or inner is Any:
            return None
        raise ConfigError(path, value, "must not be null")
    if dataclasses.is_dataclass(inner):
        return from_dict(inner, value, path)
    origin = typing.get_origin(inner)
    if origin is dict:
        _, item = typing.get_args(inner)
        return {k: _convert(item, v, f"{path}.{k}") for k, v in value.items()}
    if origin is list:
        (item,) = typing.get_args(inner)
        return [_convert(item, v, path) for v in value]
    if inner is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def to_jsonable(obj: Any) -> Any:
    """Plain JSON data (dicts, lists, numbers, strings) from dataclasses and containers."""
    if isinstance(obj, TargetConfig):
        own = {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)
               if f.name not in ("target", "kwargs")}
        return {TARGET_KEY: obj.target, **own, **to_jsonable(obj.kwargs)}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    return obj


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; lists are kept as values."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out.update(flatten(value, name) if isinstance(value, dict) else {name: value})
    return out
