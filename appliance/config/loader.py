"""Load the YAML config, apply environment and `--set` overrides, check every value.

Precedence, lowest first: dataclass defaults < YAML file < `APPLIANCE_*` environment
variables < `--set section.key=value`. Override values are parsed as YAML (`64` is an int,
`null` is None, `[1, 2]` a list). An environment variable names its key with a double
underscore between section and key: `APPLIANCE_SCHEDULER__MAX_NUM_SEQS=64` sets
`scheduler.max_num_seqs`. `APPLIANCE_CONFIG` names the config file when `--config` is not
given.

Every failure is a `ConfigError` whose key is the dotted path (`scheduler.max_num_seqs`)
and whose reason says what was wrong and where the value came from.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from appliance.config.schema import SECTIONS, AppConfig
from engine.config import ConfigError

ENV_PREFIX = "APPLIANCE_"
ENV_CONFIG_FILE = "APPLIANCE_CONFIG"
_REDACTED = "<redacted>"
# Values hidden by `config show` (secrets).
_SECRET_KEYS = {("server", "api_keys"), ("telemetry", "otlp_headers")}

# section -> key -> (value, source)
_Raw = dict[str, dict[str, tuple[Any, str]]]


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        value_tp = typing.get_args(tp)[1]
        if dataclasses.is_dataclass(value_tp):
            return f"a mapping of names to {value_tp.__name__} settings"
        return "a mapping of strings"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        tp, "null" if tp is type(None) else str(tp)
    )


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks `value` against the annotation `tp`; converts YAML lists to tuples."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(value, inner[0], key)
    elif origin is tuple:
        item_tp = typing.get_args(tp)[0]
        if isinstance(value, str) and item_tp is str:
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list | tuple):
            return tuple(_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    elif origin is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
        if isinstance(value, Mapping):
            cls = typing.get_args(tp)[1]
            return {str(k): _build_entry(cls, v, f"{key}.{k}") for k, v in value.items()}
    elif origin is dict:
        if isinstance(value, str):  # OTEL_EXPORTER_OTLP_HEADERS style: k=v,k2=v2
            pairs = [p.split("=", 1) for p in value.split(",") if p.strip()]
            if all(len(p) == 2 for p in pairs):
                value = {k.strip(): v.strip() for k, v in pairs}
        if isinstance(value, Mapping) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            return dict(value)
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _build_entry(cls: type, value: Any, key: str) -> Any:
    """One entry of a mapping of settings (a tenant of `server.tenants`): each of its keys
    checked against `cls`'s fields; errors name `key.field`."""
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"expected a mapping of settings, got {type(value).__name__}")
    types_ = _field_types(cls)
    kwargs = {}
    for k, v in value.items():
        if k not in types_:
            raise ConfigError(f"{key}.{k}", f"unknown key; expected one of {list(types_)}")
        kwargs[k] = _coerce(v, types_[k], f"{key}.{k}")
    return cls(**kwargs)


def _set(raw: _Raw, dotted: str, value: Any, source: str) -> None:
    parts = dotted.strip().split(".")
    section = parts[0]
    if section not in SECTIONS:
        raise ConfigError(
            dotted, f"unknown section {section!r} (from {source}); expected one of {list(SECTIONS)}"
        )
    if len(parts) == 2:
        raw.setdefault(section, {})[parts[1]] = (value, source)
    elif len(parts) == 3 and _field_types(SECTIONS[section]).get(parts[1]) == dict[str, str]:
        entry = raw.setdefault(section, {}).get(parts[1], ({}, source))[0]
        merged = {**(entry if isinstance(entry, Mapping) else {}), parts[2]: value}
        raw[section][parts[1]] = (merged, source)
    else:
        raise ConfigError(dotted, f"expected section.key (from {source})")


