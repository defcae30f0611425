"""The buffer service as a real process on loopback: ingest with acks, sample over RPC, a malformed
frame refused while the service keeps serving, kill -9 and restart with nothing lost or duplicated,
SIGTERM and Shutdown exit 0, and the CLI's config errors."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from teamrl.learner.buffer_service import build_parser, load_config, main
from teamrl.protocol.codec import decode_trajectories, encode_trajectories
from teamrl.protocol.control import (
    BufferStats,
    BufferStatsRequest,
    ErrorReply,
    Heartbeat,
    Hello,
    SampleReply,
    SampleRequest,
    Shutdown,
)
from teamrl.protocol.examples import example_trajectories
from teamrl.protocol.ports import free_port
from teamrl.protocol.zmq_transport import RpcClient, ZmqDataSender

FAST_HB = {"heartbeat_ivl_ms": 200, "heartbeat_timeout_ms": 1000}


class Buffer:
    """One buffer process with its own folder and ports; restartable on the same ones."""

    def __init__(self, folder: Path, **extra: object) -> None:
        self.dir = folder / "buffer"
        self.bind = f"tcp://127.0.0.1:{free_port()}"
        self.sample_bind = f"tcp://127.0.0.1:{free_port()}"
        self.metrics_port = free_port()
        # Example trajectories span policy versions 0..49, so the lag bound is wide open here.
        fields = {"max_policy_lag": 1000, "checkpoint_interval_s": 0.05, "fsync": True, **extra}
        body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in fields.items())
        self.config = folder / "teamrl.toml"
        self.config.write_text(f"[other]\nx = 1\n\n[buffer]\n{body}\n")
        self.proc: subprocess.Popen | None = None

    def start(self) -> Buffer:
        cmd = [sys.executable, "-m", "teamrl.learner.buffer_service", "--config", str(self.config)]
        cmd += ["--bind", self.bind, "--sample-bind", self.sample_bind, "--dir", str(self.dir)]
        cmd += ["--metrics-port", str(self.metrics_port), "--insecure"]  # plaintext on loopback
        self.log = open(self.dir.parent / "buffer.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        # Wait for the port with plain TCP first: a ZeroMQ client dialling a closed port backs off
        # (up to 2 s between tries), which would make every start look slow.
        port = int(self.sample_bind.rsplit(":", 1)[1])
        deadline = time.monotonic() + 20
        while True:
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, "buffer did not come up:\n" + self.output()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.05)
        self.rpc = RpcClient(self.sample_bind, timeout_ms=3000, **FAST_HB)
        assert isinstance(self.rpc.call(BufferStatsRequest(), 5000), BufferStats)
        return self

    def admin(self) -> RpcClient:
        """A client of the operator's local admin socket (the only way to stop it without CURVE)."""
        return RpcClient(f"ipc://{self.dir.resolve() / 'admin.sock'}", timeout_ms=3000)

    def stats(self) -> BufferStats:
        reply = self.rpc.call(BufferStatsRequest())
        assert isinstance(reply, BufferStats), reply
        return reply

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def output(self) -> str:
        self.log.flush()
        return (self.dir.parent / "buffer.log").read_text(errors="replace")[-4000:]

    def wait(self, timeout: float = 15) -> int:
        assert self.proc is not None
        rc = self.proc.wait(timeout)
        self.rpc.close()
        self.log.close()
        return rc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.wait()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


@pytest.fixture
def buffer(tmp_path):
    b = Buffer(tmp_path)
    yield b
    b.kill()


