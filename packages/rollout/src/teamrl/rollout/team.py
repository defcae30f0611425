"""A workflow on a model folder, resolved and checked before any process starts.

``plan_team(source, model_dir)`` is what ``teamrl run``, ``teamrl eval`` and ``teamrl workflow
check`` ask first. It loads the workflow (built-in name, shipped name or TOML path), then checks
everything that would otherwise fail minutes later inside a service (docs/workflows.md lists the
checks):

* something is trained: at least one agent has an adapter; every trained agent runs on one base
  model (one learner group per base model is not started by ``teamrl run`` yet);
* every agent's profile and template, rendered with a held-out task, can be encoded by the model's
  tokenizer (chat template included);
* every adapter's rank fits the largest rank vLLM serves, and the LoRA target modules exist in the
  model's weights (taken from the architecture, not a fixed list);
* agents that share an adapter sample at one temperature (the learner recomputes each adapter's
  log-probs at its own), never greedily, with top_p 1.

It returns a :class:`TeamPlan`: the adapters with their own ranks and the agents sharing each, the
target modules, the held-out split, and a probe (prompt and completion token ids built from a
held-out task with the model's tokenizer) that the learner scores and every rollout must reproduce
before it uses new adapters. Everything workflow-specific the services need comes from here; no
service knows a built-in task.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from teamrl.rewards.tokenizer import Tokenizer, TokenizerError, tokenizer_for
from teamrl.rollout.workflow import Workflow, WorkflowError, _Missing, _prompt_ids, _TaskView

VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256)  # max_lora_rank values vLLM accepts (1 is too small to matter)
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
HELD_OUT_SPLITS = {"addition": "addition-held-out", "math-word": "math-word-held-out"}


@dataclass(frozen=True)
class TeamPlan:
    """What the services of one run need to agree on (``teamrl run`` writes it into RUN/config.toml)."""

    workflow: Workflow
    source: str  # the built-in/shipped name, or the TOML file's absolute path
    model_dir: Path
    model_id: str  # the workflow's id of the base model the trained agents run on
    adapters: dict[str, int]  # adapter -> LoRA rank, in the order agents first use them
    shared_by: dict[str, list[str]]  # adapter -> the agents that share it
    target_modules: list[str]
    temperatures: dict[str, float]  # adapter -> the temperature its agents sample at
    optimiser: dict[str, dict[str, float]]  # adapter -> the workflow's [adapters.X] learner settings
    max_lora_rank: int  # what the rollout's vLLM engine is started with
    probe_prompt: list[int]
    probe_completion: list[int]
    train_size: int
    held_out_size: int

    def summary(self) -> str:
        ranks = ", ".join(f"{a} (r={r}; {', '.join(self.shared_by[a])})" for a, r in self.adapters.items())
        return (
            f"workflow {self.workflow.name} ({self.source}): {len(self.workflow.agents)} agents, "
            f"{self.workflow.graph.kind} graph; adapters {ranks}; LoRA on {self.target_modules}; "
            f"tasks {self.train_size} train / {self.held_out_size} held out; model {self.model_dir}"
        )


def load_source(source: str | Path) -> tuple[Workflow, str]:
    """(workflow, canonical source): a name stays a name, a file becomes its absolute path."""
    from teamrl.rollout import workflows

    wf = workflows.load(source)
    name = str(source)
    if name in workflows.names():
        return wf, name
    return wf, str(Path(name).resolve())


def split_tasks(wf: Workflow, tasks_path: str | Path | None = None) -> tuple[list[dict], list[dict]]:
    """(train, held-out): the task set's own held-out split where it has one (``addition`` ->
    ``addition-held-out``), else the last tenth, which then is not trained on."""
    from teamrl.rollout.workflows import load_tasks, tasks_for

    all_tasks = tasks_for(wf, path=tasks_path or None)
    held_split = HELD_OUT_SPLITS.get(wf.tasks.builtin or "") if not tasks_path else None
    if held_split:
        return all_tasks, load_tasks(held_split, seed=wf.tasks.seed)
    k = max(1, len(all_tasks) // 10) if len(all_tasks) > 1 else 0
    return all_tasks[: len(all_tasks) - k], all_tasks[len(all_tasks) - k :]


def weight_names(model_dir: str | Path) -> list[str]:
    """Tensor names of a model folder's safetensors files, read from their headers (no torch)."""
    names: list[str] = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        names += [k for k in header if k != "__metadata__"]
    return names


