"""A workflow on a model folder, resolved and checked before any process starts.

``plan_team(source, model_dir)`` is what ``teamrl run``, ``teamrl eval`` and ``teamrl workflow
check`` ask first. It loads the workflow (built-in name, shipped name or TOML path), then checks
everything that would otherwise fail minutes later inside a service (docs/workflows.md lists the
checks):

* something is trained: at least one agent has an adapter; every model an agent uses has a folder
  (one folder for the whole team, or one per model id); the trained agents of each base model are
  one learner group (:class:`BasePlan`);
* every agent's profile and template, rendered with a held-out task, can be encoded by the model's
  tokenizer (chat template included);
* every adapter's rank fits the largest rank vLLM serves, and the LoRA target modules exist in the
  model's weights (taken from the architecture, not a fixed list);
* agents that share an adapter sample at one temperature (the learner recomputes each adapter's
  log-probs at its own), never greedily, with top_p 1.

It returns a :class:`TeamPlan`: per base model, the adapters with their own ranks and the agents
sharing each, the target modules and a probe (prompt and completion token ids built from a
held-out task with that model's tokenizer); and the held-out split. The probe is what the learner
scores and every rollout must reproduce before it uses new adapters. Everything workflow-specific the services need comes from here; no
service knows a built-in task.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from teamrl.rewards.tokenizer import Tokenizer, TokenizerError, tokenizer_for
from teamrl.rollout import sizing
from teamrl.rollout.executor import _Missing, _prompt_ids, _TaskView, choice_token_ids
from teamrl.rollout.spec import WorkflowError
from teamrl.rollout.workflow import Workflow

VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256)  # max_lora_rank values vLLM accepts (1 is too small to matter)
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
HELD_OUT_SPLITS = {"addition": "addition-held-out", "math-word": "math-word-held-out"}


@dataclass(frozen=True)
class BasePlan:
    """One base model of the team and what its learner group trains (docs/teams.md): the
    adapters of the agents that run on it, checked against its own folder."""

    model_id: str  # the workflow's id of the base model (models.<id>)
    model_dir: Path
    agents: list[str]  # the trained agents on this base, in workflow order
    adapters: dict[str, int]  # adapter -> LoRA rank, in the order agents first use them
    shared_by: dict[str, list[str]]  # adapter -> the agents that share it
    target_modules: list[str]
    temperatures: dict[str, float]  # adapter -> the temperature its agents sample at
    choices: dict[str, list[int]]  # adapter -> the only tokens its agents sample (agents.choices), if any
    optimiser: dict[str, dict[str, float]]  # adapter -> the workflow's [adapters.X] learner settings
    max_lora_rank: int  # what the rollout's vLLM engine for this base is started with
    probe_prompt: list[int]  # built with this base's tokenizer
    probe_completion: list[int]


SIZING_TASKS = 64  # training and held-out tasks whose prompts size the engines (teamrl.rollout.sizing)


@dataclass(frozen=True)
class TeamPlan:
    """What the services of one run need to agree on (``teamrl run`` writes it into RUN/config.toml).

    ``bases`` holds one :class:`BasePlan` per base model that trained agents run on, in the order
    the workflow first uses them; each is one learner group. The single-base attributes
    (``model_dir``, ``adapters``, ...) read the only base and refuse a team of several."""

    workflow: Workflow
    source: str  # the built-in/shipped name, or the TOML file's absolute path
    bases: dict[str, BasePlan]
    model_dirs: dict[str, Path]  # every model id an agent uses -> its folder (untrained agents too)
    train_size: int
    held_out_size: int
    # model id -> its engine's max_model_len, from the workflow (teamrl.rollout.sizing)
    contexts: dict[str, int] = field(default_factory=dict)

    @property
    def base(self) -> BasePlan:
        if len(self.bases) != 1:
            raise WorkflowError(
                f"workflow {self.workflow.name!r} trains agents on {len(self.bases)} base models "
                f"({', '.join(self.bases)}); this command serves one (teamrl run trains several)"
            )
        return next(iter(self.bases.values()))

    model_dir = property(lambda self: self.base.model_dir)
    model_id = property(lambda self: self.base.model_id)
    adapters = property(lambda self: self.base.adapters)
    shared_by = property(lambda self: self.base.shared_by)
    target_modules = property(lambda self: self.base.target_modules)
    temperatures = property(lambda self: self.base.temperatures)
    optimiser = property(lambda self: self.base.optimiser)
    max_lora_rank = property(lambda self: self.base.max_lora_rank)
    probe_prompt = property(lambda self: self.base.probe_prompt)
    probe_completion = property(lambda self: self.base.probe_completion)

    def summary(self) -> str:
        parts = []
        for b in self.bases.values():
            ranks = ", ".join(f"{a} (r={r}; {', '.join(b.shared_by[a])})" for a, r in b.adapters.items())
            on = f"base {b.model_id} at {b.model_dir}: " if len(self.bases) > 1 else ""
            parts.append(f"{on}adapters {ranks}; LoRA on {b.target_modules}")
        where = "" if len(self.bases) > 1 else f"; model {next(iter(self.bases.values())).model_dir}"
        return (
            f"workflow {self.workflow.name} ({self.source}): {len(self.workflow.agents)} agents, "
            f"{self.workflow.graph.kind} graph; {'; '.join(parts)}; "
            f"tasks {self.train_size} train / {self.held_out_size} held out{where}"
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
        return all_tasks, load_tasks(
            held_split, seed=wf.tasks.seed, difficulty=wf.tasks.difficulty, max_number=wf.tasks.max_number
        )
    k = max(1, len(all_tasks) // 10) if len(all_tasks) > 1 else 0
    return all_tasks[: len(all_tasks) - k], all_tasks[len(all_tasks) - k :]


def used_models(wf: Any) -> list[str]:
    """The workflow's base models that generate: each agent's, and the credit judge's (rule
    ``judge``), in ``[models]`` order."""
    names = {a.model for a in wf.agents}
    if wf.credit.rule == "judge" and wf.credit.judge_model:
        names.add(wf.credit.judge_model)
    return [m for m in wf.models if m in names]


def trained_models(wf: Any) -> list[str]:
    """The base models of the agents that have an adapter (one learner group each), in ``[models]``
    order."""
    names = {a.model for a in wf.agents if a.adapter}
    return [m for m in wf.models if m in names]


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
    model_dir: str | Path | Mapping[str, str | Path],
    *,
    tasks_path: str | Path | None = None,
    tokenizer: Tokenizer | None = None,
) -> TeamPlan:
    """Load ``source`` and check it against its model folder(s); every problem is a WorkflowError
    that names the workflow (file), the agent and the field.

    ``model_dir``: one folder (every model the workflow uses runs on it: a one-model team), or
    ``{model_id: folder}`` with a folder for every model an agent uses (a team of different models,
    one learner group per trained base)."""
    wf, canonical = load_source(source)
    where = f"workflow {wf.name!r} ({canonical})"
    dirs = _model_dirs(wf, model_dir, where)
    trained = [a for a in wf.agents if a.adapter]
    if not trained:
        raise WorkflowError(
            f"{where}: no agent has an adapter (agents.adapter), so nothing would be trained; "
            f"agents: {[a.id for a in wf.agents]}"
        )
    train, held = split_tasks(wf, tasks_path)
    if not train or not held:
        raise WorkflowError(f"{where}: {len(train)} training and {len(held)} held-out tasks: need both")
    toks = {m: tokenizer if tokenizer is not None else _tokenizer(d) for m, d in dirs.items()}
    prompts = {a.id: _encoded_prompt(wf, a.id, toks[a.model], held[0], where) for a in wf.agents}
    for a in wf.agents:
        _choices(a, toks[a.model], where)
    contexts = _contexts(wf, dirs, toks, train[:SIZING_TASKS] + held[:SIZING_TASKS], where)
    bases: dict[str, BasePlan] = {}
    for model_id in dict.fromkeys(a.model for a in trained):
        mine = [a for a in trained if a.model == model_id]
        bases[model_id] = _base_plan(
            wf, model_id, dirs[model_id], mine, toks[model_id], prompts, held[0], where
        )
    return TeamPlan(
        workflow=wf,
        source=canonical,
        bases=bases,
        model_dirs=dirs,
        train_size=len(train),
        held_out_size=len(held),
        contexts=contexts,
    )


def _contexts(
    wf: Workflow, dirs: dict[str, Path], toks: Mapping[str, Tokenizer], tasks: list[dict], where: str
) -> dict[str, int]:
    """model id -> its engine's context (:func:`teamrl.rollout.sizing.model_contexts` over the longest
    prompts of ``tasks``), capped at the model's own limit; a prompt that alone fills it is refused."""
    longest = {
        a.id: max(len(_encoded_prompt(wf, a.id, toks[a.model], t, where)) for t in tasks) for a in wf.agents
    }
    limits = {m: sizing.model_limit(d) for m, d in dirs.items()}
    try:
        return sizing.capped_contexts(wf, longest, limits)
    except sizing.SizingError as e:
        raise WorkflowError(f"{where}: {e}") from None