def parse_set(text: str) -> tuple[str, Any]:
    """`scheduler.max_num_seqs=64` -> ("scheduler.max_num_seqs", 64)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(text, "--set expects section.key=value")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(key.strip(), f"value {value!r} is not valid YAML: {e}") from None
    return key.strip(), _plain_word(value, parsed)


def _plain_word(raw: str, parsed: Any) -> Any:
    """A one-word value YAML reads as a mapping only because of its colons (`:memory:`,
    SQLite's in-memory store) is the string typed: a mapping on the command line is written
    `{k: v}` or `k: v`, both with a space or a brace."""
    if isinstance(parsed, dict) and not any(c in raw for c in " {\t"):
        return raw.strip()
    return parsed


def env_overrides(environ: Mapping[str, str]) -> list[tuple[str, Any, str]]:
    """(dotted key, YAML-parsed value, variable name) for every APPLIANCE_SECTION__KEY."""
    out = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
        try:
            value = yaml.safe_load(environ[name]) if environ[name].strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(dotted, f"{name} is not valid YAML: {e}") from None
        out.append((dotted, _plain_word(environ[name], value), name))
    return out


def _read_file(path: str | Path, raw: _Raw) -> None:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ConfigError("config", f"cannot read {p}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError("config", f"{p} is not valid YAML: {e}") from None
    if data is None:
        return
    if not isinstance(data, Mapping):
        raise ConfigError("config", f"{p} must be a mapping of sections")
    for section, body in data.items():
        if section not in SECTIONS:
            raise ConfigError(
                str(section), f"unknown section in {p}; expected one of {list(SECTIONS)}"
            )
        if body is None:
            continue
        if not isinstance(body, Mapping):
            raise ConfigError(str(section), f"must be a mapping in {p}")
        for key, value in body.items():
            raw.setdefault(section, {})[str(key)] = (value, str(p))


def _build_section(section: str, values: dict[str, tuple[Any, str]]) -> Any:
    cls = SECTIONS[section]
    types_ = _field_types(cls)
    kwargs = {}
    for key, (value, source) in values.items():
        dotted = f"{section}.{key}"
        if key not in types_:
            raise ConfigError(
                dotted, f"unknown key (from {source}); expected one of {list(types_)}"
            )
        try:
            kwargs[key] = _coerce(value, types_[key], dotted)
        except ConfigError as e:
            raise ConfigError(e.key, f"{e.reason} (from {source})") from None
    try:
        return cls(**kwargs)
    except ConfigError as e:
        sources = {
            values[k][1]
            for k in values
            if e.key == f"{section}.{k}" or e.key.startswith(f"{section}.{k}.")
        }
        suffix = f" (from {sources.pop()})" if sources else ""
        raise ConfigError(e.key, f"{e.reason}{suffix}") from None


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> AppConfig:
    """Builds the effective config; raises ConfigError naming the key on any bad value.

    `environ` defaults to no environment at all, so tests and library callers are not
    affected by the caller's shell; the CLI passes `os.environ`.
    """
    environ = environ or {}
    raw: _Raw = {}
    path = path if path is not None else environ.get(ENV_CONFIG_FILE) or None
    if path is not None:
        _read_file(path, raw)
    for dotted, value, name in env_overrides(environ):
        _set(raw, dotted, value, name)
    for text in overrides:
        dotted, value = parse_set(text)
        _set(raw, dotted, value, "--set")
    cfg = AppConfig(**{s: _build_section(s, raw.get(s, {})) for s in SECTIONS})
    try:
        cfg.engine_config()  # surfaces graphs.* errors at load time
    except ConfigError as e:
        section, _, key = e.key.partition(".")
        source = raw.get(section, {}).get(key, (None, None))[1]
        raise ConfigError(e.key, f"{e.reason} (from {source})" if source else e.reason) from None
    return cfg


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def config_to_dict(cfg: AppConfig, redact: bool = True) -> dict[str, dict[str, Any]]:
    """Plain nested dict (lists, not tuples); secrets replaced unless `redact` is False."""
    out: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        obj = getattr(cfg, section)
        body = {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if redact and section == "server":
            for tenant in body["tenants"].values():
                tenant["keys"] = [_REDACTED] * len(tenant["keys"])
        for sec, key in _SECRET_KEYS:
            if redact and sec == section and body[key]:
                v = body[key]
                body[key] = (
                    {k: _REDACTED for k in v} if isinstance(v, dict) else [_REDACTED] * len(v)
                )
        out[section] = body
    return out


def dump_config(cfg: AppConfig, redact: bool = True) -> str:
    """The effective config as YAML (what `appliance config show` prints)."""
    return yaml.safe_dump(config_to_dict(cfg, redact), sort_keys=False, default_flow_style=False)
