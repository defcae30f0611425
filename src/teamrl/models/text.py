"""``teamrl model build --kind text``: a small text model that can read the text workflows, built offline.

The embedded character model (``teamrl.learner.modelbuild``) spells only the addition task. This
module builds ``embedded-text``, a second model whose tokenizer reads any text, so that math-duo,
math-trio, code-reflect and search-qa can run on a machine without a model hub. It is a *small*
model for running those workflows offline and for tests; real use is ``--model`` with a Hugging Face
model folder (docs/workflows.md: ``--model``, held-out split, LoRA targets).

What the build does (deterministic for a given ``seed`` and ``steps`` on one machine):

1. **Tokenizer.** A byte-level BPE (``tokenizers``) trained on text generated here: the built-in
   text workflows' prompts and demonstrations (below), the bundled search corpus and HumanEval
   sample, and arithmetic lines. Digits are split one per token. Special tokens ``<|endoftext|>``
   (padding), ``<|im_start|>``, ``<|im_end|>`` (end of a turn: the EOS) and a ChatML chat template,
   so the rollout renders ``[system: profile] + [user: text]`` through ``apply_chat_template``.
2. **Demonstrations, rendered by the rollout itself.** Each built-in text workflow is run by
   ``teamrl.rollout.executor.run_episode`` against a scripted backend that writes the reference
   responses (planner: a numbered plan; solver: one ``a op b = c`` line per step and ``Answer: N``;
   verifier: the recomputation and ``VERDICT: correct`` / ``VERDICT: wrong``, with wrong solver
   attempts made on purpose; coder/reviewer on the bundled HumanEval sample; searcher: a real BM25
   call and the sentence that answers; answerer: the short answer). The prompt token ids are the
   ones the rollout builds (chat template, profiles as system prompts, templates, parents, tool
   results), so training sees exactly what sampling will see. The math problems are the training
   split of ``teamrl.rollout.workflows.wordproblems`` (task set ``math-word``).
3. **Warm start.** A Qwen2 causal LM (hidden 256, 2 layers, 4 heads of 64, 2 KV heads: vLLM CPU needs
   head_dim 64; bfloat16 autocast) trained from a seeded initialisation for a fixed number of steps on those
   demonstrations plus arithmetic drill lines (``a op b = c``, loss on the results only), with the
   loss on response tokens only. The step count is chosen to leave the model partly right, so that
   RL has room to improve it.
4. **Measure.** Greedy episodes of math-trio and math-duo on the held-out split
   (``math-word-held-out``) with transformers: team accuracy, the first solver's accuracy, the
   verifier's verdict accuracy and its accuracy on balanced right/wrong cases; search-qa F1 and
   code-reflect pass rate on their (small, seen) task sets. Written to ``teamrl_model.json``.

The folder is an ordinary Hugging Face folder (``config.json``, ``generation_config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``)
that vLLM and transformers load; ``teamrl.rewards.tokenizer.tokenizer_for`` reads it with
``HFTokenizer``.

Also here: :func:`build_random` (a random-initialised Llama-, Qwen3- or Qwen2-style folder with a BPE
tokenizer, for end-to-end tests on another architecture family) and :func:`lora_targets` (the LoRA
target module names of a model folder, from its architecture).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUILD_VERSION = 2  # 2: float32 warm start
DEFAULT_STEPS = 120
VOCAB_SIZE = 4096
PAD, BOS, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ARCH = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
MAX_POSITIONS = 4096
TEXT_WORKFLOWS = ("math-duo", "math-trio", "code-reflect", "search-qa")
# Share of demonstration episodes per workflow (math gets most: it is the measured task).
EPISODE_MIX = {"math-trio": 0.45, "math-duo": 0.3, "search-qa": 0.15, "code-reflect": 0.1}
TOKENS_PER_BATCH = 6144
DRILL_SHARE = 0.3  # of each batch's tokens: arithmetic drill lines


def default_text_model_dir() -> Path:
    """``$TEAMRL_CACHE/models/embedded-text-v<BUILD_VERSION>`` (``~/.cache/teamrl`` when ``TEAMRL_CACHE`` is unset)."""
    root = Path(os.environ.get("TEAMRL_CACHE", Path.home() / ".cache" / "teamrl"))
    return root / "models" / f"embedded-text-v{BUILD_VERSION}"


# ============================================================================ tokenizer


def train_tokenizer(texts: Sequence[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE (``tokenizers.Tokenizer``) trained on ``texts``; digits are single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def save_tokenizer(tok: Any, out: Path, max_length: int = MAX_POSITIONS) -> None:
    """Write ``tok`` as a Hugging Face tokenizer folder with the ChatML template and ``<|im_end|>`` EOS."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": PAD,
                "bos_token": None,
                "unk_token": None,
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": max_length,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        )
    )
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS, "pad_token": PAD}, indent=1))