def test_ingest_sample_reject_and_sigterm(buffer):
    buffer.start()
    sender = ZmqDataSender(buffer.bind, "rollout-7", window=4, ack_timeout_s=5, **FAST_HB)
    batch = example_trajectories(8, seed=7, tokens=16)
    sender.send(encode_trajectories(batch[:5]))
    sender.send(encode_trajectories(batch[5:]))
    assert sender.flush(10), buffer.output()  # acked: so they are in a complete checkpoint
    st = buffer.stats()
    assert st.size == 8 and st.inserted == 8 and st.rejected == 0
    assert st.per_agent["solver"] == sum(1 for t in batch for s in t.steps if s.agent_id == "solver")

    reply = buffer.rpc.call(SampleRequest(request_id=11, batch_size=3, rank=0))
    assert isinstance(reply, SampleReply) and reply.request_id == 11 and reply.count == 3
    got = decode_trajectories(reply.trajectories)
    assert [t.episode_id for t in got] == ["ep-7-0", "ep-7-1", "ep-7-2"]  # fifo
    assert reply.weights == [1.0, 1.0, 1.0]

    sender.send(b"\x00 definitely not an Arrow stream")
    assert sender.flush(10) and sender.peer_rejected == 1  # refused for good, not resent
    st = buffer.stats()
    assert st.size == 5 and st.rejected == 1 and st.sampled == 3  # still serving
    sender.send(encode_trajectories(example_trajectories(1, seed=8, tokens=16)))
    assert sender.flush(10) and buffer.stats().size == 6  # and still ingesting

    text = buffer.metrics()
    assert metric(text, 'teamrl_buffer_rejected_total{reason="decode_error"}') == 1
    assert metric(text, "teamrl_buffer_size") == 6
    assert metric(text, "teamrl_buffer_inserted_total") == 9
    assert metric(text, "teamrl_buffer_sampled_total") == 3

    # a rollout registers (Hello) and beats on the RPC endpoint; both are answered with stats
    hello = buffer.rpc.call(Hello(service="rollout", incarnation="rollout-7", capabilities=["arrow-v1"]))
    beat = buffer.rpc.call(Heartbeat(incarnation="rollout-7", seq=0, time=time.time()))
    assert isinstance(hello, BufferStats) and isinstance(beat, BufferStats) and beat.size == 6

    buffer.proc.send_signal(signal.SIGTERM)
    assert buffer.wait() == 0
    sender.close()
    lines = [json.loads(x) for x in (buffer.dir / "stats.jsonl").read_text().splitlines()]
    last = lines[-1]
    assert last["size"] == 6 and last["inserted"] == 9 and last["sampled"] == 3
    assert last["rejected"] == {"decode_error": 1} and last["groups_pending"] == 0
    assert set(last) == {
        "time",
        "size",
        "inserted",
        "sampled",
        "rejected",
        "evicted",
        "groups_pending",
        "max_policy_version",
        "producers_alive",
        "producers_seen",
    }
    assert last["producers_seen"] == 1 and last["producers_alive"] == 1


def test_sigkill_restart_keeps_acked_data_and_dedups_resends(buffer):
    buffer.start()
    batch = example_trajectories(6, seed=3, tokens=16)
    frames = [encode_trajectories(batch[i : i + 2]) for i in range(0, 6, 2)]
    sender = ZmqDataSender(buffer.bind, "rollout-3", window=4, ack_timeout_s=5, **FAST_HB)
    for f in frames:
        sender.send(f)
    assert sender.flush(10), buffer.output()
    sender.close()
    assert isinstance(buffer.rpc.call(SampleRequest(request_id=1, batch_size=1, rank=0)), SampleReply)
    time.sleep(0.2)  # a checkpoint interval: the sample is in the state too
    before = buffer.stats()
    assert before.size == 5
    # A second producer is mid-stream when the buffer is killed (maybe mid-checkpoint).
    streaming = ZmqDataSender(buffer.bind, "rollout-4", window=16, ack_timeout_s=1, **FAST_HB)
    stream = example_trajectories(16, seed=4, tokens=16)
    for i in range(0, 16, 2):
        streaming.send(encode_trajectories(stream[i : i + 2]))
    streaming.flush(0.05)
    acked_at_kill = streaming.acked
    os.kill(buffer.proc.pid, signal.SIGKILL)
    assert buffer.wait() == -signal.SIGKILL

    buffer.start()
    after = buffer.stats()
    assert after.sampled == 1 and after.size == after.inserted - 1
    assert after.size >= before.size + 2 * acked_at_kill  # every acked frame survived
    assert streaming.flush(10), buffer.output()  # the rest is resent after the reconnect
    streaming.close()
    # The first producer incarnation resends everything (seqs 0..2): de-duplicated, re-acked.
    again = ZmqDataSender(buffer.bind, "rollout-3", window=4, ack_timeout_s=5, **FAST_HB)
    for f in frames:
        again.send(f)
    assert again.flush(10), buffer.output()
    again.close()
    st = buffer.stats()
    assert (st.size, st.inserted) == (5 + 16, 6 + 16)
    assert metric(buffer.metrics(), "teamrl_buffer_duplicates_total") >= 3
    reply = buffer.rpc.call(SampleRequest(request_id=2, batch_size=100, rank=0))
    assert isinstance(reply, SampleReply)
    got = sorted(t.episode_id for t in decode_trajectories(reply.trajectories))
    assert got == sorted([f"ep-3-{i}" for i in range(1, 6)] + [f"ep-4-{i}" for i in range(16)])  # once each
    empty = buffer.rpc.call(SampleRequest(request_id=3, batch_size=1, rank=0))
    assert isinstance(empty, ErrorReply) and empty.reason == "not_enough_data"
    refused = buffer.rpc.call(Shutdown(reason="an ordinary peer"))
    assert isinstance(refused, ErrorReply) and refused.reason == "not_admin"
    assert buffer.admin().call(Shutdown(reason="test")).type == "buffer_stats"
    assert buffer.wait() == 0


