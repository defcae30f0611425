"""Control messages: small typed msgpack maps, one pydantic class per message.

Design: every message is a frozen, strict, ``extra="forbid"`` pydantic model with a literal
``type`` tag; ``pack_message`` writes ``model_dump()`` as a msgpack map (``use_bin_type`` so bytes
stay bytes), ``unpack_message`` reverses it. Foreign bytes are unpacked with explicit size limits,
``raw=False`` and ``strict_map_key=True``, and the result is then validated against the tagged
union (strict: no coercion of "1" into 1). About 4% of byte-mutated messages still unpack as
msgpack (docs/reliability.md R-fuzz), which is why the schema check after unpacking is not optional. Every
failure raises ``DecodeError`` (not msgpack), ``SchemaMismatch`` (msgpack, wrong shape) or
``FrameTooLarge`` and is counted in ``teamrl_protocol_rejected_frames_total{reason}``.

Each class's comment says who sends it to whom. Bulk data does not travel inside msgpack, with one
exception (``InlineWeights`` carries small adapter chunks, so the byte caps below are sized for
those). A message whose reply *is* bulk carries it as ZeroMQ frames *after* its msgpack header:
``SampleReply`` declares ``nbytes`` and its Arrow IPC stream follows as one frame, which the
receiver validates once, straight from the frame's memory (docs/architecture.md, the data path).
``frames_of(msg)`` gives what goes on the wire; ``unpack_message(header, attachments)`` checks that
exactly the declared frames came with the header before it hands the message out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError, model_validator

from teamrl.protocol.errors import DecodeError, FrameTooLarge, ProtocolError, SchemaMismatch
from teamrl.protocol.metrics import count_rejection
from teamrl.protocol.schema import SCHEMA_VERSION

PROTOCOL_VERSION = 1

# Unpacking limits, sized to the schema below so that no message can cost more than a few MB of
# Python objects whatever its bytes say (an empty msgpack array is 1 byte on the wire and ~56 bytes
# as a list: 16 MB of nested empty arrays used to build 1.2 GB). Per container: the longest list
# is ``SampleReply.weights`` (<= 65,536 = max batch_size); the largest map is a few agent ids;
# the longest string a profile (65,536 characters, <= 4 bytes each). Per message: no schema nests
# more than a handful of containers, so ``MAX_CONTAINERS`` caps them all and ``MAX_ITEMS`` caps
# the elements of all of them together (measured worst case: see docs/transport-security.md).
MAX_CONTROL_BYTES = 256 * 1024 * 1024  # a SampleReply of a large batch, or inline adapter chunks
MAX_STR_LEN = 256 * 1024
MAX_ARRAY_LEN = 65_536
MAX_MAP_LEN = 4096
MAX_CONTAINERS = 256
MAX_ITEMS = 4 * 65_536
MAX_CAPABILITIES = 64
MAX_STATS_MODELS = 256  # BufferStats.current_versions entries, at most

Id = Annotated[str, Field(min_length=1, max_length=256)]
NonNeg = Annotated[int, Field(ge=0, le=2**63 - 1)]
Seq = Annotated[int, Field(ge=0, le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    def attachment_sizes(self) -> tuple[int, ...]:
        """Sizes of the frames that must follow this message's header on the wire (none by default)."""
        return ()

    def attachments(self) -> tuple[Any, ...]:
        """The buffers (bytes, memoryview, ``pa.Buffer``) sent after the header, one frame each."""
        return ()

    def _attach(self, frames: Sequence[Any]) -> None:
        """Keep the received frames (already checked against ``attachment_sizes``)."""


class Hello(_Message):
    """Any service -> the peer it just connected to (rollout -> buffer, learner -> buffer): who I am."""

    type: Literal["hello"] = "hello"
    service: Literal["rollout", "buffer", "learner", "orchestrator"]
    incarnation: Id  # new per process start; (incarnation, seq) de-duplicates data frames
    capabilities: Annotated[
        list[Annotated[str, Field(max_length=128)]], Field(max_length=MAX_CAPABILITIES)
    ] = []
    # e.g. "arrow-v1", "curve"
    protocol_version: int = PROTOCOL_VERSION
    schema_version: int = SCHEMA_VERSION


class Heartbeat(_Message):
    """Any service -> its peers, every heartbeat interval (application level, on top of ZMTP's)."""

    type: Literal["heartbeat"] = "heartbeat"
    incarnation: Id
    seq: Seq  # increases by one per heartbeat, so a peer can see missed beats
    time: float  # sender's unix time
    load: float = 0.0  # sender-defined utilisation in [0, 1], for autoscaling dashboards


