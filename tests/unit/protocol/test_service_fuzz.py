"""Structure-aware fuzzing of every control message type and every service socket
(docs/transport-security.md; issue 19 item 5), with hypothesis, derandomized so CI runs the same cases
every time.

Inputs: valid-shaped control messages with hostile values (integer edges up to 2**64-1, NaN/inf,
wrong types, missing/extra fields, a wrong ``type`` tag, strings, arrays and maps at and just over
the unpacker's caps), truncated / byte-flipped / spliced msgpack, container headers that declare huge
sizes (up to 2**32-1) with no body, broken envelopes; Arrow payloads with hostile values or garbled
bytes on the data socket; malformed HTTP requests (odd methods, versions, 70 kB lines, 150
headers, hostile Content-Length, truncation) on the rollout's metrics port.

No vLLM: every message type goes through the buffer's and the publisher's handlers in this process;
each socket is served by the real server classes in a child process (``service_fuzz_server.py``:
the buffer service's loop with its data ingest and RPC sockets, plaintext so every handler is
reachable; a ``WeightsPublisher`` for the learner's "latest" RPC; the rollout's HTTP server class on
a stub service), so the RSS measured is the server's own, not the fuzzer's. After every example the
server answers a valid request on the same connection (a sentinel that also orders the exchange) and
is still alive; after the run its RSS may have grown at most ``RSS_GROWTH_MB`` over its RSS after a
warm-up exchange. Measured (``-s`` prints ``fuzz:`` lines): see docs/transport-security.md."""

from __future__ import annotations

import gc
import json
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_strategies import trajectories
from test_protocol_control import STRATEGIES

from teamrl.learner.buffer_config import BufferConfig
from teamrl.learner.buffer_service import BufferService
from teamrl.protocol import control as C
from teamrl.protocol.codec import encode_trajectories
from teamrl.protocol.config import TransportConfig
from teamrl.protocol.errors import ProtocolError
from teamrl.protocol.examples import example_trajectories
from teamrl.protocol.zmq_transport import MAGIC, RpcClient, WeightsPublisher

RSS_GROWTH_MB = 32.0  # the stated bound: resident memory a whole fuzz run may add to a server
WORKER = Path(__file__).with_name("service_fuzz_server.py")
ROUND_S = 10.0  # an exchange (fuzz inputs + the valid sentinel) must finish within this