def lora_targets(model_dir: str | Path) -> list[str]:
    """LoRA target modules from the architecture: the attention projections the weights have.

    Qwen2, Qwen3, Llama and Mistral name them ``q_proj``/``k_proj``/``v_proj``/``o_proj``; a model
    whose weights have none of them is refused, listing its linear layers."""
    names = weight_names(model_dir)
    if not names:
        raise WorkflowError(f"model {model_dir}: no *.safetensors weights to find LoRA target modules in")
    leaves = {n.rsplit(".", 2)[-2] for n in names if n.endswith(".weight") and n.count(".") >= 1}
    found = [m for m in ATTENTION_PROJECTIONS if m in leaves]
    if not found:
        raise WorkflowError(
            f"model {model_dir}: no attention projection among its layers {sorted(leaves)[:20]} "
            f"(LoRA targets {list(ATTENTION_PROJECTIONS)})"
        )
    return found


def plan_team(
    source: str | Path,
    model_dir: str | Path,
    *,
    tasks_path: str | Path | None = None,
    tokenizer: Tokenizer | None = None,
) -> TeamPlan:
    """Load ``source`` and check it against ``model_dir``; every problem is a WorkflowError that names
    the workflow (file), the agent and the field."""
    wf, canonical = load_source(source)
    where = f"workflow {wf.name!r} ({canonical})"
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise WorkflowError(f"{where}: model folder {model_dir} has no config.json")

    trained = [a for a in wf.agents if a.adapter]
    if not trained:
        raise WorkflowError(
            f"{where}: no agent has an adapter (agents.adapter), so nothing would be trained; "
            f"agents: {[a.id for a in wf.agents]}"
        )
    bases = {a.model for a in trained}
    if len(bases) > 1:
        per = ", ".join(f"{a.id} on {a.model!r}" for a in trained)
        raise WorkflowError(
            f"{where}: trained agents run on {len(bases)} base models ({per}); teamrl run trains one "
            "base model per workflow (give every trained agent the same agents.model)",
            agent=trained[-1].id,
        )
    (model_id,) = bases
    temps = _adapter_temperatures(trained, where)

    adapters: dict[str, int] = {}
    shared_by: dict[str, list[str]] = {}
    for a in trained:
        adapters.setdefault(a.adapter, wf.adapters[a.adapter].rank)
        shared_by.setdefault(a.adapter, []).append(a.id)
    top = max(adapters.values())
    if top > VLLM_LORA_RANKS[-1]:
        name = max(adapters, key=adapters.__getitem__)
        raise WorkflowError(
            f"{where}: adapter {name!r} has rank {top}, above the largest rank vLLM serves "
            f"({VLLM_LORA_RANKS[-1]})",
            agent=shared_by[name][0],
        )
    max_rank = next(r for r in VLLM_LORA_RANKS if r >= top)
    targets = lora_targets(model_dir)

    train, held = split_tasks(wf, tasks_path)
    if not train or not held:
        raise WorkflowError(f"{where}: {len(train)} training and {len(held)} held-out tasks: need both")
    tok = tokenizer if tokenizer is not None else _tokenizer(model_dir)
    prompts = {a.id: _encoded_prompt(wf, a.id, tok, held[0], where) for a in wf.agents}
    probe_agent = trained[0]
    completion = _probe_completion(tok, held[0])
    return TeamPlan(
        workflow=wf,
        source=canonical,
        model_dir=model_dir,
        model_id=model_id,
        adapters=adapters,
        shared_by=shared_by,
        target_modules=targets,
        temperatures=temps,
        optimiser={a: wf.adapters[a].learner_settings() for a in adapters},
        max_lora_rank=max_rank,
        probe_prompt=prompts[probe_agent.id],
        probe_completion=completion,
        train_size=len(train),
        held_out_size=len(held),
    )


