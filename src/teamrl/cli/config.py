"""Typed configs for the CLI: the shared loader (``teamrl.protocol.configfile``) and ``dump_toml``,
which writes a resolved config into the run folder."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

# The loader is shared with the services (teamrl.protocol.configfile); re-exported for the CLI.
from teamrl.protocol.configfile import (  # noqa: F401
    ConfigError,
    apply_overrides,
    format_validation_error,
    load_config,
    load_toml,
    parse_override,
)


def dump_toml(cfg: BaseModel) -> str:
    """Write a resolved config as TOML (for the run folder). Only tables, scalars and lists occur."""
    return _to_toml(cfg.model_dump(mode="json"))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON string escapes are TOML basic-string escapes
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