class Ack(_Message):
    """Data receiver (replay buffer) -> data sender (rollout): these frames are durable / refused.

    ``seqs`` are only sent after the receiving application persisted the frames; ``rejected`` are
    frames it refused for good (invalid content), so the sender stops resending them.
    """

    type: Literal["ack"] = "ack"
    incarnation: Id  # the sender incarnation the seqs belong to
    seqs: list[Seq] = []
    rejected: list[Seq] = []
    reason: str = ""  # why ``rejected`` were refused (an error's ``reason`` label)


class Probe(_Message):
    """A fixed prompt/completion and the log-probs the new adapter must reproduce (verification)."""

    prompt_ids: list[TokenId] = Field(min_length=1)
    completion_ids: list[TokenId] = Field(min_length=1)
    expected_logprobs: list[float]  # [len(completion_ids)]: log p(completion_ids[i] | prompt, <i)
    atol: float = Field(0.05, gt=0)

    @model_validator(mode="after")
    def _lengths_agree(self) -> Probe:
        if len(self.expected_logprobs) != len(self.completion_ids):
            raise ValueError(
                f"{len(self.expected_logprobs)} expected log-probs for {len(self.completion_ids)} completion ids"
            )
        return self


class InlineWeights(_Message):
    """Adapter bytes carried in the announcement itself (small LoRA adapters, tests)."""

    kind: Literal["inline"] = "inline"
    chunks: list[bytes]


class UriWeights(_Message):
    """Adapter folder on shared storage (the normal case)."""

    kind: Literal["uri"] = "uri"
    uri: Annotated[str, Field(min_length=1, max_length=4096)]


class WeightsPublished(_Message):
    """Learner -> rollouts (PUB, and the publisher's "latest" endpoint): new adapters are ready."""

    type: Literal["weights_published"] = "weights_published"
    announce_seq: Seq  # publisher's announcement counter; a subscriber seeing a gap asks for the latest
    version: NonNeg  # policy version; never goes backwards
    adapters: dict[Id, Id]  # {agent_id: adapter_name}
    location: Annotated[InlineWeights | UriWeights, Field(discriminator="kind")]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]  # of the adapter payload, checked before use
    probe: Probe  # computed with probe_adapter(adapters)
    base_model: str = ""
    # adapter name -> its own probe: each adapter named here is verified too before the version is used
    probes: dict[Id, Probe] = Field(default_factory=dict)
    final: bool = False  # the learner's last version of the run: rollouts evaluate it whatever the interval


class LatestWeightsRequest(_Message):
    """Rollout -> the learner publisher's "latest" endpoint, after a gap or on start-up."""

    type: Literal["latest_weights_request"] = "latest_weights_request"
    have_version: int = -1  # -1: none yet


MAX_PROFILE_CHARS = 65_536  # one agent profile (system prompt), in characters
ProfileText = Annotated[str, Field(max_length=MAX_PROFILE_CHARS)]


class ProfilesPublished(_Message):
    """Profile learner -> rollouts (PUB, and the publisher's "latest" endpoint): new agent profiles.

    LangMARL's policy improvement in language space: a profile is an agent's system prompt.
    ``profiles`` is the whole map of this version (not a diff), so a rollout that missed versions
    needs only the latest. ``sha256`` is of the canonical JSON ``{"profiles": ..., "version": ...}``
    (sorted keys, no spaces, UTF-8), checked before use by ``teamrl.rewards.profiles.apply_profiles``.
    """

    type: Literal["profiles_published"] = "profiles_published"
    version: NonNeg  # profile version; never goes backwards, one more than its parent
    profiles: dict[Id, ProfileText]  # {agent_id: system prompt}
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class LatestProfilesRequest(_Message):
    """Rollout -> the profile publisher's "latest" endpoint, after a version gap or on start-up."""

    type: Literal["latest_profiles_request"] = "latest_profiles_request"
    have_version: int = -1  # -1: none yet


class Drain(_Message):
    """Orchestrator -> any service: finish in-flight work, take no new work, flush, then exit."""

    type: Literal["drain"] = "drain"
    reason: str = ""
    deadline_s: float = Field(30.0, ge=0)


class Shutdown(_Message):
    """Orchestrator -> any service: exit now (after Drain's deadline passed, or on a fatal error)."""

    type: Literal["shutdown"] = "shutdown"
    reason: str = ""


class BufferStatsRequest(_Message):
    """Learner or orchestrator -> replay buffer (RPC): send your BufferStats."""

    type: Literal["buffer_stats_request"] = "buffer_stats_request"