# ============================================================================ demonstrations


def _workflow(name: str, with_reward: bool = False):
    from teamrl.rollout.workflow import Workflow
    from teamrl.rollout.workflows import BUILTIN

    d = copy.deepcopy(BUILTIN[name])
    if not with_reward:
        d["reward"] = None
    return Workflow.from_dict(d)


def workflows_fingerprint() -> str:
    """A hash of the text workflows' definitions: a changed profile or template means a rebuild."""
    from teamrl.rollout.workflows import BUILTIN

    defs = [
        {k: v for k, v in BUILTIN[n].items() if k not in ("tasks", "description")} for n in TEXT_WORKFLOWS
    ]
    blob = json.dumps(defs, sort_keys=True, default=str)  # what the prompts are made of, not task sources
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _wrong_solution(task: dict[str, Any], rng: random.Random) -> tuple[str, str]:
    """A plausible wrong working for ``task``: one step's result is off, later steps use it."""
    lines = task["solution"].splitlines()
    bad = rng.randrange(len(lines))
    out: list[str] = []
    used: dict[str, str] = {}  # a correct intermediate value -> the value the wrong working carries
    val = 0
    for i, line in enumerate(lines):
        lhs, rhs = line.split(" = ")
        a, op, b = lhs.split(" ")
        a, b = used.get(a, a), used.get(b, b)
        x, y = int(a), int(b)
        val = {"+": x + y, "-": x - y, "*": x * y, "/": x // y if y else 0}[op]
        if i == bad or (i == len(lines) - 1 and str(val) == task["answer"]):
            delta = rng.choice([-10, -2, -1, 1, 2, 10])
            val = val + delta if val + delta > 0 else val + abs(delta)
        out.append(f"{a} {op} {b} = {val}")
        if str(val) != rhs:
            used[rhs] = str(val)
    return "\n".join(out), str(val)


def solver_text(solution: str, answer: str) -> str:
    return f"{solution}\nAnswer: {answer}"


def verifier_text(solution: str, claimed: str | None, gold: str) -> str:
    ok = claimed == gold
    said = f"The answer {claimed} is {'right' if ok else 'wrong'}." if claimed else "There is no answer."
    return f"{solution}\n{said}\nVERDICT: {'correct' if ok else 'wrong'}"


def _claimed(text: str) -> str | None:
    for line in reversed(text.splitlines()):
        if line.strip().lower().startswith("answer:"):
            return line.split(":", 1)[1].strip()
    return None


def _answer_sentence(result: str, answers: Sequence[str]) -> str:
    import re

    for sentence in re.split(r"(?<=[.!?])\s+", result):
        if any(a.lower() in sentence.lower() for a in answers):
            return sentence.strip()
    return "The documents do not say."


@dataclass
class Example:
    """One supervised example: the rollout's prompt ids and the response ids to learn."""

    prompt: list[int]
    response: list[int]
    role: str


class _Scripted:
    """A backend that writes the reference response for each act of one episode (see the module doc)."""

    def __init__(self, workflow: str, task: dict[str, Any], tok: Any, rng: random.Random) -> None:
        self.wf, self.task, self.tok, self.rng = workflow, task, tok, rng
        self.calls = 0
        self.skip: set[int] = set()  # call indices not to learn from (deliberately wrong solver work)
        self.solver_calls = 0
        self.wrong_first = workflow == "math-trio" and rng.random() < 0.6

    def _respond(self, adapter: str, prompt_text: str) -> tuple[str, bool]:
        t = self.task
        if self.wf in ("math-duo", "math-trio"):
            if adapter.startswith("planner"):
                return t["plan"], True
            if adapter.startswith("solver"):
                self.solver_calls += 1
                if self.wrong_first and self.solver_calls == 1:
                    self.skip.add(self.calls)
                    work, ans = _wrong_solution(t, self.rng)
                    return solver_text(work, ans), True
                return solver_text(t["solution"], t["answer"]), True
            if adapter.startswith("verifier"):
                work = prompt_text.rsplit("Solver's work:\n", 1)[-1]
                return verifier_text(t["solution"], _claimed(work), t["answer"]), True
        if self.wf == "code-reflect":
            code = f"```python\n{t['prompt']}{t['canonical_solution']}```"
            if adapter.startswith("reviewer"):
                return (
                    f"The candidate implements {t['entry_point']} as described and handles the "
                    "examples in the docstring. No bugs found; keep it as it is.",
                    True,
                )
            return code, True
        if self.wf == "search-qa":
            if self.calls == 0:
                return f'<tool name="search">{t["question"]}</tool>', False
            if self.calls == 1:
                result = prompt_text.rsplit("<result>", 1)[-1]
                return _answer_sentence(result, t.get("answers") or [t.get("answer", "")]), True
            return (t.get("answers") or [t.get("answer", "")])[0], True
        raise ValueError(f"no script for workflow {self.wf!r}")

    async def generate(self, prompt_ids: Sequence[int], sampling: Any, adapter: str = "", seed: Any = None):
        from teamrl.rollout.engine import Generation

        text, final = self._respond(adapter, self.tok.decode(prompt_ids))
        ids = self.tok.encode(text, add_special=False) + ([self.tok.eos_token_id] if final else [])
        self.calls += 1
        return Generation(ids, [0.0] * len(ids), text, "stop", adapter, 0, 0.0, 0.0)


@functools.lru_cache(maxsize=8)
def _tasks(name: str, seed: int) -> list[dict[str, Any]]:
    from teamrl.rollout.workflows import load_tasks

    if name in ("math-duo", "math-trio"):
        return load_tasks("math-word", seed=seed)
    return load_tasks(_workflow(name).tasks.builtin)


def demonstrations(tok: Any, n_episodes: int, seed: int = 0) -> list[Example]:
    """Examples from ``n_episodes`` scripted episodes of the text workflows (``EPISODE_MIX``), in order.

    ``tok`` is a ``teamrl.rewards.tokenizer`` tokenizer; with ``ByteTokenizer`` the prompts are
    plain text (used to gather the tokenizer's training text).
    """
    from teamrl.rollout.executor import run_episode

    rng = random.Random(f"teamrl-text-demos-{seed}")
    names = list(EPISODE_MIX)
    wfs = {n: _workflow(n) for n in names}
    tasks = {n: _tasks(n, 0) for n in names}
    plan = rng.choices(names, weights=[EPISODE_MIX[n] for n in names], k=n_episodes)

    async def one(i: int, name: str) -> list[Example]:
        task = tasks[name][rng.randrange(len(tasks[name]))]
        backend = _Scripted(name, task, tok, random.Random(f"{seed}-{i}"))
        traj = await run_episode(
            wfs[name], task, backend, tokenizers=tok, seed=None, incarnation="build", seq=i, group_id=str(i)
        )
        return [
            Example(list(map(int, s.prompt_ids)), list(map(int, s.response_ids)), s.role)
            for k, s in enumerate(traj.steps)
            if k not in backend.skip
        ]

    async def run_all() -> list[Example]:
        out: list[Example] = []
        for i, name in enumerate(plan):  # one at a time: the order (and rng use) is fixed
            out.extend(await one(i, name))
        return out

    return asyncio.run(run_all())


def drill_lines(rng: random.Random, n: int) -> list[str]:
    """``n`` arithmetic lines in the solver's ``a op b = c`` form, over the word problems' ranges."""
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.35:
            a, b = rng.randint(2, 150), rng.randint(2, 60)
            out.append(f"{a} + {b} = {a + b}")
        elif r < 0.65:
            a = rng.randint(4, 160)
            b = rng.randint(2, min(60, a - 1))
            out.append(f"{a} - {b} = {a - b}")
        elif r < 0.9:
            a, b = rng.randint(2, 9), rng.randint(2, 12)
            out.append(f"{a} * {b} = {a * b}")
        else:
            k, q = rng.randint(2, 9), rng.randint(2, 25)
            out.append(f"{k * q} / {k} = {q}")
    return out


@functools.lru_cache(maxsize=2)
def _corpus(seed: int) -> tuple[str, ...]:
    """The tokenizer's training text: rendered demonstrations, bundled data and arithmetic lines."""
    from teamrl.rewards.tokenizer import ByteTokenizer
    from teamrl.rollout.workflows import data_path, humaneval_source

    bt = ByteTokenizer()
    texts = [bt.decode(e.prompt) + bt.decode(e.response) for e in demonstrations(bt, 1500, seed)]
    for p in (data_path("search_corpus.jsonl"), data_path("search_qa.jsonl"), humaneval_source()[0]):
        if p.suffix == ".jsonl":
            texts.extend(p.read_text().splitlines())
    rng = random.Random(seed)
    texts.extend("\n".join(drill_lines(rng, 20)) for _ in range(200))
    texts.append('VERDICT: correct VERDICT: wrong Answer: ```python ``` <tool name="python"></tool>')
    return tuple(texts)


# ============================================================================ training


def _drill_example(tok: Any, rng: random.Random, n_lines: int = 12) -> Example:
    """Drill lines as one example: the loss is on each result (after ``=``) and the newline."""
    prompt: list[int] = [tok.eos_token_id]
    labels: list[int] = []
    ids: list[int] = []
    for line in drill_lines(rng, n_lines):
        lhs, rhs = line.split(" =")
        a = tok.encode(lhs + " =", add_special=False)
        b = tok.encode(rhs + "\n", add_special=False)
        ids += a + b
        labels += [-100] * len(a) + b
    return Example(prompt + ids, labels, "drill")


def _batches(
    examples: list[Example], tok: Any, rng: random.Random, budget: int = TOKENS_PER_BATCH
) -> Callable[[], tuple[Any, Any]]:
    """A batch maker: token-budgeted batches of demonstrations (similar lengths together) + drills."""
    import torch

    pad = tok.encode(PAD, add_special=False)[0]
    order: list[int] = []

    def refill() -> None:
        idx = list(range(len(examples)))
        rng.shuffle(idx)
        # sort chunks of 256 by length so one batch wastes little on padding
        for c in range(0, len(idx), 256):
            chunk = sorted(
                idx[c : c + 256], key=lambda i: len(examples[i].prompt) + len(examples[i].response)
            )
            order.extend(chunk)

    def make() -> tuple[Any, Any]:
        seqs: list[tuple[list[int], list[int]]] = []
        used = 0
        demo_budget = int(budget * (1 - DRILL_SHARE))
        while used < demo_budget:
            if not order:
                refill()
            e = examples[order.pop(0)]
            seqs.append((e.prompt + e.response, [-100] * len(e.prompt) + e.response))
            used = len(seqs) * max(len(s) for s, _ in seqs)
        while used < budget:
            d = _drill_example(tok, rng)
            seqs.append((d.prompt, [-100] + d.response))
            used += len(d.prompt)
        width = max(len(s) for s, _ in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)
        for i, (s, lab) in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            labels[i, : len(lab)] = torch.tensor(lab)
        return ids, labels

    return make


def _loss(model: Any, ids: Any, labels: Any) -> Any:
    """Causal-LM loss with the output layer applied only where there is a label (most are prompt)."""
    import torch.nn.functional as F

    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    target = labels[:, 1:]
    keep = target != -100
    logits = model.lm_head(hidden[keep])
    return F.cross_entropy(logits.float(), target[keep])


# ============================================================================ measuring


class GreedyBackend:
    """A transformers backend for ``run_episode``: greedy, batched across concurrent episodes.

    ``max_new`` caps every act's response (a tiny model can ramble to ``max_tokens``).
    """

    def __init__(self, model: Any, tok: Any, max_new: int = 160) -> None:
        self.model, self.tok, self.max_new = model, tok, max_new
        self.pending: list[tuple[list[int], Any, Any]] = []
        self.version = 0

    async def generate(self, prompt_ids: Sequence[int], sampling: Any, adapter: str = "", seed: Any = None):
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((list(prompt_ids), sampling, fut))
        return await fut

    async def pump(self, done: Callable[[], bool]) -> None:
        while not done():
            n = -1
            while n != len(self.pending):  # let every runnable episode reach its next request
                n = len(self.pending)
                for _ in range(20):
                    await asyncio.sleep(0)
            if not self.pending:
                await asyncio.sleep(0.001)
                continue
            batch, self.pending = self.pending, []
            for (_, _, fut), gen in zip(batch, self._run([(p, s) for p, s, _ in batch]), strict=True):
                fut.set_result(gen)

    def _run(self, reqs: list[tuple[list[int], Any]]) -> list[Any]:
        import torch

        from teamrl.rollout.engine import Generation

        pad = self.tok.encode(PAD, add_special=False)[0]
        out: list[Any] = [None] * len(reqs)
        order = sorted(range(len(reqs)), key=lambda i: len(reqs[i][0]))
        for c in range(0, len(order), 32):
            idx = order[c : c + 32]
            width = max(len(reqs[i][0]) for i in idx)
            ids = torch.full((len(idx), width), pad, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                p = reqs[i][0]
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            stops = {self.tok.eos_token_id}
            for i in idx:
                stops |= set(reqs[i][1].stop_token_ids)
            new = max(min(reqs[i][1].max_tokens, self.max_new) for i in idx)
            with torch.no_grad():
                gen = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    do_sample=False,
                    eos_token_id=sorted(stops),
                    pad_token_id=pad,
                )
            for r, i in enumerate(idx):
                toks = gen[r, width:].tolist()
                cap = min(reqs[i][1].max_tokens, self.max_new)
                resp: list[int] = []
                for t in toks[:cap]:
                    resp.append(t)
                    if t in stops:
                        break
                finish = "stop" if resp and resp[-1] in stops else "length"
                text = self.tok.decode(resp)
                out[i] = Generation(resp, [0.0] * len(resp), text, finish, "", 0, 0.0, 0.0)
        return out


def run_greedy_episodes(model: Any, tok: Any, workflow: Any, tasks: list[dict[str, Any]]) -> list[Any]:
    """Greedy episodes of ``workflow`` (with its reward) on ``tasks``; returns the trajectories."""
    from teamrl.rollout.executor import run_episode

    backend = GreedyBackend(model, tok)

    async def main() -> list[Any]:
        state = {"left": len(tasks)}

        async def one(i: int, task: dict[str, Any]) -> Any:
            try:
                return await run_episode(
                    workflow,
                    task,
                    backend,
                    tokenizers=tok,
                    seed=None,
                    incarnation="eval",
                    seq=i,
                    group_id=str(i),
                )
            finally:
                state["left"] -= 1

        pump = asyncio.ensure_future(backend.pump(lambda: state["left"] == 0))
        try:
            return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))
        finally:
            await pump

    return asyncio.run(main())


