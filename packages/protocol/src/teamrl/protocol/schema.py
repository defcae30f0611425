"""The Arrow schema of a batch of graph trajectories: the one source of truth for the data wire.

Layout decision: **one row per trajectory, steps nested** as ``list<struct<...>>``. Per-episode
fields (ids, trajectory reward, turn rewards, metadata) are plain columns and appear once per
episode, not repeated on every step row; the step struct's token columns are ``list<int32>`` /
``list<float32>`` whose child buffers are the *concatenation of every step of every trajectory in
the batch*. Encoding is therefore one ``np.concatenate`` per token column (a memcpy) plus an
offsets vector, and decoding slices one flat numpy view per column (zero-copy).

The schema carries ``SCHEMA_VERSION`` in its metadata under ``teamrl.schema_version``; a reader
refuses any other version (``SchemaMismatch``) rather than guessing. Bump the version on any
change of a field name, type or meaning; adding a field is a change too (old readers compare the
whole schema).

Caps bound what one frame may make a receiver allocate or iterate; they are checked on decode.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1
SCHEMA_VERSION_KEY = b"teamrl.schema_version"

# Size caps applied to every decoded frame (foreign input). Generous for real episodes
# (a 32k-token context, a few hundred steps) but small enough that a hostile frame cannot make
# a receiver loop for minutes.
MAX_FRAME_BYTES = 256 * 1024 * 1024
MAX_TRAJECTORIES_PER_FRAME = 65_536
MAX_STEPS_PER_TRAJECTORY = 4_096
MAX_TOKENS_PER_STEP = 262_144
MAX_PARENTS_PER_STEP = 4_096
MAX_RECORD_BATCHES_PER_FRAME = 64

FINISH_REASONS = ("stop", "length", "abort")

TOOL_CALL_TYPE = pa.struct(
    [
        pa.field("name", pa.string(), nullable=False),
        pa.field("arguments", pa.string(), nullable=False),
        pa.field("result", pa.string(), nullable=False),
    ]
)

# Field order here is the order the encoder builds the struct children in.
STEP_TYPE = pa.struct(
    [
        pa.field("agent_id", pa.string(), nullable=False),
        pa.field("role", pa.string(), nullable=False),
        pa.field("model_id", pa.string(), nullable=False),
        pa.field("adapter", pa.string(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("turn", pa.int32(), nullable=False),
        pa.field("parents", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("response_ids", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("logprobs", pa.list_(pa.field("item", pa.float32(), nullable=False)), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("response_text", pa.string(), nullable=False),
        pa.field("tool_calls", pa.list_(pa.field("item", TOOL_CALL_TYPE, nullable=False)), nullable=False),
        pa.field("t_start", pa.float64(), nullable=False),
        pa.field("t_end", pa.float64(), nullable=False),
    ]
)

TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("episode_id", pa.string(), nullable=False),
        pa.field("incarnation", pa.string(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("task_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("workflow", pa.string(), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("turn_rewards", pa.list_(pa.field("item", pa.float32(), nullable=False)), nullable=False),
        pa.field("metadata", pa.map_(pa.string(), pa.string()), nullable=False),
        pa.field("steps", pa.list_(pa.field("item", STEP_TYPE, nullable=False)), nullable=False),
    ],
    metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()},
)
