"""A learner's weights side: export each adapter version, announce it to rollouts, prune old ones.

``AdapterPublisher`` (rank 0 of ``teamrl.learner.service.LearnerService``) exports the LoRA adapters
(PEFT safetensors) to ``RUN/adapters/vV`` and announces them as ``WeightsPublished`` on the weights
PUB socket and its "latest" endpoint: inline chunks of a deterministic tar or the folder's URI, the
sha256 of the bytes as they travel, and one probe per adapter (prompt, completion, this learner's
log-probs of it, within :func:`probe_atol`; a bfloat16 learner may compute them in float32 from the
exported files, :mod:`teamrl.learner.probe_ref`) that a rollout reproduces before it uses the version.
The last 8 version folders are kept. LangMARL profile versions go out on the same sockets. Before a
version goes out, :func:`announce_version` tells the replay buffer (docs/security.md, "Versions").
docs/architecture.md §8 ("WeightsPublished and the hot-load") describes the message and its checks.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from teamrl.learner import metrics as M

log = logging.getLogger("teamrl.learner")

ANNOUNCE_ATTEMPTS = 6  # x the RPC timeout (10 s): how long a restarting buffer is waited for

# bfloat16's machine epsilon (torch.finfo(torch.bfloat16).eps = 2**-7): 8 significand bits, so a
# value is stored to within half of it relative to itself.
BF16_EPS = 2.0**-7


def probe_atol(dtype: str) -> float:
    """Tolerance the receiver's probe log-probs must meet, by the learner's model ``dtype``.

    float32: 1e-3 (the two sides run the same weights through different kernels). bfloat16: 8 eps
    (0.0625). bf16 keeps 8 significand bits, so a logit of magnitude 2-4 is only known to within
    2**-6, and the learner (DeepSpeed casts the LoRA weights to bf16) and a receiver computing the same
    adapter with other kernels (PEFT keeps LoRA weights in float32) differ by a few such steps:
    measured on an H200 with a Qwen2.5-0.5B-shaped model, up to 0.029 on log-probs near -12
    (``tests/bench/learner.py``, docs/gpu.md). A wrong or stale adapter moves log-probs by more.
    """
    return 8 * BF16_EPS if dtype == "bfloat16" else 1e-3


def make_probes(engine: Any, cfg: Any, dirs: dict[str, Path], ref: Any = None) -> dict[str, Any]:
    """One ``Probe`` per adapter of ``cfg.adapters`` exported to ``dirs``: the probe tokens and their
    expected log-probs, from the learner ``engine`` or, given ``ref`` (a
    :class:`teamrl.learner.probe_ref.Float32Probe`), from the exported files in float32; the tolerance
    is ``cfg.probe_atol`` or :func:`probe_atol` of the dtype the expectation was computed in."""
    from teamrl.protocol.control import Probe

    prompt, completion = list(cfg.probe_prompt), list(cfg.probe_completion)
    atol = cfg.probe_atol or probe_atol("float32" if ref is not None else engine.dtype)

    def expected(a: str) -> list[float]:
        if ref is not None:
            return ref.logprobs(dirs[a], prompt, completion)
        return engine.completion_logprobs(a, prompt, completion)

    return {
        a: Probe(prompt_ids=prompt, completion_ids=completion, expected_logprobs=expected(a), atol=atol)
        for a in cfg.adapters
    }


def probe_reference(cfg: Any, engine: Any) -> Any:
    """The float32 reference of a learner that trains in another dtype and is asked for float32
    probes (``probe_dtype = "float32"``); None when the learner's own log-probs are the probe."""
    if cfg.probe_dtype != "float32" or engine.dtype == "float32":
        return None
    from teamrl.learner.probe_ref import Float32Probe

    return Float32Probe(cfg.base_model)