def measure(folder: str | Path, n_math: int = 100, model: Any = None) -> dict[str, float]:
    """Greedy held-out accuracies of the model in ``folder`` (see the module doc, step 4)."""
    import torch
    from transformers import AutoModelForCausalLM

    from teamrl.rewards.tokenizer import HFTokenizer
    from teamrl.rollout.workflows import load_tasks

    tok = HFTokenizer(folder)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(folder))
    model.eval()
    held = load_tasks("math-word-held-out")[:n_math]
    res = _math_team_scores(model, tok, held)
    res["verifier_balanced"] = _verifier_balanced(model, tok, held)
    for name, key in (("search-qa", "search-qa_f1"), ("code-reflect", "code-reflect_pass")):
        wf = _workflow(name, with_reward=True)
        tasks_ = _tasks(name, 0)
        trajs = run_greedy_episodes(model, tok, wf, tasks_)
        res[key + "_seen_tasks"] = sum(t.reward for t in trajs) / len(trajs)
    torch.set_grad_enabled(True)
    return {k: round(v, 4) for k, v in res.items()}


def _math_team_scores(model: Any, tok: Any, held: list[dict[str, Any]]) -> dict[str, float]:
    """math-trio and math-duo on the held-out problems: team accuracy, the first solver's, the
    planner's exact plans; for math-trio also the verifier's step reward and acts per episode."""
    res: dict[str, float] = {}
    for name in ("math-trio", "math-duo"):
        trajs = run_greedy_episodes(model, tok, _workflow(name, with_reward=True), held)
        res[f"{name}_team"] = sum(t.reward >= 1.0 for t in trajs) / len(trajs)
        first = [next(s for s in t.steps if s.role == "solver") for t in trajs]
        res[f"{name}_solver_first"] = sum(s.reward >= 1.0 for s in first) / len(first)
        plans = [next(s for s in t.steps if s.role == "planner") for t in trajs]
        res[f"{name}_planner_exact"] = sum(
            s.response_text.strip() == task["plan"] for s, task in zip(plans, held, strict=True)
        ) / len(plans)
        if name == "math-trio":
            ver = [s for t in trajs for s in t.steps if s.role == "verifier"]
            res["math-trio_verifier"] = sum(s.reward for s in ver) / max(1, len(ver))
            res["math-trio_acts_per_episode"] = sum(len(t.steps) for t in trajs) / len(trajs)
    return res


