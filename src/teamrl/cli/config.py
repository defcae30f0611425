"""Reading typed configs: TOML file -> dotted CLI overrides -> pydantic model.

Design: one loader for every package's config model, so a bad config fails the same way everywhere:
in well under a second, before any model loads, naming the field, the value and what was expected.
Overrides are ``section.key=value`` strings whose value is parsed as a TOML literal (``lr=3e-4``,
``mode="sync"``, ``agents=["a","b"]``); a bare word that is not valid TOML is taken as a string.
Nothing is copied between sections: validators only check.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config file or override is wrong; the message says where, what, and what was expected."""


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. learner.lr=3e-4")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: empty key segment")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word: take it as a string
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}): {err.error_count()} problem(s)"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        given = e.get("input")
        shown = repr(given) if not isinstance(given, dict) else "{...}"
        if len(shown) > 80:
            shown = shown[:77] + "..."
        lines.append(f"  - {loc}: got {shown}; expected: {e['msg']}")
    return "\n".join(lines)


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None


def load_config(model: type[M], path: str | Path | None = None, overrides: list[str] | None = None) -> M:
    """Build ``model`` from an optional TOML file plus dotted overrides; raise ConfigError if invalid."""
    data = load_toml(path) if path is not None else {}
    apply_overrides(data, list(overrides or []))
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ConfigError(
            format_validation_error(err, str(path) if path else "defaults + overrides")
        ) from None


def dump_toml(cfg: BaseModel) -> str:
    """Write a resolved config as TOML (for the run folder). Only tables, scalars and lists occur."""
    return _to_toml(cfg.model_dump(mode="json"))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if v is None:
        return '""'
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else _toml_value(k)


def _to_toml(data: dict[str, Any], prefix: str = "") -> str:
    scalars = [(k, v) for k, v in data.items() if not isinstance(v, dict) and v is not None]
    tables = [(k, v) for k, v in data.items() if isinstance(v, dict)]
    out = [f"{_key(k)} = {_toml_value(v)}" for k, v in scalars]
    for k, v in tables:
        name = f"{prefix}.{_key(k)}" if prefix else _key(k)
        out.append(f"\n[{name}]")
        out.append(_to_toml(v, name))
    return "\n".join(x for x in out if x)