def _model_dirs(
    wf: Workflow, model_dir: str | Path | Mapping[str, str | Path], where: str
) -> dict[str, Path]:
    """model id -> folder for every model that generates (the agents', the credit judge's); each
    folder must hold a config.json."""
    used = used_models(wf)
    if isinstance(model_dir, Mapping):
        unknown = sorted(set(model_dir) - set(wf.models))
        if unknown:
            raise WorkflowError(
                f"{where}: model folders given for {unknown}, not models of it ({sorted(wf.models)})"
            )
        missing = [m for m in used if m not in model_dir]
        if missing:
            users = {m: [a.id for a in wf.agents if a.model == m] for m in missing}
            who = {m: f"agents {users[m]}" if users[m] else "the credit judge" for m in missing}
            raise WorkflowError(
                f"{where}: no model folder for {', '.join(f'{m!r} ({who[m]})' for m in missing)}; "
                "give one per model (teamrl run --model ID=DIR)",
                agent=next((a.id for a in wf.agents if a.model == missing[0]), None),
            )
        dirs = {m: Path(model_dir[m]) for m in used}
    else:
        dirs = {m: Path(model_dir) for m in used}
    for m, d in dirs.items():
        if not (d / "config.json").is_file():
            raise WorkflowError(f"{where}: model {m!r}: folder {d} has no config.json")
    return dirs


