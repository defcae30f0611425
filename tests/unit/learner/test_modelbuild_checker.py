"""``teamrl model build --kind checker`` (docs/verifier-learning.md): the recipe's folder, its cache
key, the ids it is trained on (BOS first, as rollouts encode them), and that the built checker checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from teamrl.learner import modelbuild
from teamrl.rewards.tokenizer import CharTokenizer, tokenizer_for


def test_a_short_checker_build_writes_a_model_folder_with_its_recipe(tmp_path: Path) -> None:
    out = modelbuild.build_checker(tmp_path / "checker", steps=2)
    meta = json.loads((out / "teamrl_model.json").read_text())
    assert meta["params"] == {
        "build_version": modelbuild.BUILD_VERSION,
        "steps": 2,
        "seed": 0,
        "recipe": "check",
    }
    assert set(meta["held_out_greedy_accuracy"]) == {"solver", "verifier"}
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert isinstance(tokenizer_for(out), CharTokenizer)  # served as the embedded model is: BOS first
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert modelbuild.build_checker(out, steps=2) == out  # same recipe: the cache is reused
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


def test_the_checker_trains_on_the_ids_rollouts_give_it(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    modelbuild.build_tokenizer(tmp_path)
    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    ids, labels = modelbuild._pack(tok, [("V058?07+45=", "052==R0;")], bos=True)
    served = CharTokenizer().encode("V058?07+45=")
    assert ids[0, : len(served)].tolist() == served and served[0] == tok.bos_token_id
    assert (labels[0, : len(served)] == -100).all()
    assert labels[0, len(served) :].tolist() == CharTokenizer().encode("052==R0;", add_special=False)


def test_unknown_recipe_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="recipe"):
        modelbuild.build(tmp_path / "x", steps=1, recipe="nonsense")


@pytest.mark.slow
def test_the_built_checker_tells_right_from_wrong(embedded_checker_model: Path) -> None:
    """Measured at build time on 200 held-out sums, half right, half off by one (a constant scores 0.5)."""
    meta = json.loads((embedded_checker_model / "teamrl_model.json").read_text())
    assert meta["held_out_greedy_accuracy"]["verifier"] >= 0.9
    assert meta["held_out_greedy_accuracy"]["solver"] >= 0.9