class BufferStats(_Message):
    """Replay buffer -> learner / orchestrator (RPC reply): occupancy and counters."""

    type: Literal["buffer_stats"] = "buffer_stats"
    size: NonNeg  # trajectories held now
    per_agent: dict[Id, NonNeg] = {}  # steps held per agent id
    inserted: NonNeg = 0
    sampled: NonNeg = 0
    rejected: NonNeg = 0  # refused at admission (stale, invalid)
    evicted: NonNeg = 0
    min_policy_version: int = -1  # -1: empty
    max_policy_version: int = -1
    # base model id -> its current adapter version (each base's versions advance on their own)
    current_versions: Annotated[dict[Id, int], Field(max_length=MAX_STATS_MODELS)] = {}


MAX_SAMPLE_AGENTS = 256  # agent ids one SampleRequest may name (one learner group's agents)


class SampleRequest(_Message):
    """Learner rank -> replay buffer (RPC): give me a batch (of some agents' steps, or of any).

    A learner group that trains the agents of one base model names them in ``agent_ids`` (its
    *view*: the episodes of each group in which any of them acted; docs/architecture.md, "The
    replay buffer") and that base in ``model_id``, whose version sequence ``min_policy_version`` counts in
    and whose staleness applies. ``agent_id`` is the older one-agent form (= ``agent_ids=[agent_id]``);
    setting both is an error.
    """

    type: Literal["sample_request"] = "sample_request"
    request_id: Seq
    agent_id: Id | None = None  # None: whole trajectories for every agent (unless agent_ids)
    agent_ids: Annotated[list[Id], Field(max_length=MAX_SAMPLE_AGENTS)] | None = None  # None: whole
    model_id: Id | None = None  # the base model min_policy_version refers to; None: the highest version
    batch_size: Annotated[int, Field(ge=1, le=65_536)]
    rank: NonNeg  # data-parallel rank, so the buffer can shard without duplicates
    min_policy_version: int = -1  # refuse older samples (staleness bound); -1: any

    @model_validator(mode="after")
    def _one_agent_form(self) -> SampleRequest:
        if self.agent_id is not None and self.agent_ids is not None:
            raise ValueError("set agent_id or agent_ids, not both")
        return self


class VersionAnnounce(_Message):
    """Learner (the rank that publishes) -> replay buffer (RPC), before each ``WeightsPublished`` and
    once at start: base ``model_id`` (None: every base; a one-base team's learner) is published at
    ``version``, trained for ``agent_ids``. The only source of the buffer's versions: frames and sample
    hints above an announced version are refused (docs/security.md). Replied with ``BufferStats``."""

    type: Literal["version_announce"] = "version_announce"
    model_id: Id | None = None
    version: NonNeg
    agent_ids: Annotated[list[Id], Field(max_length=MAX_SAMPLE_AGENTS)] = []


class SampleReply(_Message):
    """Replay buffer -> learner rank (RPC reply): the sampled trajectories, an Arrow IPC stream.

    The stream is not in the msgpack header: it follows it as one ZeroMQ frame of ``nbytes`` bytes
    (``carrying(data)`` on the sender, ``trajectories`` on the receiver: a read-only view of the
    received frame, no copy). ``decode_batches`` validates it on arrival, once.
    """

    type: Literal["sample_reply"] = "sample_reply"
    request_id: Seq
    nbytes: NonNeg  # size of the Arrow frame after the header
    count: NonNeg
    weights: list[float] = []  # per-trajectory importance/priority weights, [count] or empty
    _data: Any = PrivateAttr(default=None)

    @classmethod
    def carrying(cls, data: Any, **fields: Any) -> SampleReply:
        """A reply whose Arrow frame is ``data`` (bytes, memoryview or ``pa.Buffer``)."""
        reply = cls(nbytes=memoryview(data).nbytes, **fields)
        reply._data = data
        return reply

    @property
    def trajectories(self) -> Any:
        """The Arrow IPC stream (the received frame's memory); raises if the frame never came."""
        if self._data is None:
            raise DecodeError("sample reply without its Arrow frame (only its header was unpacked)")
        return self._data

    def attachment_sizes(self) -> tuple[int, ...]:
        return (self.nbytes,)

    def attachments(self) -> tuple[Any, ...]:
        return (self.trajectories,)

    def _attach(self, frames: Sequence[Any]) -> None:
        self._data = frames[0]


class ErrorReply(_Message):
    """Any RPC server -> the client whose request it could not serve."""

    type: Literal["error"] = "error"
    request_id: int = -1  # -1: the request was unreadable
    reason: str  # a ProtocolError reason label or an application label
    message: str = ""