_FUZZ = settings(
    derandomize=True,  # CI reproducibility: the same examples on every run
    database=None,
    deadline=None,  # busy shared cores: time is asserted per exchange instead (ROUND_S)
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


def fuzz(max_examples: int) -> settings:
    return settings(_FUZZ, max_examples=max_examples)


def _rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class _Meter:
    """RSS growth and the slowest exchange of one test; reported and checked at the end."""

    def __init__(self, name: str, proc: subprocess.Popen | None = None) -> None:
        self.name = name
        self.proc = proc  # the server's process; None: handlers in this process (RSS not asserted)
        gc.collect()
        self.rss0 = _rss_mb(proc.pid if proc else "self")
        self.t0 = time.monotonic()
        self.slowest = 0.0
        self.examples = 0

    def round(self, seconds: float) -> None:
        self.examples += 1
        self.slowest = max(self.slowest, seconds)
        assert seconds < ROUND_S, f"{self.name}: one exchange took {seconds:.1f} s"
        assert self.proc is None or self.proc.poll() is None, f"{self.name}: the server exited"

    def done(self) -> None:
        gc.collect()
        grew = _rss_mb(self.proc.pid if self.proc else "self") - self.rss0
        line = (
            f"fuzz: {self.name}: {self.examples} examples in {time.monotonic() - self.t0:.1f} s, "
            f"slowest exchange {self.slowest * 1000:.0f} ms, RSS {self.rss0:.0f} MiB, +{grew:.1f} MiB"
        )
        print(line)
        assert self.proc is None or grew < RSS_GROWTH_MB, line


@contextmanager
def _server(kind: str, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, dict]]:
    """A server of ``kind`` in a child process (``service_fuzz_server.py``) and its endpoints."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), kind, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line, f"{kind} server did not start (rc {proc.wait(timeout=30)})"
        yield proc, json.loads(line)
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0  # exited cleanly when told to, not before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------------------------
# hostile control messages

MAX_STR_OVER = "a" * (C.MAX_STR_LEN + 1)
MAX_STR_AT = "b" * C.MAX_STR_LEN
BIG_VALUES = [
    MAX_STR_AT,
    MAX_STR_OVER,
    "\u00e9" * (C.MAX_STR_LEN // 2 + 1),  # under the cap in characters, over it in UTF-8 bytes
    [2**63 - 1] * C.MAX_ARRAY_LEN,
    [0] * (C.MAX_ARRAY_LEN + 1),
    {str(i): i for i in range(C.MAX_MAP_LEN)},
    {str(i): i for i in range(C.MAX_MAP_LEN + 1)},
    [[]] * (C.MAX_CONTAINERS + 1),
    ["x" * 128] * C.MAX_CAPABILITIES,
    ["x" * 128] * (C.MAX_CAPABILITIES + 1),
    b"\x00" * (1 << 20),
]
INT_EDGES = [0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]
TAGS = [cls.model_fields["type"].default for cls in C.MESSAGE_TYPES]

scalars = st.one_of(
    st.sampled_from(INT_EDGES),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),  # NaN and infinities included
    st.booleans(),
    st.none(),
    st.text(max_size=40),
    st.binary(max_size=40),
)
hostile_values = st.one_of(
    scalars,
    st.sampled_from(BIG_VALUES),
    st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=12,
    ),
)
valid_messages = st.one_of(*STRATEGIES.values())


@st.composite
def hostile_shaped(draw: st.DrawFn) -> dict:
    """A valid message's map with 0-3 edits: a field (top-level or nested) set to a hostile value,
    a field dropped, an extra field, or another type tag."""
    d = draw(valid_messages).model_dump(mode="python")
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["set", "set", "nested", "drop", "extra", "retag"]))
        keys = sorted(k for k in d if isinstance(k, str))
        if op == "set" and keys:
            d[draw(st.sampled_from(keys))] = draw(hostile_values)
        elif op == "nested":
            inner = [k for k in keys if isinstance(d[k], dict) and d[k]]
            if inner:
                key = draw(st.sampled_from(inner))
                sub = dict(d[key])
                sub[draw(st.sampled_from(sorted(sub, key=str)))] = draw(hostile_values)
                d[key] = sub
        elif op == "drop" and keys:
            d.pop(draw(st.sampled_from(keys)))
        elif op == "extra":
            d[draw(st.text(max_size=10))] = draw(hostile_values)
        elif op == "retag":
            d["type"] = draw(st.sampled_from([*TAGS, "", "x" * 300]) | st.binary(max_size=8))
    return d


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@st.composite
def garbled(draw: st.DrawFn) -> bytes:
    raw = bytearray(
        C.pack_message(draw(valid_messages)) if draw(st.booleans()) else _pack(draw(hostile_shaped()))
    )
    op = draw(st.sampled_from(["truncate", "flip", "splice"]))
    if op == "truncate":
        return bytes(raw[: draw(st.integers(0, max(0, len(raw) - 1)))])
    if op == "flip":
        for _ in range(draw(st.integers(1, 6))):
            i = draw(st.integers(0, len(raw) - 1))
            raw[i] ^= draw(st.integers(1, 255))
        return bytes(raw)
    i = draw(st.integers(0, len(raw)))
    return bytes(raw[:i] + draw(st.binary(min_size=1, max_size=16)) + raw[i:])


@st.composite
def declared_huge(draw: st.DrawFn) -> bytes:
    """A container or string header claiming up to 2**32-1 elements or bytes, and a short body."""
    head = draw(st.sampled_from([b"\xdd", b"\xdf", b"\xdb", b"\xc6", b"\xc9", b"\xdc", b"\xde", b"\xda"]))
    width = 2 if head in (b"\xdc", b"\xde", b"\xda") else 4
    n = draw(
        st.sampled_from([C.MAX_ARRAY_LEN, C.MAX_ARRAY_LEN + 1, C.MAX_MAP_LEN + 1, C.MAX_STR_LEN + 1, 2**31])
        | st.integers(0, 2**32 - 1)
    ) % (1 << (8 * width))
    prefix = draw(
        st.sampled_from(
            [b"", b"\x81\xa4type", b"\x83\xa4type\xa5hello\xa7service\xa7rollout\xaccapabilities"]
        )
    )
    return prefix + head + n.to_bytes(width, "big") + draw(st.binary(max_size=32))


bodies = st.one_of(
    valid_messages.map(C.pack_message),
    hostile_shaped().map(_pack),
    garbled(),
    declared_huge(),
    st.binary(max_size=64),
)


# --------------------------------------------------------------------------------------------
# servers in this process


@pytest.fixture
def buffer_svc(tmp_path_factory: pytest.TempPathFactory):
    cfg = BufferConfig(
        bind="tcp://127.0.0.1:*",
        sample_bind="tcp://127.0.0.1:*",
        dir=tmp_path_factory.mktemp("fuzz") / "buffer",
        max_policy_lag=None,  # nothing dropped as stale: what is stored is counted below
        checkpoint_interval_s=0.01,
        fsync=False,
        capacity=256,
    )
    svc = BufferService(cfg, TransportConfig())
    yield svc
    svc.close()


def _dealer(endpoint: str):
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return ctx, sock


def test_every_message_type_reaches_the_buffer_handler_safely(buffer_svc: BufferService) -> None:
    """Message level, every type: whatever unpacks is handed to the buffer's and the publisher's
    handlers, which answer with a message (never an exception); everything else is a typed error."""
    meter = _Meter("control messages -> buffer/latest handlers")
    pub = WeightsPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    seen: set[str] = set()
    try:

        @fuzz(1000)
        @given(bodies)
        def one(body: bytes) -> None:
            t0 = time.monotonic()
            try:
                msg = C.unpack_message(body)
            except ProtocolError:
                meter.round(time.monotonic() - t0)
                return
            seen.add(msg.type)
            for handler in (buffer_svc.handle, pub._serve_latest):
                reply = handler(msg)
                assert isinstance(reply, C.MESSAGE_TYPES)
                C.unpack_message(C.pack_message(reply))
            assert buffer_svc.stop_reason is None
            meter.round(time.monotonic() - t0)

        one()
    finally:
        pub.close()
    assert seen == set(TAGS), set(TAGS) - seen  # every control message type got through to a handler
    meter.done()


# --------------------------------------------------------------------------------------------
# RPC sockets: buffer RPC and the learner's "latest"

envelopes = st.sampled_from(["ok"] * 6 + ["no_empty", "short_rid", "extra_part", "two_parts"])


def _rpc_round(sock, pump, fuzz: list[tuple[str, bytes]], base: int, sentinel: C._Message):
    """Send ``fuzz`` then ``sentinel`` on one DEALER; return (replies to well-formed requests in
    order, the sentinel's reply). The server handles one connection in order, so the sentinel's
    reply comes last."""
    expected = []
    for i, (env, body) in enumerate(fuzz):
        rid = struct.pack("<Q", base + i)
        parts = {
            "ok": [b"", rid, body],
            "no_empty": [b"x", rid, body],
            "short_rid": [b"", rid[:3], body],
            "extra_part": [b"", rid, body, b"more"],
            "two_parts": [b"", body],
        }[env]
        sock.send_multipart(parts)
        if env == "ok":
            expected.append(rid)
    srid = struct.pack("<Q", base + len(fuzz))
    sock.send_multipart([b"", srid, C.pack_message(sentinel)])
    got: list[tuple[bytes, C._Message]] = []
    deadline = time.monotonic() + ROUND_S
    while not got or got[-1][0] != srid:
        assert time.monotonic() < deadline, f"no answer to the valid request after {len(got)} replies"
        pump()
        while sock.poll(0):
            parts = sock.recv_multipart()
            assert len(parts) == 3 and parts[0] == b"", parts[:2]
            got.append((parts[1], C.unpack_message(parts[2])))  # the server's replies are valid
    assert [rid for rid, _ in got[:-1]] == expected  # one reply per well-formed request, in order
    return [m for _, m in got[:-1]], got[-1][1]


def test_buffer_rpc_socket(tmp_path: Path) -> None:
    with _server("buffer", tmp_path) as (proc, ends):
        _fuzz_buffer_rpc(proc, ends["rpc"])


def _fuzz_buffer_rpc(proc: subprocess.Popen, endpoint: str) -> None:
    ctx, sock = _dealer(endpoint)
    reasons: set[str] = set()
    counter = iter(range(0, 2**40, 64))
    pump = lambda: sock.poll(20)  # noqa: E731
    try:
        _rpc_round(sock, pump, [], next(counter), C.BufferStatsRequest())  # warm-up
        meter = _Meter("buffer RPC socket", proc)

        @fuzz(250)
        @given(st.lists(st.tuples(envelopes, bodies), min_size=1, max_size=4))
        def one(fuzz: list[tuple[str, bytes]]) -> None:
            t0 = time.monotonic()
            replies, answer = _rpc_round(sock, pump, fuzz, next(counter), C.BufferStatsRequest())
            reasons.update(r.reason if isinstance(r, C.ErrorReply) else r.type for r in replies)
            assert isinstance(answer, C.BufferStats)  # and still running: Drain/Shutdown were refused
            meter.round(time.monotonic() - t0)

        one()
    finally:
        sock.close(0)
        ctx.term()
    # both paths were exercised: typed refusals at every stage and real answers
    assert {
        "decode_error",
        "schema_mismatch",
        "unexpected_request",
        "not_admin",
        "buffer_stats",
    } <= reasons, reasons
    meter.done()


def test_learner_latest_rpc_socket(tmp_path: Path) -> None:
    with _server("latest", tmp_path) as (proc, ends):
        _fuzz_latest(proc, ends["latest"])


def _fuzz_latest(proc: subprocess.Popen, endpoint: str) -> None:
    ctx, sock = _dealer(endpoint)
    counter = iter(range(0, 2**40, 64))
    try:
        _rpc_round(sock, lambda: sock.poll(20), [], next(counter), C.LatestWeightsRequest())  # warm-up
        meter = _Meter("learner latest RPC socket", proc)

        @fuzz(250)
        @given(st.lists(st.tuples(envelopes, bodies), min_size=1, max_size=4))
        def one(fuzz: list[tuple[str, bytes]]) -> None:
            t0 = time.monotonic()
            replies, answer = _rpc_round(
                sock, lambda: sock.poll(20), fuzz, next(counter), C.LatestWeightsRequest()
            )
            assert isinstance(answer, C.WeightsPublished) and answer.version == 7
            for r in replies:  # nothing but the latest weights or a typed refusal
                assert isinstance(r, (C.WeightsPublished, C.ProfilesPublished, C.ErrorReply))
            meter.round(time.monotonic() - t0)

        one()
    finally:
        sock.close(0)
        ctx.term()
    meter.done()


# --------------------------------------------------------------------------------------------
# buffer data ingest

GOOD_PAYLOAD = encode_trajectories(example_trajectories(2, seed=11, tokens=8))
FRESH = b"<fresh>"
VERSIONS = [0, 1, 9_999, 10_000, 10_001, 2**31 - 1]  # the buffer's default policy_version_window: 10,000


@st.composite
def data_frames(draw: st.DrawFn) -> list[bytes]:
    """One data frame: mostly a well-formed envelope (a fresh incarnation, a small seq) around a
    hostile, garbled or truncated payload; else one envelope fault."""
    fault = draw(
        st.sampled_from(
            ["none"] * 12
            + ["magic", "truncated", "one_part", "three_parts", "seq_edge", "incarnation", "reused"]
        )
    )
    seq = draw(st.integers(0, 300))
    if fault == "seq_edge":
        seq = draw(st.sampled_from([65_535, 65_536, 2**62, 2**63 - 1, 2**63, 2**64 - 1]))
    incarnation = FRESH  # a new incarnation per example (replaced when sent)
    if fault == "incarnation":
        incarnation = draw(
            st.sampled_from([b"", b"\xff\xfe", b"i" * 256, b"i" * 257])
            | st.text(min_size=1, max_size=12).map(str.encode)
        )
    elif fault == "reused":
        incarnation = draw(st.sampled_from([b"fuzz-a", b"fuzz-b"]))
    magic = draw(st.sampled_from([b"TRD2", b"\x00\x00\x00\x00"])) if fault == "magic" else MAGIC
    header = struct.pack("<4sQ", magic, seq) + incarnation
    if fault == "truncated":
        header = header[: draw(st.integers(0, len(header) - 1))]
    kind = draw(st.sampled_from(["hostile", "hostile", "garbled", "truncated", "junk", "empty"]))
    if kind == "hostile":  # valid Arrow, hostile values; versions mostly near the window's edge
        batch = draw(st.lists(trajectories(), min_size=1, max_size=3))
        if draw(st.sampled_from([True, True, True, False])):
            for t in batch:
                for step in t.steps:
                    step.policy_version = draw(st.sampled_from(VERSIONS) | st.integers(0, 100))
        payload = encode_trajectories(batch)
    elif kind == "garbled":
        raw = bytearray(GOOD_PAYLOAD)
        for _ in range(draw(st.integers(1, 8))):
            raw[draw(st.integers(0, len(raw) - 1))] ^= draw(st.integers(1, 255))
        payload = bytes(raw)
    elif kind == "truncated":
        payload = GOOD_PAYLOAD[: draw(st.integers(0, len(GOOD_PAYLOAD) - 1))]
    elif kind == "junk":
        payload = draw(st.binary(max_size=256)) + draw(bodies)
    else:
        payload = b""
    if fault == "one_part":
        return [header]
    return [header, payload, b"x"] if fault == "three_parts" else [header, payload]


def test_buffer_data_socket(tmp_path: Path) -> None:
    with _server("buffer", tmp_path) as (proc, ends):
        _fuzz_ingest(proc, ends["data"], ends["rpc"])


def _fuzz_ingest(proc: subprocess.Popen, data: str, rpc: str) -> None:
    ctx, sock = _dealer(data)
    stats = RpcClient(rpc, timeout_ms=10_000)
    counter = iter(range(10**9))

    def exchange(frames: list[list[bytes]]) -> None:
        k = next(counter)
        for parts in frames:
            sock.send_multipart([parts[0].replace(FRESH, b"fuzz-%d" % k), *parts[1:]])
        sentinel = f"sentinel-{k}"
        sock.send_multipart([struct.pack("<4sQ", MAGIC, 0) + sentinel.encode(), GOOD_PAYLOAD])
        deadline = time.monotonic() + ROUND_S
        while True:  # every frame before the sentinel was handled once the sentinel's ack is back
            left = deadline - time.monotonic()
            assert left > 0 and sock.poll(int(left * 1000) + 1), "the valid frame was not acked"
            ack = C.unpack_message(sock.recv())
            assert isinstance(ack, C.Ack)
            if ack.incarnation == sentinel and 0 in ack.seqs:
                return

    try:
        exchange([])  # warm-up
        before = stats.call(C.BufferStatsRequest())
        meter = _Meter("buffer data ingest socket", proc)

        @fuzz(150)
        @given(st.lists(data_frames(), min_size=1, max_size=3))
        def one(frames: list[list[bytes]]) -> None:
            t0 = time.monotonic()
            exchange(frames)
            meter.round(time.monotonic() - t0)

        one()
        after = stats.call(C.BufferStatsRequest())
    finally:
        stats.close()
        sock.close(0)
        ctx.term()
    inserted, rejected = after.inserted - before.inserted, after.rejected - before.rejected
    meter.name += f" ({inserted} trajectories stored, {rejected} refused by the buffer)"
    assert rejected > 0 and inserted > 2 * meter.examples  # hostile frames stored too, not only sentinels
    meter.done()


# --------------------------------------------------------------------------------------------
# rollout metrics HTTP


@st.composite
def http_requests(draw: st.DrawFn) -> bytes:
    if draw(st.sampled_from([False] * 7 + [True])):
        return draw(st.binary(max_size=512))
    method = draw(
        st.sampled_from([b"GET", b"GET", b"HEAD", b"POST", b"PUT", b"G\x00T", b""]) | st.binary(max_size=8)
    )
    path = draw(
        st.sampled_from(
            [b"/metrics", b"/healthz", b"/readyz", b"/", b"*", b"http://x/metrics", b"/%00", b"/\xff\xfe"]
            + [b"/..%2f..%2fetc/passwd", b"/" + b"a" * 70_000]
        )
        | st.binary(max_size=40).map(lambda b: b"/" + b)
    )
    version = draw(
        st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/0.9", b"HTTP/2.0", b"HTTP/1.1.1", b"", b"HTTX/1"])
        | st.just(b"HTTP/" + b"9" * 30 + b".0")
    )
    eol = draw(st.sampled_from([b"\r\n", b"\n", b"\r"]))
    headers = draw(
        st.lists(
            st.tuples(
                st.sampled_from([b"Host", b"Content-Length", b"Transfer-Encoding", b"Expect", b"Connection"])
                | st.binary(max_size=12),
                st.sampled_from([b"-1", b"1" * 40, b"chunked", b"100-continue", b"keep-alive", b"x" * 70_000])
                | st.binary(max_size=24),
            ),
            max_size=6,
        )
    )
    many = draw(st.sampled_from([0, 0, 0, 99, 101, 150]))
    lines = [b" ".join(p for p in (method, path, version) if p)]
    lines += [k + b": " + v for k, v in headers] + [b"X-Fuzz: %d" % i for i in range(many)]
    raw = eol.join(lines) + eol + eol + draw(st.binary(max_size=128))
    if draw(st.sampled_from([False] * 5 + [True])):
        raw = raw[: draw(st.integers(0, len(raw)))]
    return raw


def _exchange(addr: tuple[str, int], data: bytes) -> bytes:
    """Send ``data``, close our side, read the server's answer until it closes the connection."""
    with socket.create_connection(addr, timeout=ROUND_S) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may answer (400/414/431) and close before reading it all
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
    return out


def test_rollout_metrics_http(tmp_path: Path) -> None:
    with _server("http", tmp_path) as (proc, ends):
        _fuzz_http(proc, tuple(ends["http"]))


def _fuzz_http(proc: subprocess.Popen, addr: tuple[str, int]) -> None:
    assert _exchange(addr, b"GET /healthz HTTP/1.1\r\n\r\n").endswith(b"ok\n")  # warm-up
    meter = _Meter("rollout metrics HTTP", proc)

    @fuzz(250)
    @given(http_requests())
    def one(raw: bytes) -> None:
        t0 = time.monotonic()
        _exchange(addr, raw)  # any answer (or none), but the server must close the connection
        ok = _exchange(addr, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert ok.startswith(b"HTTP/1.0 200") and ok.endswith(b"ok\n"), ok[:200]
        meter.round(time.monotonic() - t0)

    one()
    metrics = _exchange(addr, b"GET /metrics HTTP/1.0\r\n\r\n")
    assert metrics.startswith(b"HTTP/1.0 200") and b"teamrl_protocol" in metrics
    meter.done()
