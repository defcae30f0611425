"""Issue 30's attacks on the buffer's versions and ids, each under CURVE and in plaintext: nothing a
peer claims moves a version, only the learner's announcement does (docs/security.md). The learner
puts its base at version 3; then

* the learner key (or, in plaintext, anyone) asks ``SampleRequest(min_policy_version=2**62)``,
* 100 hints, each inside the version window (current + 9,999),
* 10 data frames at versions 10,000 .. 100,000,
* the learner key announces 2**62,

and the version is still 3, nothing held was evicted, fresh data at version 3 is still accepted,
and the same holds after the buffer restarts from its checkpoint. The service runs in this process
and is driven turn by turn (``test_buffer_bounds``)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from test_buffer_bounds import _call_while_serving, _pump

from teamrl.learner.buffer_config import BufferConfig
from teamrl.learner.buffer_service import BufferService
from teamrl.protocol.codec import encode_trajectories
from teamrl.protocol.config import TransportConfig
from teamrl.protocol.control import ErrorReply, SampleRequest, VersionAnnounce
from teamrl.protocol.curve import generate_run_keys
from teamrl.protocol.examples import example_trajectories
from teamrl.protocol.zmq_transport import RpcClient, ZmqDataSender

BASE = "Qwen/Qwen3-0.6B"  # the examples' model id
AGENTS = ["solver", "critic", "judge"]  # the examples' agents


def _frame(version: int, seed: int, model_id: str = BASE) -> bytes:
    batch = example_trajectories(2, seed=seed, tokens=8)
    for t in batch:
        for s in t.steps:
            s.policy_version = version
            s.model_id = model_id
    return encode_trajectories(batch)


class _Run:
    """A buffer service with a learner RPC client and a rollout sender, CURVE or plaintext."""

    def __init__(self, tmp_path: Path, curve: bool, **cfg: object) -> None:
        self.transport = (
            TransportConfig(curve=True, curve_dir=generate_run_keys(tmp_path / "curve"))
            if curve and not (tmp_path / "curve").exists()
            else TransportConfig(curve=curve, curve_dir=tmp_path / "curve" if curve else None)
        )
        self.cfg = BufferConfig(
            bind="tcp://127.0.0.1:*",
            sample_bind="tcp://127.0.0.1:*",
            dir=tmp_path / "buffer",
            max_policy_lag=4,
            checkpoint_interval_s=0.01,
            fsync=False,
            **cfg,
        )
        self.svc = BufferService(self.cfg, self.transport)
        self.learner = RpcClient(
            self.svc.rpc.endpoint, timeout_ms=5000, curve=self.transport.client_curve("learner", "buffer_rpc")
        )
        self.senders: list[ZmqDataSender] = []

    def call(self, msg: object) -> object:
        out = {}
        _call_while_serving(self.svc, lambda: out.setdefault("r", self.learner.call(msg)))
        return out["r"]

    def send(self, payload: bytes) -> None:
        """One frame from a fresh rollout incarnation, pumped until acked (or refused)."""
        sender = ZmqDataSender(
            self.svc.receiver.endpoint,
            f"rollout-{uuid.uuid4().hex[:8]}",  # a new incarnation each time
            window=2,
            ack_timeout_s=5,
            curve=self.transport.client_curve("rollout", "buffer_data"),
        )
        self.senders.append(sender)
        sender.send(payload)
        _pump(self.svc, lambda: sender._pump(0) or sender.unacked == 0)

    def close(self) -> None:
        for s in self.senders:
            s.close()
        self.learner.close()
        self.svc.close()


def _attack(run: _Run) -> None:
    r = run.call(SampleRequest(request_id=1, batch_size=1, rank=0, model_id=BASE, min_policy_version=2**62))
    assert isinstance(r, ErrorReply) and r.reason == "policy_version_out_of_range"
    for i in range(100):
        hint = run.svc.buffer.current_version + 9_999
        r = run.call(SampleRequest(request_id=2 + i, batch_size=1, rank=0, min_policy_version=hint))
        assert isinstance(r, ErrorReply) and r.reason == "policy_version_unpublished", r
    for k in range(1, 11):
        run.send(_frame(10_000 * k, seed=10 + k))
    r = run.call(VersionAnnounce(model_id=BASE, version=2**62))
    assert isinstance(r, ErrorReply) and r.reason == "policy_version_out_of_range"


@pytest.mark.parametrize("curve", [False, True], ids=["plaintext", "curve"])
def test_peers_claims_leave_the_version_where_the_learner_put_it(tmp_path: Path, curve: bool) -> None:
    run = _Run(tmp_path, curve)
    try:
        assert run.call(VersionAnnounce(model_id=BASE, version=3, agent_ids=AGENTS)).type == "buffer_stats"
        run.send(_frame(3, seed=1))
        assert (run.svc.buffer.size, run.svc.buffer.current_versions) == (2, {BASE: 3})
        before = dict(run.svc.buffer.rejected)
        _attack(run)
        buf = run.svc.buffer
        refused = {k: v - before.get(k, 0) for k, v in buf.rejected.items() if v != before.get(k, 0)}
        print(
            f"{'CURVE' if curve else 'plaintext'}: after the attacks version {buf.current_version}, "
            f"per base {buf.current_versions}, held {buf.size}, refused {refused}"
        )
        assert (buf.current_version, buf.current_versions, buf.size) == (3, {BASE: 3}, 2)
        assert refused == {"policy_version_out_of_range": 11, "policy_version_unpublished": 101}
        run.send(_frame(3, seed=2))  # fresh data still accepted
        assert buf.size == 4
        run.svc.checkpoint(time.monotonic())
        assert run.svc.store.load()[0]["current_versions"] == {BASE: 3}
    finally:
        run.close()

    again = _Run(tmp_path, curve)  # the restarted buffer, from its checkpoint
    try:
        buf = again.svc.buffer
        assert (buf.current_version, buf.current_versions, buf.size) == (3, {BASE: 3}, 4)
        _attack(again)
        again.send(_frame(3, seed=3))
        assert (buf.current_version, buf.size) == (3, 6)
        assert again.call(VersionAnnounce(model_id=BASE, version=4)).type == "buffer_stats"
        again.send(_frame(4, seed=4))  # the learner moves it; data follows
        print(f"after a restart: version {buf.current_versions}, held {buf.size}")
        assert (buf.current_versions, buf.size) == ({BASE: 4}, 8)
    finally:
        again.close()


@pytest.mark.parametrize("curve", [False, True], ids=["plaintext", "curve"])
def test_ids_come_from_the_plan(tmp_path: Path, curve: bool) -> None:
    run = _Run(tmp_path, curve, model_ids=[BASE], agent_ids=AGENTS)
    try:
        before = dict(run.svc.buffer.rejected)
        run.send(_frame(0, seed=1, model_id="QUen/Qwen3-0.6B"))  # a byte-flipped model id
        run.send(_frame(0, seed=2, model_id="Qwen/Qwe;3-0.6B"))
        r = run.call(SampleRequest(request_id=1, batch_size=1, rank=0, agent_ids=["intruder"]))
        assert isinstance(r, ErrorReply) and r.reason == "unknown_agent_id"
        r = run.call(VersionAnnounce(model_id="other/base", version=1))
        assert isinstance(r, ErrorReply) and r.reason == "unknown_model_id"
        buf = run.svc.buffer
        assert buf.size == 0 and buf.current_versions == {}
        assert buf.rejected["unknown_model_id"] - before.get("unknown_model_id", 0) == 3
        assert buf.rejected["unknown_agent_id"] - before.get("unknown_agent_id", 0) == 1
        run.send(_frame(0, seed=3))  # the plan's ids still get in
        assert buf.size == 2
    finally:
        run.close()


def test_a_buffer_without_a_plan_keeps_no_version_a_frame_names(tmp_path: Path) -> None:
    run = _Run(tmp_path, curve=False)
    try:
        run.send(_frame(7, seed=1, model_id="QUen/Qwen3-0.6B"))
        buf = run.svc.buffer
        assert buf.size == 2 and buf.current_versions == {} and buf.current_version == -1
        r = run.call(VersionAnnounce(model_id=BASE, version=1, agent_ids=AGENTS))
        assert r.type == "buffer_stats" and buf.current_versions == {BASE: 1}
        assert buf.ids.models == {BASE}  # learnt from the announcement, at most MAX_KNOWN_IDS
    finally:
        run.close()


def test_ranks_and_views_are_bounded(tmp_path: Path) -> None:
    from teamrl.learner.buffer_claims import MAX_RANKS

    run = _Run(tmp_path, curve=False)
    try:
        r = run.call(SampleRequest(request_id=1, batch_size=1, rank=MAX_RANKS))
        assert isinstance(r, ErrorReply) and r.reason == "view_limit"
    finally:
        run.close()


def test_a_runs_plan_names_the_buffers_ids(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "foundation"))
    from test_team_plan import fake_model

    from teamrl.cli.plan import plan
    from teamrl.cli.run import parse_args

    model = fake_model(tmp_path / "m")
    args = parse_args(["--workflow", "addition-duo", "--model", str(model)], "teamrl run", None, "r")
    buffer = plan(args).config["buffer"]
    assert (buffer["model_ids"], sorted(buffer["agent_ids"])) == (["embedded-v1"], ["solver", "verifier"])
    BufferConfig(**buffer)  # the service's own config model takes it


def test_a_one_base_learners_announcement_shows_in_stats_for_the_plans_base(tmp_path: Path) -> None:
    run = _Run(tmp_path, curve=False, model_ids=[BASE], agent_ids=AGENTS)
    try:
        assert run.call(VersionAnnounce(version=5)).type == "buffer_stats"  # model_id None: every base
        assert run.svc.stats().current_versions == {BASE: 5} and run.svc.buffer.current_version == 5
        run.send(_frame(6, seed=1))  # above it: refused
        run.send(_frame(5, seed=2))
        assert run.svc.buffer.size == 2 and run.svc.buffer.rejected["policy_version_unpublished"] == 1
    finally:
        run.close()


def test_an_announcement_is_durable_before_its_reply(tmp_path: Path) -> None:
    """The learner publishes right after the reply; a buffer killed then must not come back with an
    older version and refuse that version's frames."""
    run = _Run(tmp_path, curve=False)
    try:
        assert run.call(VersionAnnounce(model_id=BASE, version=7)).type == "buffer_stats"
        assert run.svc.store.load()[0]["current_versions"] == {BASE: 7}  # no checkpoint asked for
    finally:
        run.close()


def test_the_learner_asks_a_restarting_buffer_again() -> None:
    from teamrl.learner.publish import announce_version
    from teamrl.protocol.control import BufferStats
    from teamrl.protocol.errors import PeerTimeout

    class Rpc:
        def __init__(self, timeouts: int) -> None:
            self.timeouts, self.calls = timeouts, []

        def call(self, msg: object) -> object:
            self.calls.append(msg)
            if len(self.calls) <= self.timeouts:
                raise PeerTimeout("no reply")
            return BufferStats(size=0)

    rpc = Rpc(timeouts=2)
    assert announce_version(rpc, BASE, AGENTS, 4) and len(rpc.calls) == 3
    assert rpc.calls[0] == VersionAnnounce(model_id=BASE, version=4, agent_ids=AGENTS)
    gone = Rpc(timeouts=99)
    assert not announce_version(gone, None, [], 4, attempts=3) and len(gone.calls) == 3
