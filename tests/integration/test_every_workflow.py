"""Every built-in workflow, a user-written one and a model of another architecture family train under
``teamrl run --workflow X`` (async: buffer, rollout and learner processes), a few steps each.

Checked for each: every adapter of the workflow is published in every version, the rollout loads
each version only after vLLM reproduced the learner's probe (its log line says so), versions are
monotonic, held-out evaluation rows are written with the workflow's own metrics, and the run's
resolved config names the workflow's adapters (each with its own rank) and the architecture's LoRA
target modules. Not checked: that anything learns (the measured runs in docs/results.md do that).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CLI = [sys.executable, "-m", "teamrl.cli.main", "run"]
SMALL = [
    "--steps",
    "2",
    "--tasks-per-step",
    "2",
    "--group-size",
    "2",
    "--eval-interval",
    "2",
    "--eval-tasks",
    "4",
    "--checkpoint-interval",
    "1",
    "--max-lag",
    "4",
]

USER_WORKFLOW = """
name = "two-solvers"
description = "a first solver, a verifier, and a second solver (same adapter) when the verifier rejects"

[models.base]
path = ""

[adapters.solver-lora]
model = "base"
rank = 8

[adapters.verifier-lora]
model = "base"
rank = 16

[[agents]]
id = "solver_a"
role = "solver"
model = "base"
adapter = "solver-lora"
template = "S{task[question]}"
output = "addition_candidate"
chat = false
[agents.sampling]
max_tokens = 5
stop_token_ids = [14]

[[agents]]
id = "verifier"
role = "verifier"
model = "base"
adapter = "verifier-lora"
template = "V{task[question]}{out[solver_a]}?"
chat = false
[agents.sampling]
max_tokens = 5
stop_token_ids = [14]

[[agents]]
id = "solver_b"
role = "solver"
model = "base"
adapter = "solver-lora"
template = "S{task[question]}"
output = "addition_candidate"
chat = false
[agents.sampling]
max_tokens = 5
stop_token_ids = [14]

[graph]
kind = "dynamic"
edges = [["solver_a", "verifier"], ["verifier", "solver_b"]]
start = "solver_a"
max_steps = 4

[[graph.routes]]
after = "solver_a"
next = "verifier"

[[graph.routes]]
after = "verifier"
when = "^0"
next = "solver_b"

[[graph.routes]]
after = "verifier"
next = "end"

[[graph.routes]]
after = "solver_b"
next = "end"

[reward]
name = "addition"

[tasks]
builtin = "addition"
"""


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def train(run: Path, workflow: str, model: Path | str, extra: list[str] = ()) -> dict:
    cmd = [*CLI, "--workflow", workflow, "--model", str(model), "--run-dir", str(run), *SMALL, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted((run / "logs").glob("*.log")))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:] + logs
    cfg = tomllib.loads((run / "config.toml").read_text())
    adapters = cfg["learner"]["adapters"]
    m = rows(run / "metrics.jsonl")
    assert [r["step"] for r in m] == [0, 1]
    versions = [r["version"] for r in m]
    assert versions == sorted(versions) and versions[-1] == 2
    for v in (1, 2):  # every adapter of the workflow, in every published version
        for a in adapters:
            assert (run / "adapters" / f"v{v}" / a / "adapter_config.json").is_file(), (v, a)
    log = (run / "logs" / "rollout-0.log").read_text()
    live = re.findall(r"adapters v(\d+) live on \S+ \(probe error .*; (\d+) of (\d+) adapters probed\)", log)
    versions_live = [int(v) for v, _, _ in live]
    assert versions_live and versions_live == sorted(versions_live) and versions_live[-1] == 2, log[-3000:]
    assert all(int(k) == int(n) == len(adapters) for _, k, n in live), live  # each adapter its own probe
    ev = rows(run / "eval.jsonl")
    assert ev and ev[-1]["version"] == 2 and 0.0 <= ev[-1]["reward_mean"] <= 1.0 + 1e-9
    return {"config": cfg, "eval": ev, "adapters": adapters, "out": proc.stdout}


@pytest.mark.usefixtures("embedded_model")
@pytest.mark.parametrize("workflow", ["addition-trio"])  # addition-duo: test_run_async.py, test_run_sync.py
def test_addition_workflows_train_on_the_embedded_model(tmp_path: Path, workflow: str) -> None:
    got = train(tmp_path / "run", workflow, "embedded")
    assert got["adapters"] == ["solver-lora", "verifier-lora"]
    assert {"solver_accuracy", "verifier_balanced_accuracy"} <= set(got["eval"][-1])
    assert "held-out (v0 -> v2)" in got["out"]


@pytest.mark.parametrize("workflow", ["math-duo", "math-trio", "code-reflect", "search-qa"])
def test_text_workflows_train_on_the_embedded_text_model(
    tmp_path: Path, workflow: str, embedded_text_model: Path
) -> None:
    got = train(tmp_path / "run", workflow, embedded_text_model)
    from teamrl.rollout.workflows import load

    wf = load(workflow)
    assert set(got["adapters"]) == {a.adapter for a in wf.agents if a.adapter}
    assert {f"{a.id}_accuracy" for a in wf.agents} <= set(got["eval"][-1])


@pytest.mark.usefixtures("embedded_model")
def test_a_user_workflow_with_routing_and_a_shared_adapter_trains(tmp_path: Path) -> None:
    path = tmp_path / "mine" / "two_solvers.toml"
    path.parent.mkdir()
    path.write_text(USER_WORKFLOW)
    got = train(tmp_path / "run", str(path), "embedded")
    lrn = got["config"]["learner"]
    assert lrn["adapters"] == ["solver-lora", "verifier-lora"]
    # each adapter its own rank, and the temperature its agents sample at (recomputed at it)
    assert lrn["agents"] == {
        "solver-lora": {"rank": 8, "temperature": 1.0},
        "verifier-lora": {"rank": 16, "temperature": 1.0},
    }
    assert got["config"]["rollout"]["workflow"] == str(path.resolve())
    assert got["config"]["rollout"]["max_lora_rank"] == 16
    from peft import LoraConfig

    ranks = {
        a: LoraConfig.from_pretrained(str(tmp_path / "run" / "adapters" / "v2" / a)).r
        for a in lrn["adapters"]
    }
    assert ranks == {"solver-lora": 8, "verifier-lora": 16}
    from teamrl.protocol.codec import decode_trajectories

    agents = {
        st.agent_id
        for p in (tmp_path / "run" / "samples").glob("*.arrow")
        for t in decode_trajectories(p.read_bytes())
        for st in t.steps
    }
    assert {"solver_a", "verifier"} <= agents


def test_a_random_llama_model_trains_one_step_end_to_end(tmp_path: Path, embedded_text_model: Path) -> None:
    from teamrl.models.text import build_random

    model = build_random(tmp_path / "llama", family="llama", tokenizer_from=embedded_text_model)
    assert json.loads((model / "config.json").read_text())["model_type"] == "llama"
    got = train(tmp_path / "run", "math-duo", model)
    assert got["config"]["learner"]["lora"]["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
