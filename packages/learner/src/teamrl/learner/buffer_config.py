"""Typed configuration of the replay buffer service, read from the ``[buffer]`` table of a TOML file.

This model is the one source of the buffer's settings: ``ReplayBuffer(cfg)`` reads its fields, and
no other place writes a default for them (``tests/unit/learner/test_one_source.py``). A test builds
one without a file (``BufferConfig(capacity=10)``). Validators only check that values agree and
raise; nothing is copied between fields.

The rate-limit fields follow DeepMind Reverb's ``SampleToInsertRatio``: with ``spi`` samples per
insert, the limiter keeps ``diff = inserts * spi - samples`` inside
``[min_size * spi - error_buffer, min_size * spi + error_buffer]`` once ``min_size`` items exist.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from teamrl.protocol.configfile import load_section


class BufferConfig(BaseModel):
    """Every knob of the replay buffer; ``teamrl buffer --config FILE.toml`` reads ``[buffer]``."""

    model_config = ConfigDict(extra="forbid")

    # --- where it listens -------------------------------------------------------------------
    bind: str = Field(
        "tcp://127.0.0.1:5555",
        description="Data ROUTER endpoint the buffer binds; rollout services send trajectories here.",
    )
    sample_bind: str = Field(
        "tcp://127.0.0.1:5556",
        description="RPC ROUTER endpoint the buffer binds; learner ranks send SampleRequest here.",
    )
    metrics_port: int = Field(
        9105, ge=0, le=65535, description="HTTP port for /metrics and /healthz; 0 disables the server."
    )
    metrics_host: str = Field("127.0.0.1", description="Interface the HTTP metrics server binds.")
    dir: Path = Field(
        Path("runs/buffer"),
        description="Folder for Arrow IPC segment files and checkpoints; created if missing.",
    )

    # --- capacity and sampling ----------------------------------------------------------------
    capacity: int = Field(
        100_000, ge=1, description="Most sampleable trajectories held; inserting past it evicts the oldest."
    )
    sampler: Literal["fifo", "uniform", "prioritized"] = Field(
        "fifo",
        description="fifo: oldest first; uniform: at random; prioritized: P(i) ~ priority_i ** alpha.",
    )
    max_times_sampled: int = Field(
        1,
        ge=0,
        description="Samples of one trajectory (per view: whole or per agent) before it is removed; 0 = never.",
    )
    priority_exponent: float = Field(
        0.6, ge=0, description="alpha of prioritised replay (Schaul et al. 2016, eq. 1); 0 = uniform."
    )
    importance_exponent: float = Field(
        0.4, ge=0, description="beta of prioritised replay's importance weights (N * P(i)) ** -beta."
    )
    seed: int = Field(0, description="Seed of the sampler's random generator.")

    # --- rate limiting (Reverb) ---------------------------------------------------------------
    min_size: int = Field(1, ge=1, description="Sampling blocks until this many trajectories are held.")
    samples_per_insert: float | None = Field(
        None,
        gt=0,
        description="Target samples per inserted trajectory; None = no ratio, only min_size.",
    )
    error_buffer: float = Field(
        100.0,
        ge=0,
        description="Allowed drift of inserts*spi - samples around min_size*spi before one side blocks.",
    )

    # --- admission ----------------------------------------------------------------------------
    max_policy_lag: int | None = Field(
        4,
        ge=0,
        description="Trajectories whose oldest step is more than this many versions behind the learner are stale; None = never.",
    )
    policy_version_window: int | None = Field(
        10_000,
        ge=1,
        description="A frame's policy version, a sample's min_policy_version, or a learner's announced "
        "version more than this far above the buffer's current version is refused "
        "(policy_version_out_of_range) and never stored, whoever sends it. None = no bound.",
    )
    model_ids: list[str] = Field(
        default_factory=list,
        description="Base model ids the run's plan names (teamrl run fills them); data, requests and "
        "announcements naming another are refused (unknown_model_id). Empty: learnt from learners' "
        "announcements (docs/security.md).",
    )
    agent_ids: list[str] = Field(
        default_factory=list,
        description="Agent ids the run's plan names (teamrl run fills them); others are refused "
        "(unknown_agent_id). Empty: learnt from learners' announcements.",
    )
    admin_bind: str | None = Field(
        None,
        description="Operator endpoint for Drain/Shutdown/stats; None = ipc://<dir>/admin.sock (mode 0600). "
        "Drain/Shutdown on sample_bind are refused unless they come with the CURVE admin key.",
    )
    stale_action: Literal["drop", "downweight"] = Field(
        "drop",
        description="drop: refuse/evict stale data (counted); downweight: keep it with a smaller weight.",
    )
    stale_decay: float = Field(
        0.5,
        gt=0,
        le=1,
        description="downweight only: weight = stale_decay ** (staleness - max_policy_lag).",
    )

    # --- groups ---------------------------------------------------------------------------------
    group_size: int = Field(
        1, ge=1, description="Episodes per group_id; a group becomes sampleable only when complete."
    )
    group_timeout_s: float = Field(
        120.0,
        gt=0,
        description="A group still incomplete after this long is released for sampling as it is "
        "(counted in teamrl_buffer_groups_timed_out).",
    )
    max_pending_groups: int = Field(
        10_000,
        ge=1,
        description="Incomplete groups held at once; past it the oldest is released as it is "
        "(counted as timed out).",
    )

    # --- persistence ----------------------------------------------------------------------------
    checkpoint_interval_s: float = Field(
        1.0,
        gt=0,
        description="Most time between checkpoints while frames wait; acks are sent only after one.",
    )
    checkpoint_max_frames: int = Field(
        64, ge=1, description="Checkpoint early once this many received frames wait for their ack."
    )
    keep_checkpoints: int = Field(
        2, ge=1, description="Complete checkpoints kept on disk (older ones deleted)."
    )
    fsync: bool = Field(True, description="fsync segment, state and DONE files (off only for tests).")

    # --- serving --------------------------------------------------------------------------------
    sample_timeout_ms: int = Field(
        1000,
        ge=0,
        description="How long one SampleRequest may wait for data / the rate limiter before a 'not_ready' reply.",
    )
    recv_hwm: int = Field(64, ge=1, description="High-water mark of the data ROUTER, in messages.")
    max_msg_size: int = Field(256 * 1024 * 1024, ge=1024, description="ZMQ_MAXMSGSIZE of the data ROUTER.")

    @model_validator(mode="after")
    def _values_agree(self) -> BufferConfig:
        if self.min_size > self.capacity:
            raise ValueError(f"min_size {self.min_size} is larger than capacity {self.capacity}")
        if self.samples_per_insert is not None:
            # Reverb's rule: the buffer must hold at least one insert's worth of samples, or inserts
            # and samples could both block (each waiting for the other).
            need = max(1.0, self.samples_per_insert) * self.group_size
            if self.error_buffer < need:
                raise ValueError(
                    f"error_buffer {self.error_buffer} is smaller than max(1, samples_per_insert) * "
                    f"group_size = {need}; inserts and samples could deadlock"
                )
        return self


def load_buffer_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> BufferConfig:
    """Read ``[buffer]`` from a TOML file (or the whole file if it has no such table), then apply
    ``overrides`` (CLI flags that were given). Raises ``ConfigError`` naming the bad field."""
    return load_section(BufferConfig, path, "buffer", flags=overrides, whole_file=True)