ControlMessage = Annotated[
    Hello
    | Heartbeat
    | Ack
    | WeightsPublished
    | LatestWeightsRequest
    | ProfilesPublished
    | LatestProfilesRequest
    | Drain
    | Shutdown
    | BufferStatsRequest
    | BufferStats
    | SampleRequest
    | VersionAnnounce
    | SampleReply
    | ErrorReply,
    Field(discriminator="type"),
]
MESSAGE_TYPES: tuple[type[_Message], ...] = (
    Hello,
    Heartbeat,
    Ack,
    WeightsPublished,
    LatestWeightsRequest,
    ProfilesPublished,
    LatestProfilesRequest,
    Drain,
    Shutdown,
    BufferStatsRequest,
    BufferStats,
    SampleRequest,
    VersionAnnounce,
    SampleReply,
    ErrorReply,
)
_ADAPTER: TypeAdapter = TypeAdapter(ControlMessage)


def pack_message(msg: _Message) -> bytes:
    """Serialise one control message's header (every field) to msgpack bytes."""
    if not isinstance(msg, MESSAGE_TYPES):
        raise TypeError(f"{type(msg).__name__} is not a control message")
    return msgpack.packb(msg.model_dump(mode="python"), use_bin_type=True)


def frames_of(msg: _Message) -> list[Any]:
    """What goes on the wire for ``msg``: its msgpack header, then its attached buffers, one frame each."""
    return [pack_message(msg), *msg.attachments()]


class _Budget:
    """Counts containers and their elements as the unpacker builds them (hooks run bottom-up, right
    after each container), and stops the unpacking once the message exceeds the schema's size."""

    def __init__(self) -> None:
        self.containers = 0
        self.items = 0

    def _take(self, n: int) -> None:
        self.containers += 1
        self.items += n
        if self.containers > MAX_CONTAINERS or self.items > MAX_ITEMS:
            raise ValueError(
                f"more than {MAX_CONTAINERS} containers or {MAX_ITEMS} elements: no control message is that large"
            )

    def list_hook(self, value: list) -> list:
        self._take(len(value))
        return value

    def object_hook(self, value: dict) -> dict:
        self._take(len(value))
        return value


def _unpack(data: bytes | bytearray | memoryview) -> _Message:
    size = memoryview(data).nbytes
    if size > MAX_CONTROL_BYTES:
        raise FrameTooLarge(f"control message is {size} bytes, cap is {MAX_CONTROL_BYTES}")
    budget = _Budget()
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=MAX_STR_LEN,
            max_bin_len=MAX_CONTROL_BYTES,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,  # no ext types on this wire
            list_hook=budget.list_hook,
            object_hook=budget.object_hook,
        )
    # The fault boundary for foreign msgpack: every unpacker error becomes a typed DecodeError.
    # ValueError covers ExtraData, FormatError, StackError, UnicodeDecodeError and limit overruns.
    except (ValueError, OverflowError, msgpack.UnpackException) as e:
        raise DecodeError(f"not a valid msgpack message: {type(e).__name__}: {e}") from e
    if not isinstance(obj, dict):
        raise SchemaMismatch(f"control message is a msgpack {type(obj).__name__}, expected a map")
    try:
        return _ADAPTER.validate_python(obj)
    except ValidationError as e:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise SchemaMismatch(
            f"control message type {str(obj.get('type'))[:40]!r} fails its schema at {where or '<root>'}: "
            f"{first.get('msg', e)} ({e.error_count()} errors)"
        ) from None


def _check_attachments(msg: _Message, attachments: Sequence[Any]) -> None:
    want = msg.attachment_sizes()
    got = tuple(memoryview(a).nbytes for a in attachments)
    if len(got) != len(want):
        raise DecodeError(f"{msg.type} declares {len(want)} attached frame(s), {len(got)} came with it")
    if got != want:
        raise DecodeError(f"{msg.type} declares attached frames of {list(want)} bytes, got {list(got)}")
    if want:
        msg._attach(attachments)


def unpack_message(
    data: bytes | bytearray | memoryview, attachments: Sequence[Any] | None = None
) -> _Message:
    """Parse foreign msgpack bytes into a typed control message; raises (and counts) ProtocolError.

    ``attachments``: the frames that came after the header (a transport passes them, even when
    there are none); they must be exactly the ones the message declares. ``None``: the header alone
    (a message that declares frames then has none to hand out).
    """
    try:
        msg = _unpack(data)
        if attachments is not None:
            _check_attachments(msg, attachments)
        return msg
    except ProtocolError as e:
        count_rejection(e.reason)
        raise
