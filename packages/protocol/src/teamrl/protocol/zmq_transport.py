"""ZeroMQ implementation of ``transport.py`` (named so it does not shadow pyzmq).

Socket choices (docs/architecture.md §4): data goes DEALER (sender, connects) -> ROUTER (receiver,
binds), never PUB, because PUB drops at its high-water mark (4,955 of 5,000 messages measured).
Every socket gets bounded high-water marks, ``ZMQ_MAXMSGSIZE`` (an oversized message is discarded
and its peer disconnected by libzmq; the sender is not told, so its frame is simply never acked and
shows up as ``unacked``), ZMTP heartbeats (``HEARTBEAT_IVL/TIMEOUT/TTL``) so a silent peer is
dropped, and ``LINGER`` 0 on close (delivery is guaranteed by acks, not by lingering).

Wire of a data frame: two parts ``[header, payload]``; header = ``b"TRD1"`` + seq (u64 LE) +
incarnation (utf-8, 1..256 bytes). Acks come back as ``control.Ack`` messages. RPC frames are
``[b"", request_id u64 LE, msgpack]`` on DEALER, with the routing id prepended on the ROUTER.

CURVE: a server with ``CurveKeys`` always installs pyzmq's ``ThreadAuthenticator`` on its own
context with a callback allow-list of client public keys, and sets ``ZAP_ENFORCE_DOMAIN`` so it
fails closed if the handler were missing -- measured: CURVE without a ZAP handler admits *any*
client keypair. The ZAP domain is set explicitly (``teamrl``) because
``configure_curve(domain='*')`` only matches an empty domain.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from teamrl.protocol import metrics
from teamrl.protocol.control import (
    Ack,
    ErrorReply,
    LatestProfilesRequest,
    LatestWeightsRequest,
    ProfilesPublished,
    WeightsPublished,
    _Message,
    frames_of,
    pack_message,
    unpack_message,
)
from teamrl.protocol.errors import FrameTooLarge, PeerTimeout, ProtocolError
from teamrl.protocol.transport import ENVELOPE_REASON, CurveKeys, Frame

log = logging.getLogger(__name__)

MAGIC = b"TRD1"
_HEADER = struct.Struct("<4sQ")
ZAP_DOMAIN = b"teamrl"
ZERO_COPY_MIN = 64 * 1024  # below this a copy is cheaper than pinning the Python buffer

DEFAULT_MAX_MSG_SIZE = 256 * 1024 * 1024
DEFAULT_HWM = 64
WAIT_LOG_S = 5.0  # a sender waiting for credit says so (endpoint, for how long) this often


def _common_options(
    sock: zmq.Socket,
    *,
    hwm: int,
    max_msg_size: int,
    heartbeat_ivl_ms: int,
    heartbeat_timeout_ms: int,
) -> None:
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    if heartbeat_ivl_ms > 0:
        sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_timeout_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, heartbeat_timeout_ms)


_REFUSAL_LOG_S = 10.0  # one log line per socket and reason at most this often (the counter counts all)
_last_refusal_log: dict[tuple[str, str], float] = {}


def _refused(socket: str, reason: str) -> None:
    """Count a refused CURVE peer on ``socket`` and log it, rate-limited per (socket, reason)."""
    metrics.count_rejection("auth_denied")
    metrics.AUTH_REFUSED.labels(socket=socket, reason=reason).inc()
    now = time.monotonic()
    if now - _last_refusal_log.get((socket, reason), -_REFUSAL_LOG_S) >= _REFUSAL_LOG_S:
        _last_refusal_log[(socket, reason)] = now
        log.warning("CURVE: refused a peer on %s (%s)", socket, reason)


class _AllowList:
    """ZAP credentials provider: admit exactly the listed z85 client public keys."""

    def __init__(self, keys: Iterable[bytes], socket: str = "server") -> None:
        self.keys = frozenset(keys)
        self.socket = socket
        self.denied = 0

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            self.denied += 1
            _refused(self.socket, "unknown_key")
        return ok


class _ServerGuard:
    """What ``_secure_server`` installs on one server socket: the ZAP authenticator (an unknown
    CURVE key: ``unknown_key``, counted by ``_AllowList``) and a thread reading the socket's monitor
    for failed handshakes, which never reach ZAP: a plaintext (NULL) peer is ``plaintext``, a CURVE
    peer that does not hold the server's public key (or sends garbage) is ``bad_handshake``. Both
    land in ``AUTH_REFUSED{socket=name}``; a peer that keeps reconnecting is counted per attempt.
    ``stop()`` ends both (the owner closes its socket first, then stops the guard)."""

    def __init__(self, auth: ThreadAuthenticator, sock: zmq.Socket, name: str) -> None:
        self.auth = auth
        self.name = name
        self.refused = {"plaintext": 0, "bad_handshake": 0}
        self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"teamrl-handshakes-{name}", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._monitor.poll(100):
                    continue
                evt = recv_monitor_message(self._monitor)
                if evt["event"] == zmq.EVENT_MONITOR_STOPPED:
                    break
                if evt["event"] != zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                    continue
                plain = evt["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
                reason = "plaintext" if plain else "bad_handshake"
                self.refused[reason] += 1
                _refused(self.name, reason)
        except zmq.ZMQError:
            pass  # the context is going away
        finally:
            self._monitor.close(0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.auth.stop()


def _secure_server(
    ctx: zmq.Context, sock: zmq.Socket, curve: CurveKeys | None, name: str = "server"
) -> _ServerGuard | None:
    """Make ``sock`` a CURVE server guarded by an allow-list authenticator (fail closed); refused
    handshakes are counted under ``name`` (``_ServerGuard``). Call before ``bind``."""
    if curve is None:
        return None
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(
        domain=ZAP_DOMAIN.decode(), credentials_provider=_AllowList(curve.allowed_clients, name)
    )
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.zap_domain = ZAP_DOMAIN
    sock.curve_secretkey = curve.secret
    sock.curve_publickey = curve.public
    sock.curve_server = True
    return _ServerGuard(auth, sock, name)


def _secure_client(sock: zmq.Socket, curve: CurveKeys | None) -> None:
    if curve is None:
        return
    if not curve.server_public:
        raise ValueError("CURVE client needs the server's public key (CurveKeys.server_public)")
    sock.curve_secretkey = curve.secret
    sock.curve_publickey = curve.public
    sock.curve_serverkey = curve.server_public


class _SeqTracker:
    """Seqs seen from one incarnation: a low watermark plus the sparse set above it (bounded
    memory when seqs arrive roughly in order)."""

    def __init__(self) -> None:
        self.low = 0
        self.above: set[int] = set()

    def __contains__(self, seq: int) -> bool:
        return seq < self.low or seq in self.above

    def add(self, seq: int) -> None:
        if seq in self:
            return
        self.above.add(seq)
        while self.low in self.above:
            self.above.discard(self.low)
            self.low += 1


# --------------------------------------------------------------------------------------------
# data path


class ZmqDataSender:
    """DEALER producer with a credit window, ack tracking and resend (see ``transport.py``)."""

    def __init__(
        self,
        endpoint: str,
        incarnation: str,
        *,
        window: int = 16,
        ack_timeout_s: float = 5.0,
        hwm: int | None = None,
        max_msg_size: int = DEFAULT_MAX_MSG_SIZE,
        heartbeat_ivl_ms: int = 1000,
        heartbeat_timeout_ms: int = 5000,
        curve: CurveKeys | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        raw = incarnation.encode()
        if not 1 <= len(raw) <= 256:
            raise ValueError(f"incarnation must be 1..256 utf-8 bytes, got {len(raw)}")
        self.incarnation = incarnation
        self.endpoint = endpoint
        self._header_tail = raw
        self.window = window
        self.ack_timeout_s = ack_timeout_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        # The pipe must hold a full window plus one resend round of it.
        _common_options(
            self._sock,
            hwm=hwm or 2 * window + 2,
            max_msg_size=1024 * 1024,  # only acks come back
            heartbeat_ivl_ms=heartbeat_ivl_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        _secure_client(self._sock, curve)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._next_seq = 0
        self._connects = 0
        self.link_up = False
        self._last_ack = time.monotonic()  # or construction: "no ack for N s" in the wait log
        # seq -> (payload, time last put on the wire; 0.0 = never, send it at the next pump)
        self._unacked: OrderedDict[int, tuple[bytes | memoryview, float]] = OrderedDict()
        self.sent = 0
        self.acked = 0
        self.resent = 0
        self.peer_rejected = 0

    @property
    def unacked(self) -> int:
        return len(self._unacked)

    def _put(self, seq: int, payload: bytes | memoryview) -> bool:
        header = _HEADER.pack(MAGIC, seq) + self._header_tail
        try:
            self._sock.send(header, zmq.SNDMORE | zmq.NOBLOCK)
        except zmq.Again:
            return False
        # Once the first part is queued the second cannot hit the HWM (ZeroMQ queues whole messages).
        self._sock.send(payload, copy=len(payload) < ZERO_COPY_MIN)
        self._unacked[seq] = (payload, time.monotonic())
        return True

    def _handle_ack(self, data: bytes) -> None:
        try:
            msg = unpack_message(data)
        except ProtocolError:
            return  # counted by unpack_message
        if not isinstance(msg, Ack) or msg.incarnation != self.incarnation:
            metrics.STALE_REPLIES.inc()
            return
        self._last_ack = time.monotonic()
        for s in msg.seqs:
            if self._unacked.pop(s, None) is not None:
                self.acked += 1
        for s in msg.rejected:
            if self._unacked.pop(s, None) is not None:
                self.peer_rejected += 1
                metrics.PEER_REJECTED_FRAMES.inc()
                log.warning("receiver refused frame %s/%s: %s", self.incarnation, s, msg.reason)

    def _pump(self, timeout_ms: int) -> None:
        """Process acks and connection events for up to ``timeout_ms``; resend what is overdue."""
        events = dict(self._poller.poll(timeout_ms))
        if self._monitor in events:
            while self._monitor.poll(0):
                evt = recv_monitor_message(self._monitor)
                if evt["event"] == zmq.EVENT_DISCONNECTED:
                    self.link_up = False
                if evt["event"] == zmq.EVENT_CONNECTED:
                    self.link_up = True
                    self._connects += 1
                    if self._connects > 1:  # a reconnect: what was in flight may be lost
                        self._mark_all_for_resend()
        if self._sock in events:
            while True:
                try:
                    self._handle_ack(self._sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
        now = time.monotonic()
        for seq, (payload, t) in list(self._unacked.items()):
            if now - t >= self.ack_timeout_s or t == 0.0:
                self.resent += 1
                metrics.RESENT_FRAMES.inc()
                if not self._put(seq, payload):
                    break  # pipe full: try again at the next pump

    def _mark_all_for_resend(self) -> None:
        for seq, (payload, _) in self._unacked.items():
            self._unacked[seq] = (payload, 0.0)

    def send(
        self,
        payload: bytes | memoryview,
        *,
        timeout_s: float | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> int:
        """Queue ``payload`` as the next frame and return its seq.

        While ``window`` frames are un-acked this waits for an ack, logging every ``WAIT_LOG_S``
        which endpoint it waits for and for how long. The wait ends with ``PeerTimeout`` (the frame
        not taken: the caller still owns it) after ``timeout_s`` or as soon as ``stop()`` is true, so
        a producer whose receiver is gone can still stop (docs/running.md, "The services",
        rollout SIGTERM)."""
        if len(self._unacked) >= self.window:
            self._wait_for_credit(timeout_s, stop)
        seq = self._next_seq
        self._next_seq += 1
        if not self._put(seq, payload):
            self._unacked[seq] = (payload, 0.0)
        self.sent += 1
        self._pump(0)
        return seq

    def _wait_for_credit(self, timeout_s: float | None, stop: Callable[[], bool] | None) -> None:
        t0 = time.monotonic()
        deadline = None if timeout_s is None else t0 + timeout_s
        next_log = t0 + WAIT_LOG_S
        while len(self._unacked) >= self.window:
            now = time.monotonic()
            if stop is not None and stop():
                raise PeerTimeout(f"stopped after {now - t0:.1f} s waiting for acks from {self.endpoint}")
            if deadline is not None and now >= deadline:
                raise PeerTimeout(
                    f"window of {self.window} still full after {timeout_s:.1f} s ({self.endpoint})"
                )
            if now >= next_log:
                next_log = now + WAIT_LOG_S
                log.warning(
                    "sender %s: window full (%d un-acked), waiting %.0f s; no ack from %s for %.0f s (link %s)",
                    self.incarnation,
                    len(self._unacked),
                    now - t0,
                    self.endpoint,
                    now - self._last_ack,
                    "up" if self.link_up else ("down" if self._connects else "never up"),
                )
            left_ms = 50 if deadline is None else max(1, min(50, int((deadline - now) * 1000) + 1))
            self._pump(left_ms)

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._unacked:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._pump(int(min(left, 0.05) * 1000) + 1)
        return True

    def close(self) -> int:
        lost = len(self._unacked)
        if lost:
            log.warning("sender %s closing with %d un-acked frames", self.incarnation, lost)
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)
        self._ctx.term()
        return lost


def _zmq_cap(max_frame_bytes: int) -> int:
    """``ZMQ_MAXMSGSIZE`` for a receiver whose own cap is ``max_frame_bytes``: an eighth (at least
    1 MiB) above it, so a frame between the two reaches ``recv`` and is refused *and counted*
    (``frame_too_large``); only one beyond both is dropped by libzmq unseen."""
    return max_frame_bytes + max(1 << 20, max_frame_bytes // 8)


class ZmqDataReceiver:
    """ROUTER consumer: de-duplicates by (incarnation, seq), acks only when the app says so.

    Bounded state (a peer choosing incarnation ids and seqs must not grow it without limit): at
    most ``max_incarnations`` incarnations are tracked; past that, or once one has been silent for
    ``incarnation_ttl_s``, the least recently seen one with no frame awaiting its ack is forgotten
    (``DEDUP_EVICTIONS{reason}``; ``take_evicted()`` tells the app, which forgets it too). A frame
    whose seq is ``max_seq_ahead`` or more above its incarnation's low watermark is refused
    (``seq_out_of_window``): a sender holds at most its credit window un-acked, so per-incarnation
    tracking stays O(window). A frame above ``max_msg_size`` is refused as ``frame_too_large``.
    """

    def __init__(
        self,
        bind_endpoint: str,
        *,
        hwm: int = DEFAULT_HWM,
        max_msg_size: int = DEFAULT_MAX_MSG_SIZE,
        heartbeat_ivl_ms: int = 1000,
        heartbeat_timeout_ms: int = 5000,
        curve: CurveKeys | None = None,
        max_incarnations: int = 4096,
        incarnation_ttl_s: float = 3600.0,
        max_seq_ahead: int = 65_536,
    ) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self.max_frame_bytes = max_msg_size
        self.max_incarnations = max_incarnations
        self.incarnation_ttl_s = incarnation_ttl_s
        self.max_seq_ahead = max_seq_ahead
        _common_options(
            self._sock,
            hwm=hwm,
            max_msg_size=_zmq_cap(max_msg_size),
            heartbeat_ivl_ms=heartbeat_ivl_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an ack to a vanished peer raises, we count it
        self._auth = _secure_server(self._ctx, self._sock, curve, "buffer_data")
        self._sock.bind(bind_endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seen: dict[str, _SeqTracker] = {}  # delivered to the app (acked or not)
        self._pending: dict[str, set[int]] = {}  # delivered, not yet acked
        self._peer: dict[str, bytes] = {}  # latest connection of each incarnation
        self._last: OrderedDict[str, float] = OrderedDict()  # incarnation -> monotonic last frame, LRU order
        self._evicted: list[str] = []
        self.received = 0
        self.duplicates = 0
        self.rejected = 0
        self.evictions = 0

    def restore(self, incarnation: str, seqs: Iterable[int]) -> None:
        """Declare seqs already durable (from the app's checkpoint) so resends are de-duplicated."""
        tracker = self._seen.setdefault(incarnation, _SeqTracker())
        for s in seqs:
            tracker.add(int(s))
        self._last[incarnation] = time.monotonic()
        self._last.move_to_end(incarnation)

    def take_evicted(self) -> list[str]:
        """Incarnations forgotten since the last call (the app drops its own state for them)."""
        out, self._evicted = self._evicted, []
        return out

    def _forget(self, incarnation: str, reason: str) -> None:
        for table in (self._seen, self._pending, self._peer, self._last):
            table.pop(incarnation, None)  # type: ignore[attr-defined]
        self._evicted.append(incarnation)
        self.evictions += 1
        metrics.DEDUP_EVICTIONS.labels(reason=reason).inc()

    def _make_room(self, now: float) -> bool:
        """Evict silent and surplus incarnations (never one with frames awaiting acks); False when
        a new incarnation still cannot be tracked."""
        for inc, last in list(self._last.items()):
            if now - last < self.incarnation_ttl_s:
                break
            if not self._pending.get(inc):
                self._forget(inc, "age")
        if len(self._last) < self.max_incarnations:
            return True
        for inc in list(self._last):
            if not self._pending.get(inc):
                self._forget(inc, "count")
                return True
        return False

    def _admit(self, frame: Frame) -> bool:
        """Bounds checked before ``frame`` is delivered (each refusal counted by reason)."""
        inc, now = frame.incarnation, time.monotonic()
        tracker = self._seen.get(inc)
        if tracker is None:
            if inc not in self._last and not self._make_room(now):
                metrics.count_rejection("too_many_incarnations")  # not acked: the sender resends later
                return False
            # A sender resends in seq order from its oldest un-acked frame, so the first seq seen of
            # an incarnation is its low watermark (earlier ones, if any, were acked by a lost state).
            tracker = self._seen[inc] = _SeqTracker()
            tracker.low = frame.seq
        elif frame.seq >= tracker.low + self.max_seq_ahead:
            metrics.count_rejection("seq_out_of_window")
            self._refuse(frame, "seq_out_of_window")
            return False
        self._last[inc] = now
        self._last.move_to_end(inc)
        if frame.payload.nbytes > self.max_frame_bytes:
            metrics.count_rejection("frame_too_large")
            log.warning(
                "frame %s/%d refused: %d bytes, cap %d",
                inc,
                frame.seq,
                frame.payload.nbytes,
                self.max_frame_bytes,
            )
            tracker.add(frame.seq)  # refused for good: a resend is a duplicate, and low moves on
            self._refuse(frame, "frame_too_large")
            return False
        return True

    def _refuse(self, frame: Frame, reason: str) -> None:
        self.rejected += 1
        self._peer[frame.incarnation] = frame.peer
        self._send_ack(frame.incarnation, [], [frame.seq], reason)

    def _parse(self, parts: list[zmq.Frame]) -> Frame | None:
        if len(parts) != 3:
            metrics.count_rejection(ENVELOPE_REASON)
            return None
        peer, header, payload = parts[0].bytes, parts[1].bytes, parts[2]
        if len(header) < _HEADER.size + 1 or len(header) > _HEADER.size + 256:
            metrics.count_rejection(ENVELOPE_REASON)
            return None
        magic, seq = _HEADER.unpack_from(header)
        try:
            incarnation = header[_HEADER.size :].decode()
        except UnicodeDecodeError:
            incarnation = ""
        if magic != MAGIC or not incarnation or seq >= 2**63:
            metrics.count_rejection(ENVELOPE_REASON)
            return None
        return Frame(peer=peer, incarnation=incarnation, seq=seq, payload=payload.buffer)

    def recv(self, timeout_ms: int) -> Frame | None:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            left = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(left):
                return None
            frame = self._parse(self._sock.recv_multipart(copy=False))
            if frame is None or not self._admit(frame):
                continue
            self._peer[frame.incarnation] = frame.peer
            seen = self._seen.setdefault(frame.incarnation, _SeqTracker())
            pending = self._pending.setdefault(frame.incarnation, set())
            if frame.seq in seen:
                self.duplicates += 1
                metrics.DUPLICATE_FRAMES.inc()
                if frame.seq not in pending:  # already durable: the sender lost our ack
                    self._send_ack(frame.incarnation, [frame.seq], [], "")
                continue
            seen.add(frame.seq)
            pending.add(frame.seq)
            self.received += 1
            return frame

    def _send_ack(self, incarnation: str, seqs: list[int], rejected: list[int], reason: str) -> None:
        msg = Ack(incarnation=incarnation, seqs=seqs, rejected=rejected, reason=reason)
        try:
            self._sock.send_multipart([self._peer[incarnation], pack_message(msg)], zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            # Peer gone or its pipe full: it will resend and we will re-ack the duplicate.
            metrics.STALE_REPLIES.inc()

    def ack(self, *frames: Frame) -> None:
        """The app persisted these frames: tell their senders (one Ack per incarnation)."""
        by_inc: dict[str, list[int]] = {}
        for f in frames:
            self._pending.get(f.incarnation, set()).discard(f.seq)
            by_inc.setdefault(f.incarnation, []).append(f.seq)
        for inc, seqs in by_inc.items():
            self._send_ack(inc, seqs, [], "")

    def reject(self, frame: Frame, reason: str) -> None:
        """The app refused this frame for good (invalid content): the sender must not resend it."""
        self._pending.get(frame.incarnation, set()).discard(frame.seq)
        self.rejected += 1
        self._send_ack(frame.incarnation, [], [frame.seq], reason)

    def close(self) -> None:
        self._sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


# --------------------------------------------------------------------------------------------
# request / reply


class RpcServer:
    """ROUTER that answers control messages with ``handler(msg) -> reply``.

    Call sequence: ``server = RpcServer(bind, handler)``; then ``server.serve_once(timeout_ms)`` in
    the owner's loop (or ``serve_forever(stop_event)`` in a thread); ``server.close()``. Unreadable
    requests and handler exceptions are answered with an ``ErrorReply`` and counted; the server
    keeps serving. A request above ``max_msg_size`` is answered ``frame_too_large`` (libzmq's own
    cap sits above it, see ``_zmq_cap``). While the handler runs, ``peer_key`` holds the z85 CURVE
    public key the request came with (``""`` without CURVE), for authorisation by the handler.
    """

    def __init__(
        self,
        bind_endpoint: str,
        handler: Callable[[_Message], _Message],
        *,
        hwm: int = DEFAULT_HWM,
        max_msg_size: int = 16 * 1024 * 1024,
        heartbeat_ivl_ms: int = 1000,
        heartbeat_timeout_ms: int = 5000,
        curve: CurveKeys | None = None,
        name: str = "rpc",
    ) -> None:
        self._handler = handler
        self.max_request_bytes = max_msg_size
        self.peer_key = ""
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        _common_options(
            self._sock,
            hwm=hwm,
            max_msg_size=_zmq_cap(max_msg_size),
            heartbeat_ivl_ms=heartbeat_ivl_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        self._auth = _secure_server(self._ctx, self._sock, curve, name)
        self._sock.bind(bind_endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.served = 0
        self.errors = 0

    def serve_once(self, timeout_ms: int) -> bool:
        """Answer at most one request; False when none arrived within ``timeout_ms``."""
        if not self._sock.poll(timeout_ms):
            return False
        frames = self._sock.recv_multipart(copy=False)
        parts = [f.bytes for f in frames]
        if len(parts) != 4 or parts[1] != b"" or len(parts[2]) != 8:
            metrics.count_rejection(ENVELOPE_REASON)
            return True  # no reply: without a well-formed envelope we cannot address one
        peer, _, rid, body = parts
        request_id = struct.unpack("<Q", rid)[0]
        try:
            self.peer_key = frames[3].get("User-Id") if self._auth is not None else ""
        except zmq.ZMQError:
            self.peer_key = ""
        try:
            if len(body) > self.max_request_bytes:
                metrics.count_rejection("frame_too_large")
                raise FrameTooLarge(f"request is {len(body)} bytes, cap is {self.max_request_bytes}")
            reply = self._handler(unpack_message(body, ()))
        except ProtocolError as e:
            self.errors += 1
            reply = ErrorReply(request_id=request_id % 2**63, reason=e.reason, message=str(e)[:1000])
        except Exception as e:  # the fault boundary of a serving loop: count, answer, keep serving
            self.errors += 1
            metrics.count_rejection("handler_error")
            log.exception("rpc handler failed")
            reply = ErrorReply(request_id=request_id % 2**63, reason="handler_error", message=repr(e)[:1000])
        self.served += 1
        try:
            self._sock.send_multipart([peer, b"", rid, *frames_of(reply)], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            metrics.STALE_REPLIES.inc()
        return True

    def serve_forever(self, stop: threading.Event, poll_ms: int = 100) -> None:
        while not stop.is_set():
            self.serve_once(poll_ms)

    def close(self) -> None:
        self._sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


class RpcClient:
    """DEALER for request/reply with a timeout; replies matched by request id (late ones counted)."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_ms: int = 5000,
        max_msg_size: int = DEFAULT_MAX_MSG_SIZE,
        heartbeat_ivl_ms: int = 1000,
        heartbeat_timeout_ms: int = 5000,
        curve: CurveKeys | None = None,
    ) -> None:
        self.timeout_ms = timeout_ms
        self.endpoint = endpoint
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        _common_options(
            self._sock,
            hwm=DEFAULT_HWM,
            max_msg_size=max_msg_size,
            heartbeat_ivl_ms=heartbeat_ivl_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        _secure_client(self._sock, curve)
        self._sock.connect(endpoint)
        self._next_id = 0

    def call(self, msg: _Message, timeout_ms: int | None = None) -> _Message:
        """Send ``msg`` and return the reply (an ``ErrorReply`` if the server refused it).

        A reply's attached frames (a ``SampleReply``'s Arrow stream) are handed over as views into
        the received ZeroMQ message, not copied; a reply whose frames disagree with its header
        raises ``DecodeError`` (counted).

        Raises ``PeerTimeout`` when no reply arrives in time; the request may still be served.
        """
        rid = struct.pack("<Q", self._next_id)
        self._next_id += 1
        deadline = time.monotonic() + (timeout_ms if timeout_ms is not None else self.timeout_ms) / 1000
        try:
            self._sock.send_multipart([b"", rid, pack_message(msg)], zmq.NOBLOCK)
        except zmq.Again as e:
            raise PeerTimeout(f"cannot queue {msg.type!r} request: send queue full") from e
        while True:
            left = int((deadline - time.monotonic()) * 1000)
            if left <= 0 or not self._sock.poll(left):
                raise PeerTimeout(f"no reply to {msg.type!r} within {timeout_ms or self.timeout_ms} ms")
            frames = self._sock.recv_multipart(copy=False)
            if len(frames) < 3 or frames[0].bytes != b"" or frames[1].bytes != rid:
                metrics.STALE_REPLIES.inc()
                continue
            # attached frames (a SampleReply's Arrow stream) stay in ZeroMQ's memory: no copy
            return unpack_message(frames[2].bytes, [f.buffer for f in frames[3:]])

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()


# --------------------------------------------------------------------------------------------
# weights announcements


class WeightsPublisher:
    """Learner side: PUB announcements plus a ROUTER "latest" endpoint served from a thread.

    ``publish(msg)`` stamps ``announce_seq`` (0, 1, 2, ...) and remembers the message as the
    latest; PUB may drop (slow joiner, HWM), which is why subscribers check the sequence and ask
    the latest endpoint when they see a gap. Nothing but announcements goes over PUB.
    """

    TOPIC = b"weights"
    PROFILES_TOPIC = b"profiles"  # LangMARL profile versions share the socket; their version is the sequence

    def __init__(
        self, pub_endpoint: str, latest_endpoint: str, *, curve: CurveKeys | None = None, hwm: int = 16
    ) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        _common_options(
            self._pub, hwm=hwm, max_msg_size=1024, heartbeat_ivl_ms=1000, heartbeat_timeout_ms=5000
        )
        self._auth = _secure_server(self._ctx, self._pub, curve, "learner_weights")
        self._pub.bind(pub_endpoint)
        self.pub_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._lock = threading.Lock()
        self._latest: WeightsPublished | None = None
        self._latest_profiles: ProfilesPublished | None = None
        self._seq = 0
        self._rpc = RpcServer(latest_endpoint, self._serve_latest, curve=curve, name="learner_latest")
        self.latest_endpoint = self._rpc.endpoint
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._rpc.serve_forever, args=(self._stop, 50), daemon=True)
        self._thread.start()

    def _serve_latest(self, msg: _Message) -> _Message:
        if isinstance(msg, LatestProfilesRequest):
            with self._lock:
                profiles = self._latest_profiles
            return profiles if profiles is not None else ErrorReply(reason="no_profiles_yet")
        if not isinstance(msg, LatestWeightsRequest):
            return ErrorReply(reason="unexpected_request", message=f"latest endpoint got {msg.type!r}")
        with self._lock:
            latest = self._latest
        return latest if latest is not None else ErrorReply(reason="no_weights_yet")

    def publish_profiles(self, msg: ProfilesPublished) -> ProfilesPublished:
        """Announce a profile version (versions go up by one: a subscriber sees a gap and asks)."""
        with self._lock:
            if self._latest_profiles is not None and msg.version <= self._latest_profiles.version:
                raise ValueError(
                    f"profile version {msg.version} after {self._latest_profiles.version}: versions only go up"
                )
            self._latest_profiles = msg
        try:
            self._pub.send_multipart([self.PROFILES_TOPIC, pack_message(msg)], zmq.NOBLOCK)
        except zmq.Again:
            metrics.count_rejection("announce_dropped")
        return msg

    def publish(self, msg: WeightsPublished) -> WeightsPublished:
        with self._lock:
            stamped = msg.model_copy(update={"announce_seq": self._seq})
            self._seq += 1
            self._latest = stamped
        try:
            self._pub.send_multipart([self.TOPIC, pack_message(stamped)], zmq.NOBLOCK)
        except zmq.Again:
            metrics.count_rejection("announce_dropped")  # subscribers heal via the latest endpoint
        return stamped

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._rpc.close()
        self._pub.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


class WeightsSubscriber:
    """Rollout side: SUB to announcements; on a gap (or first use) fetch the latest explicitly.

    ``poll(timeout_ms)`` returns a ``WeightsPublished`` newer than the last one returned, or None.
    Versions returned never go backwards.
    """

    def __init__(
        self,
        pub_endpoint: str,
        latest_endpoint: str,
        *,
        curve: CurveKeys | None = None,
        timeout_ms: int = 2000,
    ) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        _common_options(
            self._sub, hwm=16, max_msg_size=64 * 1024 * 1024, heartbeat_ivl_ms=1000, heartbeat_timeout_ms=5000
        )
        _secure_client(self._sub, curve)
        self._sub.setsockopt(zmq.SUBSCRIBE, WeightsPublisher.TOPIC)
        self._sub.setsockopt(zmq.SUBSCRIBE, WeightsPublisher.PROFILES_TOPIC)
        self._sub.connect(pub_endpoint)
        self._rpc = RpcClient(latest_endpoint, timeout_ms=timeout_ms, curve=curve)
        self.publisher_restarts = 0  # a newer version under an older sequence: a new publisher process
        self._last_seq: int | None = None
        self._last_version = -1
        self.gaps = 0
        self._profiles: ProfilesPublished | None = None  # newest received, not yet taken
        self._profile_version = -1  # newest received or taken

    def latest_profiles(self, timeout_ms: int | None = None) -> ProfilesPublished | None:
        """The publisher's newest profile version (None: none yet); raises PeerTimeout."""
        reply = self._rpc.call(LatestProfilesRequest(have_version=self._profile_version), timeout_ms)
        return reply if isinstance(reply, ProfilesPublished) else None

    def take_profiles(self) -> ProfilesPublished | None:
        """The newest profile announcement received by ``poll`` since the last call, or None."""
        msg, self._profiles = self._profiles, None
        return msg

    def _got_profiles(self, msg: ProfilesPublished) -> None:
        if msg.version <= self._profile_version:
            return
        if self._profile_version >= 0 and msg.version != self._profile_version + 1:
            self.gaps += 1
            metrics.WEIGHT_ANNOUNCE_GAPS.inc()
            try:
                newest = self.latest_profiles()
            except PeerTimeout:
                newest = None
            if newest is not None and newest.version > msg.version:
                msg = newest
        self._profile_version = msg.version
        self._profiles = msg

    def latest(self, timeout_ms: int | None = None) -> WeightsPublished | None:
        reply = self._rpc.call(LatestWeightsRequest(have_version=self._last_version), timeout_ms)
        return reply if isinstance(reply, WeightsPublished) else None

    def accept(self, msg: WeightsPublished) -> WeightsPublished | None:
        """Record ``msg`` as the newest announcement seen and return it; None when it is older than
        one already seen (a stale or replayed announcement). ``poll`` calls it for each announcement;
        a caller that asked ``latest`` itself calls it so the next ``poll`` counts gaps from there.
        A restarted publisher counts its sequence from 0 again: a newer version under a sequence
        already seen is its announcement (one publisher's versions only go up with its sequence),
        taken and counted in ``publisher_restarts``, and gaps are counted from its sequence on."""
        if self._last_seq is not None and msg.announce_seq <= self._last_seq:
            if msg.version <= self._last_version:
                return None
            self.publisher_restarts += 1
        self._last_seq = msg.announce_seq
        if msg.version < self._last_version:
            return None
        self._last_version = msg.version
        return msg

    def poll(self, timeout_ms: int) -> WeightsPublished | None:
        if not self._sub.poll(timeout_ms):
            return None
        parts = self._sub.recv_multipart()
        if len(parts) != 2:
            metrics.count_rejection(ENVELOPE_REASON)
            return None
        try:
            msg = unpack_message(parts[1])
        except ProtocolError:
            return None  # counted
        if parts[0] == WeightsPublisher.PROFILES_TOPIC and isinstance(msg, ProfilesPublished):
            self._got_profiles(msg)  # kept for take_profiles(); poll returns weights only
            return None
        if not isinstance(msg, WeightsPublished):
            metrics.count_rejection(ENVELOPE_REASON)
            return None
        expected = 0 if self._last_seq is None else self._last_seq + 1
        if msg.announce_seq != expected:
            self.gaps += 1
            metrics.WEIGHT_ANNOUNCE_GAPS.inc()
            try:
                newest = self.latest()
            except PeerTimeout:  # a busy (just restarted) publisher: this one now, the latest later
                newest = None
            if newest is not None and newest.announce_seq >= msg.announce_seq:
                msg = newest
        return self.accept(msg)

    def close(self) -> None:
        self._rpc.close()
        self._sub.close(0)
        self._ctx.term()


def latest_endpoint_for(pub_endpoint: str) -> str:
    """The "latest weights" RPC endpoint paired with a weights PUB endpoint: the next port.

    ``tcp://host:5557`` -> ``tcp://host:5558``. One flag (``--publish`` / ``--weights``) then names
    both sockets, in the manifests as on the command line.
    """
    head, sep, port = pub_endpoint.rpartition(":")
    if not sep or not port.isdigit() or not head.startswith(("tcp://", "tcp://[")):
        raise ValueError(f"weights endpoint {pub_endpoint!r}: expected tcp://HOST:PORT")
    if int(port) >= 65535:
        raise ValueError(f"weights endpoint {pub_endpoint!r}: no port after {port} for the latest endpoint")
    return f"{head}:{int(port) + 1}"


def make_data_sender(endpoint: str, incarnation: str, **kwargs: object) -> ZmqDataSender:
    """The ZeroMQ data sender (the only implementation today). kwargs: see ``ZmqDataSender``."""
    return ZmqDataSender(endpoint, incarnation, **kwargs)  # type: ignore[arg-type]


def make_data_receiver(bind_endpoint: str, **kwargs: object) -> ZmqDataReceiver:
    """The ZeroMQ data receiver. kwargs: see ``ZmqDataReceiver``."""
    return ZmqDataReceiver(bind_endpoint, **kwargs)  # type: ignore[arg-type]
