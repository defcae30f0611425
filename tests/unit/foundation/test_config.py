"""Config loading: TOML + dotted overrides -> pydantic, with errors that name field, value and expectation."""

from typing import Literal

import pytest
from pydantic import BaseModel, Field

from teamrl.cli.config import ConfigError, apply_overrides, dump_toml, load_config, parse_override


class Inner(BaseModel):
    lr: float = Field(1e-3, gt=0)
    mode: Literal["sync", "async"] = "async"


class Outer(BaseModel):
    model_config = {"extra": "forbid"}
    name: str = "x"
    learner: Inner = Inner()


def test_overrides_parse_toml_literals():
    assert parse_override("learner.lr=3e-4") == (["learner", "lr"], 3e-4)
    assert parse_override("name=hello") == (["name"], "hello")
    assert parse_override('agents=["a", "b"]') == (["agents"], ["a", "b"])
    with pytest.raises(ConfigError):
        parse_override("no-equals-sign")


def test_load_with_file_and_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('name = "run1"\n[learner]\nlr = 0.01\n')
    cfg = load_config(Outer, f, ["learner.mode=sync"])
    assert cfg.name == "run1" and cfg.learner.lr == 0.01 and cfg.learner.mode == "sync"


def test_bad_value_names_field_value_and_expectation(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(Outer, None, ["learner.lr=-1"])
    msg = str(e.value)
    assert "learner.lr" in msg and "-1" in msg and "greater than 0" in msg
    with pytest.raises(ConfigError) as e:
        load_config(Outer, None, ["learner.mode=fast"])
    assert "learner.mode" in str(e.value) and "'fast'" in str(e.value)


def test_unknown_key_and_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="typo"):
        load_config(Outer, None, ["typo=1"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(Outer, bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Outer, tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not a section"):
        apply_overrides({"name": "x"}, ["name.sub=1"])


def test_dump_round_trips():
    import tomllib

    cfg = Outer(name='a "q"', learner=Inner(lr=0.5))
    assert Outer.model_validate(tomllib.loads(dump_toml(cfg))) == cfg


def test_none_is_left_out_not_written_as_empty_string():
    import tomllib

    from teamrl.cli.config import to_toml

    data = {"a": None, "b": 1, "t": {"c": None, "d": "x", "rows": [{"e": None, "f": 2}]}}
    text = to_toml(data)
    assert '""' not in text
    assert tomllib.loads(text) == {"b": 1, "t": {"d": "x", "rows": [{"f": 2}]}}