def test_rate_limited_and_groups_over_rpc(tmp_path):
    b = Buffer(
        tmp_path, group_size=2, min_size=2, samples_per_insert=1.0, error_buffer=2.0, max_times_sampled=0
    )
    try:
        b.start()
        batch = example_trajectories(4, seed=5, tokens=16)
        for i, t in enumerate(batch):
            t.group_id = f"g{i // 2}"
        sender = ZmqDataSender(b.bind, "rollout-5", window=4, ack_timeout_s=5, **FAST_HB)
        sender.send(encode_trajectories(batch[:3]))
        assert sender.flush(10)
        st = b.stats()
        assert st.size == 2 and st.inserted == 2  # g1 waits for its second episode
        sender.send(encode_trajectories(batch[3:]))
        assert sender.flush(10)
        sender.close()
        reply = b.rpc.call(SampleRequest(request_id=1, batch_size=2, rank=0))
        assert isinstance(reply, SampleReply) and reply.count == 2
        assert len({t.group_id for t in decode_trajectories(reply.trajectories)}) == 1
        # diff = 4 inserts - 2 samples = 2; floor = 2 * 1 - 2 = 0: two more, then refused.
        assert isinstance(b.rpc.call(SampleRequest(request_id=2, batch_size=2, rank=1)), SampleReply)
        limited = b.rpc.call(SampleRequest(request_id=3, batch_size=2, rank=0))
        assert isinstance(limited, ErrorReply) and limited.reason == "rate_limited"
        b.proc.send_signal(signal.SIGINT)
        assert b.wait() == 0
    finally:
        b.kill()


def test_bad_config_names_the_field_and_exits_2(tmp_path, capsys):
    # In-process: `python -m` runs sys.exit(main()), and the tests above start it that way.
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[buffer]\ncapacity = 0\nsampler = "lifo"\n')
    assert main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "buffer.capacity" in err and "buffer.sampler" in err and "'lifo'" in err
    assert main(["--config", str(cfg), "--metrics-port", "0"]) == 2  # flags do not hide file errors
    assert main(["--config", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    cfg.write_text("[buffer\n")
    assert main(["--config", str(cfg)]) == 2 and "not valid TOML" in capsys.readouterr().err
    cfg.write_text('[buffer]\nbind = "tcp://x:1"\nmin_size = 5\ncapacity = 4\n')
    assert (
        main(["--config", str(cfg)]) == 2
        and "min_size 5 is larger than capacity 4" in capsys.readouterr().err
    )


def test_config_table_defaults_and_flag_overrides(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[learner]\nbatch_size = 4\n")  # no [buffer] table: defaults
    args = build_parser().parse_args(
        ["--config", str(cfg), "--dir", str(tmp_path / "b"), "--metrics-port", "0"]
    )
    got = load_config(args)
    assert got.capacity == 100_000 and got.dir == tmp_path / "b" and got.metrics_port == 0
    cfg.write_text('[buffer]\ncapacity = 7\nbind = "tcp://127.0.0.1:1"\n')
    got = load_config(build_parser().parse_args(["--config", str(cfg), "--bind", "tcp://127.0.0.1:2"]))
    assert got.capacity == 7 and got.bind == "tcp://127.0.0.1:2"


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--config", "--bind", "--sample-bind", "--dir", "--metrics-port"):
        assert flag in out