def _adapter_temperatures(trained: list[Any], where: str) -> dict[str, float]:
    """adapter -> the temperature its agents sample at. Each adapter's log-probs are recomputed at one
    temperature, so agents that share an adapter sample alike; a trained agent samples (temperature
    > 0) from its whole distribution (top_p 1: the learner's policy has no nucleus cut, so the ratio
    to a truncated behaviour policy would be biased on every token)."""
    temps: dict[str, float] = {}
    first: dict[str, str] = {}
    for a in trained:
        t, adapter = a.sampling.temperature, a.adapter
        if t == 0.0:
            raise WorkflowError(
                f"{where}: agent {a.id!r} trains adapter {adapter!r} but samples greedily "
                "(agents.sampling.temperature = 0): no exploration, and no log-probs to learn from",
                agent=a.id,
            )
        if a.sampling.top_p < 1.0:
            raise WorkflowError(
                f"{where}: agent {a.id!r} trains adapter {adapter!r} with agents.sampling.top_p = "
                f"{a.sampling.top_p}; a trained agent samples with top_p = 1 (the learner's policy is "
                "the whole tempered distribution)",
                agent=a.id,
            )
        if adapter in temps and temps[adapter] != t:
            raise WorkflowError(
                f"{where}: agents {first[adapter]!r} and {a.id!r} share adapter {adapter!r} but sample at "
                f"temperatures {temps[adapter]} and {t}; the learner recomputes an adapter's log-probs "
                "at one temperature (give them one, or each its own adapter)",
                agent=a.id,
            )
        temps.setdefault(adapter, t)
        first.setdefault(adapter, a.id)
    return temps


def _tokenizer(model_dir: Path) -> Tokenizer:
    try:
        return tokenizer_for(model_dir, fast=True)
    except TokenizerError as e:
        raise WorkflowError(f"model {model_dir}: {e}") from None


def _encoded_prompt(
    wf: Workflow, agent_id: str, tok: Tokenizer, task: Mapping[str, Any], where: str
) -> list[int]:
    """The agent's prompt ids for ``task`` with every other output a placeholder ("0")."""
    agent = wf.agent(agent_id)
    outs = _Missing({n.id: "0" for n in wf.nodes()})
    try:
        text = agent.template.format(
            task=_TaskView(task), out=outs, parents="", profile=agent.profile or "", turn=0
        )
    except WorkflowError as e:
        raise WorkflowError(f"{where}: agent {agent_id!r} template: {e}", agent=agent_id) from None
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        raise WorkflowError(
            f"{where}: agent {agent_id!r} template {agent.template!r}: {e}", agent=agent_id
        ) from None
    try:
        return _prompt_ids(agent, tok, text)
    except TokenizerError as e:
        field_ = "profile" if agent.profile and _fails(tok, agent.profile) else "template"
        raise WorkflowError(
            f"{where}: agent {agent_id!r} {field_}: the model's tokenizer cannot encode it: {e}",
            agent=agent_id,
        ) from None


def _fails(tok: Tokenizer, text: str) -> bool:
    try:
        tok.encode(text, add_special=False)
    except TokenizerError:
        return True
    return False


def _probe_completion(tok: Tokenizer, task: Mapping[str, Any]) -> list[int]:
    """A few tokens of the held-out task's answer (else "0"), then EOS: the probe scores them."""
    ids: list[int] = []
    for text in (str(task.get("answer", "")), "0"):
        try:
            ids = tok.encode(text, add_special=False)[:4] if text else []
        except TokenizerError:
            ids = []
        if ids:
            break
    return ids + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