class AdapterPublisher:
    """Exports and announces adapter versions (and profile versions) on a ``WeightsPublisher``."""

    def __init__(
        self, socket: Any, engine: Any, cfg: Any, run_dir: Path, model: str, timeline: Any = None
    ) -> None:
        self.socket = socket  # teamrl.protocol.zmq_transport.WeightsPublisher: PUB + "latest"
        self.engine = engine  # LearnerEngine: exports the adapters and computes the probes
        self.cfg = cfg  # LearnerConfig: adapters, probe tokens, publish mode and sizes
        self.run_dir = run_dir
        self.model = model
        self.timeline = timeline  # teamrl.protocol.timeline.Timeline: export, then publish
        self.probe_ref = probe_reference(cfg, engine)  # float32 probes of a bfloat16 learner, or None

    def publish(self, version: int, *, final: bool) -> dict[str, float]:
        """Export the adapters as ``version`` and announce them; the step's publish metrics."""
        from teamrl.protocol.adapters import ADAPTER_FILES

        t0 = time.perf_counter()
        folder = self.run_dir / "adapters" / f"v{version}"
        self._enter("export")
        dirs = self.engine.export_adapters(folder)
        size = sum((d / f).stat().st_size for d in dirs.values() for f in ADAPTER_FILES)
        self._enter("publish")
        self.socket.publish(self._message(version, final, folder, dirs, size))
        dt = time.perf_counter() - t0
        M.PUBLISH_SECONDS.observe(dt)
        M.VERSION.set(version)
        self._prune_adapters()
        return {"publish_seconds": dt, "payload_bytes": float(size)}

    def _enter(self, state: str) -> None:
        if self.timeline is not None:
            self.timeline.enter(state)

    def _message(self, version: int, final: bool, folder: Path, dirs: dict[str, Path], size: int) -> Any:
        """The ``WeightsPublished`` of the exported ``dirs``: where they are, their digest, probes."""
        from teamrl.protocol.adapters import adapters_sha256, payload_sha256, write_adapter_payload
        from teamrl.protocol.control import InlineWeights, UriWeights, WeightsPublished

        cfg = self.cfg
        # every adapter gets its own probe: a rollout verifies each before using the version
        probes = make_probes(self.engine, cfg, dirs, self.probe_ref)
        # the digest of the bytes as they travel: the tar when inline, the files themselves when shared
        if cfg.publish_mode == "inline" and size <= cfg.inline_max_bytes:
            payload, n = write_adapter_payload(dirs), cfg.chunk_bytes
            location: Any = InlineWeights(chunks=[payload[i : i + n] for i in range(0, len(payload), n)])
            sha = payload_sha256(payload)
        else:  # no archive: rollouts copy the files, check the copy and load it
            location = UriWeights(uri=str(folder.resolve()))
            sha = adapters_sha256(dirs)
        return WeightsPublished(
            announce_seq=0,
            version=version,
            adapters={a: a for a in cfg.adapters},
            location=location,
            sha256=sha,
            probe=probes[cfg.adapters[0]],
            base_model=self.model,
            probes=probes,
            final=final,
        )

    def _prune_adapters(self, keep: int = 8) -> None:
        root = self.run_dir / "adapters"
        olds = sorted(
            (p for p in root.iterdir() if p.name.startswith("v") and p.name[1:].isdigit()),
            key=lambda p: int(p.name[1:]),
        )
        for p in olds[:-keep]:
            shutil.rmtree(p, ignore_errors=True)

    def publish_profiles(self, msg: Any) -> None:
        """Announce a LangMARL profile version (served on the latest endpoint too)."""
        self.socket.publish_profiles(msg)

    def close(self) -> None:
        time.sleep(0.2)  # let the last announcement leave
        self.socket.close()


def announce_version(
    rpc: Any, model_id: str | None, agent_ids: list[str], version: int, attempts: int = ANNOUNCE_ATTEMPTS
) -> bool:
    """``VersionAnnounce`` to the replay buffer over ``rpc`` (an ``RpcClient``): base ``model_id`` (None:
    every base) is published at ``version`` for ``agent_ids``. The buffer's only source of versions
    (docs/security.md), so the learner sends it *before* ``WeightsPublished`` and asks up to
    ``attempts`` times (a restarting buffer): frames of a version the buffer never heard of are
    refused, and the learner would wait for data that cannot come. True when the buffer answered (a
    refusal is logged: the buffer counted it)."""
    from teamrl.protocol.control import ErrorReply, VersionAnnounce
    from teamrl.protocol.errors import PeerTimeout

    msg = VersionAnnounce(model_id=model_id, version=version, agent_ids=agent_ids)
    for attempt in range(1, attempts + 1):
        try:
            reply = rpc.call(msg)
            break
        except PeerTimeout:
            log.warning(
                "the buffer did not answer version %d's announcement (%d/%d)", version, attempt, attempts
            )
    else:
        log.error("version %d was never announced to the buffer: its frames will be refused", version)
        return False
    if isinstance(reply, ErrorReply):
        log.error("the buffer refused version %d (%s): %s", version, reply.reason, reply.message)
    return True
