"""Typed configs for the CLI: the shared loader (``teamrl.protocol.configfile``) and ``dump_toml``,
which writes a resolved config into the run folder (with ``tomli-w``)."""

from __future__ import annotations

from typing import Any

import tomli_w
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
    """Write a resolved config as TOML (for the run folder)."""
    return to_toml(cfg.model_dump(mode="json"))


def _without_none(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _without_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_without_none(x) for x in v]
    return v


def to_toml(data: dict[str, Any]) -> str:
    """``data`` as a TOML document. TOML has no null: a key whose value is None is left out (reading
    the file back gives the field its default). A None inside a list has no such reading and raises."""
    return tomli_w.dumps(_without_none(data))
