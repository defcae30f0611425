#!/usr/bin/env bash
# The learner's checks on a CUDA machine, in one go (docs/gpu.md):
#   1. the `gpu`-marked engine tests (train step, checkpoint + resume, export + probe-verified PEFT load)
#   2. tests/bench/learner.py on a random-initialised Qwen2.5-0.5B-shaped model, bf16, at
#      16 rows x (256 + 256) tokens (push of a rank-16 adapter) and 32 x (256 + 768) (rank 8),
#      our train_step against bare PyTorch + PEFT in the same run, plus a torch profile of both.
# Everything is written to $OUT/log (default /tmp/gpu_check/log).
#
#   bash scripts/gpu_check.sh                 # on the GPU machine, python3 = the image's torch
#   WHEELS= DEVICE=cpu PY=.venv/bin/python SIZES="4:8:8" MODEL_ARGS="" BENCH_EXTRA="--rounds 2 --pushes 2" \
#       bash scripts/gpu_check.sh             # dry run on a CPU machine (embedded model, tiny sizes)
#
# Wheels in .whl/ (packages the machine lacks: deepspeed, pydantic, hjson, pyzmq, ...) are installed
# into /tmp/site first; the teamrl packages run from the source tree (PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
SIZES=${SIZES:-"16:256:256 32:256:768"}
MODEL_ARGS=${MODEL_ARGS---random-init-qwen05b}
BENCH_EXTRA=${BENCH_EXTRA:-}
WHEELS=${WHEELS-.whl}  # empty: install nothing (a dry run; the carried wheels are for python 3.12)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

main() {
    if [ -n "$WHEELS" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$WHEELS"/*.whl || return 1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONPATH=packages/protocol/src:packages/learner/src:packages/rollout/src:packages/rewards/src:src:${PYTHONPATH:-}
    [ "$DEVICE" = cpu ] && export DS_ACCELERATOR=cpu TEAMRL_GPU_TEST_DEVICE=cpu
    echo "== machine"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    "$PY" -c "import torch, transformers, peft, deepspeed; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'peft', peft.__version__, 'deepspeed', deepspeed.__version__)"
    echo "== gpu tests"
    "$PY" -m pytest -m gpu tests/unit/learner/test_engine_gpu.py -q -p no:cacheprovider -o addopts="-ra" 2>&1
    local first=1
    for size in $SIZES; do
        IFS=: read -r rows prompt response <<<"$size"
        local push=""
        [ $first = 1 ] && push="--push-rank 16 --profile 3"
        first=0
        echo "== bench $rows x ($prompt + $response)"
        # shellcheck disable=SC2086
        echo "$PY tests/bench/learner.py --device $DEVICE $MODEL_ARGS --rows $rows --prompt $prompt --response $response $push $BENCH_EXTRA"
        # shellcheck disable=SC2086
        "$PY" tests/bench/learner.py --device "$DEVICE" $MODEL_ARGS --rows "$rows" --prompt "$prompt" \
            --response "$response" $push $BENCH_EXTRA 2>&1 | grep -v -E "Warning|warnings.warn|Loading weights"
    done
    echo "== done"
}
main 2>&1 | tee "$OUT/log"