def _verifier_balanced(model: Any, tok: Any, held: list[dict[str, Any]]) -> float:
    """The verifier on balanced cases: the gold working and a wrong one, for each held-out task;
    the share of verdicts that are right."""
    import re

    from teamrl.rollout.engine import Sampling

    rng = random.Random(7)
    tasks, claims = [], []
    for t in held:
        for wrong in (False, True):
            work, ans = _wrong_solution(t, rng) if wrong else (t["solution"], t["answer"])
            tasks.append({**t, "question": t["question"]})
            claims.append((solver_text(work, ans), ans == t["answer"]))
    agent = _workflow("math-trio").agent("verifier")
    prompts = [
        tok.chat(
            [
                {"role": "system", "content": agent.profile or ""},
                {"role": "user", "content": agent.template.format(task=t, out={"solver": c})},
            ]
        )
        for t, (c, _) in zip(tasks, claims, strict=True)
    ]
    gens = GreedyBackend(model, tok)._run([(p, Sampling(max_tokens=96)) for p in prompts])
    right = 0
    for g, (_, ok) in zip(gens, claims, strict=True):
        said = re.search(r"(?i)verdict:\s*(correct|wrong|incorrect)", g.text)
        right += bool(said) and (said.group(1).lower() == "correct") == ok
    return right / len(gens)


