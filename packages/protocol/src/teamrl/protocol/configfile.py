"""Reading typed configs: TOML file -> one table -> dotted ``--set`` overrides -> pydantic model.

One loader for every service and the CLI, so a bad config fails the same way everywhere: in well
under a second, before any model loads, naming the field, the value and what was expected.
Overrides are ``key=value`` strings (dotted keys reach nested tables) whose value is parsed as a
TOML literal (``lr=3e-4``, ``mode="sync"``, ``agents=["a","b"]``); a bare word that is not valid
TOML is taken as a string. Nothing is copied between sections: validators only check.

It lives in ``teamrl.protocol`` because every package already depends on it (and it needs only
pydantic and the standard library).
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config file or override is wrong; the message says where, what, and what was expected."""


def parse_override(item: str, error: type[ConfigError] = ConfigError) -> tuple[list[str], Any]:
    if "=" not in item:
        raise error(f"override {item!r}: expected KEY=VALUE, e.g. lr=3e-4")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise error(f"override {item!r}: empty key segment")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word: take it as a string
    return key.split("."), value


def apply_overrides(
    data: dict[str, Any], overrides: list[str], error: type[ConfigError] = ConfigError
) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item, error)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise error(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def format_validation_error(err: ValidationError, source: str, prefix: str = "") -> str:
    """One line per problem: ``prefix.field: got <value>; expected: <pydantic's message>``."""
    lines = [f"invalid config ({source}): {err.error_count()} problem(s)"]
    for e in err.errors():
        loc = ".".join([*([prefix] if prefix else []), *(str(p) for p in e["loc"])]) or "<root>"
        given = e.get("input")
        shown = repr(given) if not isinstance(given, dict) else "{...}"
        if len(shown) > 80:
            shown = shown[:77] + "..."
        lines.append(f"  - {loc}: got {shown}; expected: {e['msg']}")
    return "\n".join(lines)


def load_toml(path: str | Path, error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise error(f"config file {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise error(f"config file {str(p)!r} is not valid TOML: {exc}") from None


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


def load_section(
    model: type[M],
    path: str | Path | None,
    section: str,
    overrides: list[str] | None = None,
    *,
    flags: Mapping[str, Any] | None = None,
    whole_file: bool = False,
    error: type[ConfigError] = ConfigError,
) -> M:
    """A service's config: the ``[section]`` table of ``path`` (no file: defaults), then the
    ``--set`` overrides, then ``flags`` that were given (``None`` = not given).

    ``whole_file``: a file without ``[section]`` is the section itself (a file of one service's
    settings). Raises ``error`` (a ``ConfigError``) naming ``section.field``, the value and the
    expectation.
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        raw = load_toml(path, error)
        table = raw.get(section, raw if whole_file else {})
        if not isinstance(table, dict):
            raise error(f"{path}: {section} must be a table ([{section}]), got {type(table).__name__}")
        data = dict(table)
        source = f"{path} [{section}]"
    apply_overrides(data, list(overrides or []), error)
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    data.update(given)
    if overrides or given:
        source += " + flags"
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise error(format_validation_error(err, source, section)) from None