def _base_plan(
    wf: Workflow,
    model_id: str,
    model_dir: Path,
    trained: list[Any],
    tok: Tokenizer,
    prompts: dict[str, list[int]],
    task: Mapping[str, Any],
    where: str,
) -> BasePlan:
    """The adapters of ``trained`` (agents on ``model_id``), their ranks, targets and probe."""
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
    return BasePlan(
        model_id=model_id,
        model_dir=model_dir,
        agents=[a.id for a in trained],
        adapters=adapters,
        shared_by=shared_by,
        target_modules=lora_targets(model_dir),
        temperatures=_adapter_temperatures(trained, where),
        choices=_adapter_choices(trained, tok, where),
        optimiser={a: wf.adapters[a].learner_settings() for a in adapters},
        max_lora_rank=next(r for r in VLLM_LORA_RANKS if r >= top),
        probe_prompt=prompts[trained[0].id],
        probe_completion=_probe_completion(tok, task),
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


def _choices(agent: Any, tok: Tokenizer, where: str) -> list[int]:
    """The agent's choice tokens (:func:`teamrl.rollout.executor.choice_token_ids`), errors named."""
    try:
        return list(choice_token_ids(agent, tok))
    except WorkflowError as e:
        raise WorkflowError(f"{where}: {e}", agent=agent.id) from None


def _adapter_choices(trained: list[Any], tok: Tokenizer, where: str) -> dict[str, list[int]]:
    """adapter -> its agents' choice tokens, for adapters whose agents choose (agents.choices). The
    learner normalises an adapter's log-probs over one set of tokens, so agents that share an adapter
    choose among the same ones, or all write free text."""
    out: dict[str, list[int]] = {}
    first: dict[str, Any] = {}
    for a in trained:
        ids = _choices(a, tok, where)
        if a.adapter in first and ids != out.get(a.adapter, []):
            raise WorkflowError(
                f"{where}: agents {first[a.adapter].id!r} and {a.id!r} share adapter {a.adapter!r} but "
                f"choose among {first[a.adapter].choices or 'free text'} and {a.choices or 'free text'}; "
                "the learner normalises an adapter's log-probs over one set of tokens (give them the "
                "same choices, or each its own adapter)",
                agent=a.id,
            )
        first.setdefault(a.adapter, a)
        if ids:
            out[a.adapter] = ids
    return out


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
        own = (("profile", agent.profile), ("response_prefix", agent.response_prefix))
        field_ = next((name for name, text in own if text and _fails(tok, text)), "template")
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