# ============================================================================ build


def _set_threads() -> int:
    import torch

    n = max(1, min(2, os.cpu_count() or 1))
    torch.set_num_threads(n)
    return n


def build_text(
    out: Path | str | None = None,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    force: bool = False,
    measure_n: int = 100,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Build ``embedded-text`` into ``out`` (default :func:`default_text_model_dir`) and return the folder.

    Reuses a complete build with the same parameters (build version, steps, seed, workflows) unless
    ``force``. ``measure_n`` held-out math problems are used for the accuracy check (0 skips it).
    """
    from teamrl.rewards.tokenizer import HFTokenizer

    say = log or (lambda s: print(f"[model build text] {s}", flush=True))
    out = Path(out) if out else default_text_model_dir()
    params = {
        "kind": "text",
        "build_version": BUILD_VERSION,
        "steps": steps,
        "seed": seed,
        "workflows": workflows_fingerprint(),
    }
    if not force and _built_with(out, params):
        return out
    threads = _set_threads()
    t_start = time.time()
    tmp = _empty_dir(out.with_name(out.name + ".tmp"))
    save_tokenizer(train_tokenizer(_corpus(seed)), tmp)
    tok = HFTokenizer(tmp)
    vocab = len(tok._tok)
    say(f"tokenizer: {vocab} tokens ({time.time() - t_start:.0f}s)")
    examples = demonstrations(tok, min(4000, max(40, steps * 8)), seed)
    say(f"{len(examples)} demonstration steps ({time.time() - t_start:.0f}s)")
    model, pad_id = _text_model(tok, vocab, seed)
    train_s = _warm_start(
        model, _batches(examples, tok, random.Random(f"teamrl-text-batches-{seed}")), steps, say
    )
    _save_model(model, tmp, {"eos_token_id": tok.eos_token_id, "pad_token_id": pad_id, "do_sample": True})
    t_measure = time.time()
    acc = measure(tmp, n_math=measure_n, model=model) if measure_n else {}
    meta = {
        "params": params,
        "task": "text-workflows",
        "architecture": "Qwen2ForCausalLM",
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": vocab,
        "demonstration_steps": len(examples),
        "threads": threads,
        "warmstart_seconds": round(train_s, 1),
        "build_seconds": round(t_measure - t_start, 1),
        "measure_seconds": round(time.time() - t_measure, 1),
        "held_out_greedy": acc,
        "held_out_tasks": "math-word-held-out",
    }
    (tmp / "teamrl_model.json").write_text(json.dumps(meta, indent=1))
    _replace_dir(out, tmp)
    say(f"wrote {out}: {meta['parameters']:,} parameters, warm start {train_s:.0f}s, held-out {acc}")
    return out


def _built_with(out: Path, params: dict[str, Any]) -> bool:
    """Whether ``out`` holds a complete build made with ``params``."""
    meta_path = out / "teamrl_model.json"
    return meta_path.exists() and json.loads(meta_path.read_text()).get("params") == params


def _empty_dir(path: Path) -> Path:
    """``path`` as a new empty folder (what was there is removed)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _replace_dir(out: Path, new: Path) -> None:
    """``new`` renamed to ``out``, whatever was at ``out`` removed first."""
    if out.exists():
        shutil.rmtree(out)
    new.rename(out)


def _save_model(model: Any, folder: Path, generation_config: dict[str, Any]) -> None:
    """The model in eval mode, its weights (safetensors) and ``generation_config.json`` in ``folder``."""
    model.eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    (folder / "generation_config.json").write_text(json.dumps(generation_config, indent=1))


def _text_model(tok: Any, vocab: int, seed: int) -> tuple[Any, int]:
    """The seeded, untrained Qwen2 model of ``ARCH`` for ``tok``'s vocabulary, and its pad id."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    pad_id = tok.encode(PAD, add_special=False)[0]
    cfg = Qwen2Config(
        vocab_size=(vocab + 63) // 64 * 64,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tok.encode(BOS, add_special=False)[0],
        eos_token_id=tok.eos_token_id,
        pad_token_id=pad_id,
        rope_theta=10000.0,
        **ARCH,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg), pad_id


def _warm_start(
    model: Any, make: Callable[[], tuple[Any, Any]], steps: int, say: Callable[[str], None]
) -> float:
    """``steps`` AdamW steps on the batches ``make`` draws (linear warm-up, then cosine down to
    10 %); the seconds it took."""
    import math

    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0, betas=(0.9, 0.98))
    warm = max(1, min(50, steps // 10))

    def lr_at(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    t_train = time.time()
    model.train()
    for step in range(steps):
        ids, labels = make()
        loss = _loss(model, ids, labels)  # float32: bf16 autocast was 1.7x slower per step on this CPU
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            say(f"step {step + 1}/{steps} loss {loss.item():.3f} ({time.time() - t_train:.0f}s)")
    return time.time() - t_train


def weights_digest(folder: str | Path) -> str:
    """sha256 of the tokenizer file and every tensor of ``model.safetensors`` (names and bytes)."""
    from safetensors.numpy import load_file

    h = hashlib.sha256(Path(folder, "tokenizer.json").read_bytes())
    tensors = load_file(str(Path(folder, "model.safetensors")))
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].tobytes())
    return h.hexdigest()


# ============================================================================ other families


FAMILIES = ("llama", "qwen3", "qwen2")


def build_random(
    out: Path | str,
    family: str = "llama",
    seed: int = 0,
    tokenizer_from: Path | str | None = None,
    hidden_size: int = 128,
    num_layers: int = 2,
) -> Path:
    """A random-initialised model folder of ``family`` (Llama, Qwen3 or Qwen2 config; head_dim 64).

    The tokenizer is copied from ``tokenizer_from`` (a folder with ``tokenizer.json``, e.g. the
    embedded-text model) or, when not given, a small byte-level BPE trained here on the text
    workflows' prompts. For end-to-end tests on an architecture vLLM CPU supports; the weights are
    noise, so the model writes noise.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (known: {list(FAMILIES)})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab, ids = _random_tokenizer(out, seed, tokenizer_from)
    heads = hidden_size // 64
    common = {
        "vocab_size": (vocab + 63) // 64 * 64,
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 1,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": True,
        "bos_token_id": ids.get(BOS),
        "eos_token_id": ids.get(EOS),
        "pad_token_id": ids.get(PAD),
        "rope_theta": 10000.0,
    }
    model = _family_model(family, seed, common)
    _save_model(model, out, {"eos_token_id": ids.get(EOS), "pad_token_id": ids.get(PAD)})
    return out


def _random_tokenizer(
    out: Path, seed: int, tokenizer_from: Path | str | None
) -> tuple[int, dict[str, int | None]]:
    """The tokenizer files in ``out`` (copied from ``tokenizer_from``, else a small BPE trained
    here): its vocabulary size and the ids of the special tokens."""
    if tokenizer_from is not None:
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if Path(tokenizer_from, f).is_file():
                shutil.copy(Path(tokenizer_from, f), out / f)
    else:
        save_tokenizer(train_tokenizer(_corpus(seed), vocab_size=1024), out)
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(out / "tokenizer.json"))
    return tk.get_vocab_size(), {t: tk.token_to_id(t) for t in SPECIAL_TOKENS}


def _family_model(family: str, seed: int, common: dict[str, Any]) -> Any:
    """A seeded random model of ``family`` with the ``common`` config (head_dim 64)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(head_dim=64, **common))
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(head_dim=64, **common))
