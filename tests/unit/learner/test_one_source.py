"""One source per setting: the pydantic configs are where the learner's and the buffer's settings and
their defaults are written, and nothing else writes them again (docs/architecture.md §7).

The rule these tests enforce:

* **Engine settings** (:mod:`teamrl.learner.settings`): a field of a settings dataclass that mirrors a
  config field (``LearnerConfig``'s field of the same name, the LoRA shape in ``LoraSettings``, an
  adapter's overrides in ``AgentOverrides``) either has no default or takes it from that field with
  ``config_default(...)`` (a conversion around it, such as ``tuple(...)``, is allowed). A literal
  written as a field's default fails, even one that equals the config's today: two written copies
  drift (``dtype`` once defaulted to "auto" in the config and "float32" here, and a learner process
  and an engine built from keywords trained in different dtypes). The few fields with no config
  counterpart (listed in ``NOT_IN_CONFIG``) must not write a literal either. At run time every mirrored
  default equals the config's, and a field's type offers the config's choices (its ``Literal`` values,
  and, where it has a default, whether it takes None; a field without one holds a resolved value,
  such as an adapter's ``lr`` resolved from its ``None``-able override), so the choices cannot drift
  apart either.
* **The replay buffer** (:class:`teamrl.learner.buffer.ReplayBuffer`) takes its ``BufferConfig``: no
  parameter of its constructor is named after a config field (a keyword with a default of its own
  was a second copy; a ``buffer_kwargs`` table between them was a third).

These tests read source and signatures only: no model is built, they run in milliseconds.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel

from teamrl.learner import settings as S
from teamrl.learner.buffer import ReplayBuffer
from teamrl.learner.buffer_config import BufferConfig
from teamrl.learner.config import AgentOverrides, LearnerConfig, LoraSettings

SETTINGS_CLASSES = [
    S.AdapterSettings,
    S.ModelSettings,
    S.ObjectiveSettings,
    S.CriticSettings,
    S.OptimSettings,
    S.EngineSettings,
]
# a settings field -> the config model and field it mirrors, where the name is not the config's own
RENAMED: dict[tuple[type, str], tuple[type[BaseModel], str]] = {
    (S.ModelSettings, "lora_rank"): (LoraSettings, "rank"),
    (S.ModelSettings, "lora_alpha"): (LoraSettings, "alpha"),
    (S.ModelSettings, "lora_dropout"): (LoraSettings, "dropout"),
    (S.ModelSettings, "target_modules"): (LoraSettings, "target_modules"),
}
# fields no config field mirrors one to one (built from several, or the groups themselves)
NOT_IN_CONFIG = {
    (S.ModelSettings, "lora_ranks"),  # from each adapter's agents.<a>.rank
    (S.EngineSettings, "adapter_settings"),
    (S.EngineSettings, "model"),
    (S.EngineSettings, "objective"),
    (S.EngineSettings, "critic"),
    (S.EngineSettings, "optim"),
}


def mirrored(cls: type, name: str) -> tuple[type[BaseModel], str] | None:
    """The config model and field that settings field ``cls.name`` mirrors (None: listed as none)."""
    if (cls, name) in NOT_IN_CONFIG:
        return None
    if (cls, name) in RENAMED:
        return RENAMED[(cls, name)]
    model = AgentOverrides if cls is S.AdapterSettings else LearnerConfig
    assert name in model.model_fields, f"{cls.__name__}.{name} mirrors no field of {model.__name__}"
    return model, name


def written_defaults(cls: type) -> dict[str, ast.expr]:
    """Each field of dataclass ``cls`` that has a default, and the expression written for it."""
    (node,) = ast.parse(inspect.getsource(cls)).body
    assert isinstance(node, ast.ClassDef)
    return {
        st.target.id: st.value
        for st in node.body
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None
    }


def from_config(expr: ast.expr) -> bool:
    """Whether ``expr`` is ``config_default(...)``, possibly inside one-argument conversions."""
    if not isinstance(expr, ast.Call):
        return False
    if isinstance(expr.func, ast.Name) and expr.func.id == "config_default":
        return True
    return len(expr.args) == 1 and not expr.keywords and from_config(expr.args[0])


def literals(expr: ast.expr) -> list[str]:
    """The literal values and displays written in ``expr``."""
    kinds = (ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.Set)
    return [ast.unparse(n) for n in ast.walk(expr) if isinstance(n, kinds)]


def config_value(model: type[BaseModel], name: str) -> Any:
    value = model.model_fields[name].get_default(call_default_factory=True)
    return tuple(value) if isinstance(value, list) else value


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def choices(tp: Any) -> tuple[frozenset, bool]:
    """(the ``Literal`` values a type offers, whether it takes None); unions looked through."""
    if typing.get_origin(tp) is Literal:
        return frozenset(typing.get_args(tp)), False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        values: frozenset = frozenset()
        takes_none = False
        for arg in typing.get_args(tp):
            if arg is type(None):
                takes_none = True
            else:
                v, n = choices(arg)
                values, takes_none = values | v, takes_none or n
        return values, takes_none
    return frozenset(), False


def test_no_settings_field_writes_a_default_of_its_own() -> None:
    written_twice = []
    for cls in SETTINGS_CLASSES:
        for name, expr in written_defaults(cls).items():
            if mirrored(cls, name) is not None and not from_config(expr):
                written_twice.append(f"{cls.__name__}.{name} = {ast.unparse(expr)}")
            elif mirrored(cls, name) is None and literals(expr):
                written_twice.append(f"{cls.__name__}.{name} = {ast.unparse(expr)} (a literal)")
    assert not written_twice, f"defaults written outside the config: {written_twice}"


def test_every_mirrored_default_is_the_configs() -> None:
    for cls in SETTINGS_CLASSES:
        for f in dataclasses.fields(cls):
            source = mirrored(cls, f.name)
            default = field_default(f)
            if source is None or default is dataclasses.MISSING:
                continue
            assert default == config_value(*source), (cls.__name__, f.name)
    # the drift this rule removed: the engine's dtype is the config's ("auto")
    assert S.ModelSettings().dtype == LearnerConfig.model_fields["dtype"].default == "auto"


def test_every_mirrored_type_offers_the_configs_choices() -> None:
    for cls in SETTINGS_CLASSES:
        hints = typing.get_type_hints(cls, vars(S))
        for f in dataclasses.fields(cls):
            source = mirrored(cls, f.name)
            if source is None:
                continue
            model, name = source
            values, takes_none = choices(hints[f.name])
            want_values, want_none = choices(model.model_fields[name].annotation)
            assert values == want_values, (cls.__name__, f.name)
            if field_default(f) is not dataclasses.MISSING:  # without one: a resolved value, never None
                assert takes_none == want_none, (cls.__name__, f.name)


def test_the_replay_buffer_takes_its_settings_from_the_config() -> None:
    params = inspect.signature(ReplayBuffer.__init__).parameters
    own = sorted(set(params) & (set(BufferConfig.model_fields) | {"version_window"}))
    assert not own, f"ReplayBuffer.__init__ takes config fields as keywords of its own: {own}"
    assert list(params) == ["self", "cfg", "versions_from_data"]
    buf = ReplayBuffer(BufferConfig(capacity=7, group_size=3, sampler="uniform"))
    assert (buf.capacity, buf.group_size, buf.sampler) == (7, 3, "uniform")
