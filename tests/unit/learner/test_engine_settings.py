"""The engine's frozen settings (``teamrl.learner.settings``): one name per setting, from the config
to the engine, and flat keywords that round-trip. No model is built: this runs in milliseconds."""

from __future__ import annotations

import dataclasses

import pytest

from teamrl.learner.config import LearnerConfig
from teamrl.learner.errors import LearnerError
from teamrl.learner.settings import AdapterSettings, EngineSettings

ADAPTERS = {"a": AdapterSettings(lr=1e-3, clip_low=0.2, clip_high=0.3)}


def test_every_setting_has_one_flat_name_and_the_keywords_round_trip() -> None:
    names = EngineSettings.names()
    assert len(names) == len(set(names))  # no name in two groups
    s = EngineSettings.from_kwargs(ADAPTERS, lora_rank=4, objective="ppo", epochs=3, critic_level="token")
    assert (s.model.lora_rank, s.objective.objective, s.optim.epochs, s.critic.critic_level) == (
        4,
        "ppo",
        3,
        "token",
    )
    assert EngineSettings.from_kwargs(**s.kwargs()) == s
    assert s.replace(epochs=1).optim.epochs == 1 and s.optim.epochs == 3  # frozen: a new object
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.optim.epochs = 2  # type: ignore[misc]
    with pytest.raises(TypeError, match="lora_rnak"):
        EngineSettings.from_kwargs(ADAPTERS, lora_rnak=4)
    with pytest.raises(LearnerError, match="objective"):
        EngineSettings.from_kwargs(ADAPTERS, objective="ppo2")


def test_adapters_take_the_engine_wide_values_they_do_not_set() -> None:
    s = EngineSettings.from_kwargs(
        {"a": ADAPTERS["a"], "b": dataclasses.replace(ADAPTERS["a"], temperature=0.5, micro_batch_rows=3)},
        temperature=0.9,
        kl_coef=0.01,
        micro_batch_rows=16,
    )
    r = s.resolved(["a", "b"])
    assert (r["a"].temperature, r["a"].kl_coef, r["a"].micro_batch_rows) == (0.9, 0.01, 16)
    assert (r["b"].temperature, r["b"].kl_coef, r["b"].micro_batch_rows) == (0.5, 0.01, 3)
    with pytest.raises(LearnerError, match="no optimiser settings"):
        s.resolved(["a", "c"])


def test_the_config_fills_every_setting_from_its_field_of_the_same_name() -> None:
    cfg = LearnerConfig(
        adapters=["a", "b"],
        lora={"rank": 4, "alpha": 8.0},
        agents={"b": {"rank": 16, "lr": 1e-3}},
        objective="ppo-critic",
        critic_level="token",
        epochs=2,
        seed=7,
        tis_cap=None,
        probe_prompt=[1],
        probe_completion=[2],
    )
    s = EngineSettings.from_config(cfg)
    assert (s.model.lora_rank, s.model.lora_alpha, dict(s.model.lora_ranks)) == (4, 8.0, {"b": 16})
    assert s.model.target_modules == tuple(cfg.lora.target_modules)
    for name, value in s.kwargs().items():
        if hasattr(cfg, name) and name != "adapter_settings":
            assert value == getattr(cfg, name), name
    assert s.adapter_settings["b"].lr == 1e-3 and s.adapter_settings["a"].lr == cfg.lr


def test_an_adapters_choices_are_distinct_token_ids() -> None:
    from pydantic import ValidationError

    base = {"adapters": ["a"], "probe_prompt": [1], "probe_completion": [2]}
    for ids, why in (([5, 5], "distinct"), ([5, -1], "distinct"), ([5], "at least 2")):
        with pytest.raises(ValidationError, match=why):
            LearnerConfig(**base, agents={"a": {"allowed_token_ids": ids}})
    s = EngineSettings.from_config(LearnerConfig(**base, agents={"a": {"allowed_token_ids": [7, 5]}}))
    assert s.adapter_settings["a"].allowed_token_ids == (7, 5)
