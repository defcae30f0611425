# Thin targets: the logic lives in scripts/ and the teamrl CLI.
VENV := .venv
PY := $(VENV)/bin/python
export DS_ACCELERATOR ?= cpu
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test test-fast bench results bench-results real-model-results lint format check-deploy clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/teamrl demo

# the slow and vLLM tests one at a time, the fast tests beside them (scripts/test.sh, docs/running.md)
test: setup
	@bash scripts/test.sh

test-fast: setup
	$(PY) -m pytest -m "not gpu and not slow and not vllm" -q

bench: setup
	$(PY) tests/bench/transport.py --quick
	$(PY) tests/bench/rollout.py --quick
	$(PY) tests/bench/learner.py --quick
	$(PY) tests/bench/rollout_scaling.py --quick

# The README's results (a)-(c), each over 5 seeds (mean and 95 % CI), their plots and table in
# docs/results/ (runs kept in runs/results/): about 30-60 minutes on 2 cores ((b) took 10 runs of ~60 s);
# then (e), the role-swap ablation (one training run and five evaluations: about 6 minutes), and (f),
# the staleness table (10 sync runs: about 25 minutes), and (g), the team whose verifier learns
# (5 runs of addition-duo-checked and their trio evaluations: about 30 minutes), and (h), async
# against sync where the world waits (reward latency 0.5 s) and where episodes vary (addition-trio):
# 14 runs, about 20 minutes.
# Prints figures, asserts none.
results: setup
	$(PY) tests/bench/compare_runs.py mode --out runs/results/mode
	$(PY) tests/bench/compare_runs.py algorithm --steps 40 --reward-scale verifier=10 --out runs/results/algorithm
	$(PY) tests/bench/compare_runs.py update-order --steps 40 --out runs/results/update-order
	$(PY) tests/bench/compare_runs.py table runs/results docs/results
	$(PY) tests/bench/role_swap.py --run-dir runs/results/role-swap --out docs/results/role_swap
	$(PY) tests/bench/staleness.py --runs runs/results/staleness --out docs/results/staleness
	$(PY) tests/bench/checked_team.py --out runs/results/checked-team --docs docs/results/checked_team
	$(PY) tests/bench/compare_runs.py mode --reward-latency 0.5 --seeds 4 --out runs/results/mode-latency
	$(PY) tests/bench/compare_runs.py mode --workflow addition-trio --seeds 3 --out runs/results/mode-trio

# The real model's results (docs/real-model.md; SmolLM2-135M-Instruct, built on first use): LangMARL's
# judge, free text against structured outputs (about 8 minutes), profile evolution (about 17 minutes),
# a team's held-out accuracy before and after 30 minutes of RL (at most 28 steps) over 7 seeds (about 34
# minutes a seed, 37 where the CPU lacks AMX), and
# the team with a verifier, 30 minutes of RL over 3 seeds (about 39 minutes a seed), MARFT's anonymous
# agents at base weights (3 seeds, about 23 minutes), and Dr. MAS against GRPO and HAPPO's factor
# clipped, as first gradients (3 seeds of two settings each, about 35 minutes each): about 8 hours on 2
# cores. Prints figures, asserts none. The learner trains in bfloat16 (REAL_MODEL_DTYPE), which needs a
# CPU with AVX-512 BF16 or AMX (or a GPU): elsewhere it is emulated, 23x slower, and the target stops at
# once unless REAL_MODEL_DTYPE=float32 (a different recipe from the one docs/real-model.md reports).
REAL_MODEL_DTYPE ?= bfloat16
REAL_MODEL_GRADIENTS = --workflow tests/bench/workflows/math-duo-two-number.toml --model smollm2-135m \
	--tasks runs/results/two15.jsonl --steps 3 --tasks-per-step 2 --group-size 8 --eval-interval 0 \
	--eval-tasks 8 --seed 1 --seeds 3 --reward-scale solver=10 --set learner.lr=0.0005
real-model-results: setup
	@[ "$(REAL_MODEL_DTYPE)" != bfloat16 ] || $(PY) -c "import sys; from teamrl.learner.cpu import bfloat16_warning as w; \
		sys.exit(f'real-model-results: {w()}; or REAL_MODEL_DTYPE=float32') if w() else None"
	$(PY) tests/bench/judge_credit.py --workflow tests/bench/workflows/math-duo-d1-judge.toml --out docs/results/profiles/judge_credit.json
	$(PY) tests/bench/profile_evolution.py --run-dir runs/results/profile-evolution --out docs/results/profiles
	$(PY) tests/bench/tasks/make_two_number.py --unique --low 1 --high 15 runs/results/two15.jsonl
	$(PY) tests/bench/real_model_learning.py --tasks runs/results/two15.jsonl --runs runs/results/real-model-duo \
		--seeds 1,2,3,4,5,6,7 --steps 28 --max-minutes 30 --set learner.dtype=$(REAL_MODEL_DTYPE) --out docs/results/real-model/duo-bf16
	$(PY) tests/bench/real_model_learning.py --workflow tests/bench/workflows/math-trio-two-number.toml \
		--tasks runs/results/two15.jsonl --runs runs/results/real-model-trio --seeds 1,2,3 --steps 60 --max-minutes 30 \
		--set learner.dtype=$(REAL_MODEL_DTYPE) --out docs/results/real-model/trio-balanced
	$(PY) tests/bench/anonymous_agents.py --tasks runs/results/two15.jsonl --seeds 1,2,3 \
		--out docs/results/real-model/anonymous-base
	$(PY) tests/bench/compare_runs.py algorithm $(REAL_MODEL_GRADIENTS) --out runs/results/real-model-algorithm
	$(PY) tests/bench/compare_runs.py factor-clip $(REAL_MODEL_GRADIENTS) --factor-clip 2 \
		--out runs/results/real-model-factor-clip

# (d) rollout scaling, plus everything of `results`.
bench-results: results
	$(PY) tests/bench/rollout_scaling.py

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

check-deploy: setup
	$(PY) -m pytest tests/unit/deploy -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
