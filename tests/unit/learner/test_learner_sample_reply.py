"""A learner rank's sample loop (``LearnerService.sample``) against an unreadable reply: counted by
reason, logged, asked for again; the good reply that follows is used, columnar, with its weights.
The buffer is a stand-in here (the loop is the subject; the real RPC pair is tested in protocol)."""

from __future__ import annotations

from types import SimpleNamespace

from teamrl.learner import metrics as M
from teamrl.learner import service as S
from teamrl.protocol.codec import TrajectoryBatch, encode_trajectories_buffer
from teamrl.protocol.control import SampleReply
from teamrl.protocol.examples import example_trajectories
from teamrl.protocol.timeline import Timeline


class _Buffer:
    def __init__(self, replies: list) -> None:
        self.replies, self.endpoint, self.asked = replies, "inproc://buffer", 0

    def call(self, req):
        self.asked += 1
        return self.replies.pop(0)


def test_an_unreadable_reply_is_counted_and_asked_for_again(monkeypatch) -> None:
    monkeypatch.setattr(S, "SAMPLE_POLL_S", 0.0)
    good = example_trajectories(3, seed=2, tokens=8)
    frame = encode_trajectories_buffer(good)
    garbage = b"\x00 not an Arrow stream" * 4
    svc = S.LearnerService.__new__(S.LearnerService)
    svc.cfg = SimpleNamespace(batch_size=3, min_policy_version_lag=-1, group="", group_agents=[])
    svc.version, svc.rank, svc.stop_reason, svc.sample_timeout_s, svc._request_id = 0, 0, None, 30.0, 0
    svc.timeline = Timeline("learner", "0", None)  # counters only, no file
    svc.rpc = _Buffer(
        [
            SampleReply.carrying(garbage, request_id=1, count=3, weights=[1.0] * 3),
            SampleReply.carrying(frame, request_id=2, count=3, weights=[0.5, 1.0, 2.0]),
        ]
    )
    before = M.SAMPLE_ERRORS.labels("decode_error")._value.get()
    got, weights, _ = svc.sample()
    assert M.SAMPLE_ERRORS.labels("decode_error")._value.get() == before + 1
    assert svc.rpc.asked == 2 and all(isinstance(b, TrajectoryBatch) for b in got)
    assert [t.episode_id for b in got for t in b.trajectories()] == [t.episode_id for t in good]
    assert weights == [0.5, 1.0, 2.0]
