"""A model of the actor-learner pipeline in simulated time: step time, idle fractions, version lag.

``simulate(costs, pipeline) -> Prediction`` runs the pipeline's rules, not a formula: rollout replicas
start groups while fewer than ``groups_in_flight`` are in flight and the version budget allows
(at most ``(max_lag + 1) x tasks_per_step x learners`` groups ahead, each new version letting one
step's worth more start, shared by the replicas, as ``teamrl run`` plans it),
a group computes and then waits on the world (tool or reward latency, holding no compute), finished
groups queue in a FIFO buffer, the learner drops groups more than ``max_lag`` versions old, takes
``tasks_per_step x learners`` of them, trains, publishes, and each rollout pauses to load the new
version. ``mode="sync"`` runs the same costs one phase after the other (generate a batch, train,
publish and load).

Costs are seconds measured on the real services (``teamrl cluster costs RUN``, from a run's
``timeline.jsonl`` and ``metrics.jsonl``) or given for other hardware (``teamrl cluster predict``):

* ``group_s``: compute seconds of one group (``group_size`` episodes) when a replica works on nothing
  else; ``group_cv`` their coefficient of variation (gamma-distributed: long-tailed episodes);
* ``saturation``: how many groups a replica must compute at once to reach its full speed: the speed
  each computing group gets is ``1 / max(computing, saturation)``. 1 is a compute-bound engine (a CPU):
  speed is shared; a GPU engine's is tens of groups, so the last stragglers of a batch run alone at
  a fraction of its throughput;
* ``latency_s``: seconds each group waits on the world after computing (``[reward] latency_s``, tools);
* ``step_s`` the learner's compute per step, ``publish_s`` its export and send per version, ``load_s``
  a rollout's pause to load and probe a version;
* ``host_cores`` and ``demand``: services on one shared host (this machine; the costs measured by a
  sync run, one process at a time). With ``busy`` services working at once, each runs
  ``demand x busy`` times slower (never faster than alone): ``demand`` is fitted on one run (vLLM's
  engine, the buffer and the learner each keep more than their share of 2 cores busy).
  ``host_cores = 0``: every service has its own device, nothing is shared.

Design decisions:

* **Time-stepped** at ``dt`` (a 400th of the shortest cost by default): a few thousand ticks per
  step, exact enough for step times (error < 1 %), and the rules read like the services' code.
* **Deterministic**: group work is drawn from ``random.Random(seed)``.
* **Steady state**: step time, idle fractions and lag are taken from the second step on (the first
  includes filling an empty buffer), as the measured figures are (``teamrl cluster check``).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class Costs:
    """Measured or assumed seconds (module docstring)."""

    group_s: float
    step_s: float
    publish_s: float = 0.0
    load_s: float = 0.0
    latency_s: float = 0.0
    group_cv: float = 0.0
    saturation: float = 1.0
    host_cores: float = 0.0
    demand: float = 1.0


@dataclass(frozen=True)
class Pipeline:
    """How the run is laid out: the ``teamrl run`` flags of the same names."""

    mode: Literal["async", "sync"] = "async"
    rollouts: int = 1
    learners: int = 1
    tasks_per_step: int = 16
    groups_in_flight: int = 16
    max_lag: int = 2
    steps: int = 40


@dataclass(frozen=True)
class Prediction:
    step_s: float  # mean seconds per learner step, from the second step on
    learner_idle: float  # share of the learner's time waiting for data
    rollout_idle: float  # share of a replica's time with no group computing (mean over replicas)
    lag_mean: float  # versions between the policy that generated a trained group and the learner's
    dropped: int  # groups dropped as more than max_lag versions old

    @property
    def groups_per_s(self) -> float:
        return float("nan") if self.step_s <= 0 else 1.0 / self.step_s


@dataclass
class _Group:
    work: float  # compute seconds left (alone on the replica)
    wait: float  # world latency left, after the work
    version: int


@dataclass
class _Replica:
    live: int = 0  # the version it generates with
    paused_until: float = 0.0  # loading a version
    tokens: int = -1  # groups that may start now (the version budget; -1: not yet filled)
    inflight: list[_Group] = field(default_factory=list)
    idle_s: float = 0.0


class _Sim:
    """One simulated run (``simulate``); ``tick`` advances every service by ``dt``."""

    def __init__(self, c: Costs, p: Pipeline, seed: int, dt: float) -> None:
        self.c, self.p, self.dt = c, p, dt
        self.rng = random.Random(seed)
        self.t = 0.0
        self.replicas = [_Replica() for _ in range(p.rollouts)]
        self.buffer: deque[int] = deque()  # versions of finished groups, oldest first
        self.version = 0
        self.phase, self.left = "wait", 0.0  # learner: wait | train | publish
        self.batch = p.tasks_per_step * p.learners
        self.step_ends: list[float] = []
        self.learner_idle: list[float] = []  # per step: seconds waiting for data
        self.waited = 0.0
        self.lags: list[int] = []
        self.dropped = 0

    def work(self) -> float:
        """One group's compute seconds: gamma with mean ``group_s`` and cv ``group_cv``."""
        c = self.c
        if c.group_cv <= 0:
            return c.group_s
        shape = 1.0 / c.group_cv**2
        return self.rng.gammavariate(shape, c.group_s / shape)

    def slowdown(self) -> float:
        """How many times slower each busy process runs on a shared host (1: own devices)."""
        c = self.c
        if c.host_cores <= 0:
            return 1.0
        busy = sum(1 for r in self.replicas if r.paused_until > self.t or any(g.work > 0 for g in r.inflight))
        busy += self.phase != "wait"
        return max(c.demand * busy, 1.0)

    def budget(self) -> tuple[int, int]:
        """Each replica's (capacity, refill per version), as ``teamrl run`` plans them."""
        share = -(-self.batch // self.p.rollouts)
        return -(-(self.p.max_lag + 1) * self.batch // self.p.rollouts), share

    def start_groups(self, r: _Replica) -> None:
        if r.tokens < 0:
            r.tokens = self.budget()[0]
        while len(r.inflight) < self.p.groups_in_flight and r.tokens > 0 and r.paused_until <= self.t:
            r.inflight.append(_Group(self.work(), self.c.latency_s, r.live))
            r.tokens -= 1

    def advance_replica(self, r: _Replica, slow: float) -> None:
        computing = [g for g in r.inflight if g.work > 0]
        if r.paused_until > self.t or not computing:
            r.idle_s += self.dt if r.paused_until <= self.t else 0.0
            computing = []
        share = self.dt / slow / max(len(computing), self.c.saturation)
        for g in r.inflight:
            if g.work > 0:
                g.work -= share if computing else 0.0
            else:
                g.wait -= self.dt
        for g in [g for g in r.inflight if g.work <= 0 and g.wait <= 0]:
            r.inflight.remove(g)
            self.buffer.append(g.version)

    def advance_learner(self, slow: float) -> None:
        if self.phase == "wait":
            oldest = self.version - self.p.max_lag
            if any(v < oldest for v in self.buffer):  # the buffer drops stale groups wherever they are
                kept = [v for v in self.buffer if v >= oldest]
                self.dropped += len(self.buffer) - len(kept)
                self.buffer = deque(kept)
            if len(self.buffer) < self.batch:
                self.waited += self.dt
                return
            self.lags += [self.version - self.buffer.popleft() for _ in range(self.batch)]
            self.phase, self.left = "train", self.c.step_s
        self.left -= self.dt / slow
        if self.left > 0:
            return
        if self.phase == "train" and self.c.publish_s > 0:
            self.phase, self.left = "publish", self.c.publish_s
            return
        self.new_version()

    def new_version(self) -> None:
        self.version += 1
        self.phase = "wait"
        self.step_ends.append(self.t)
        self.learner_idle.append(self.waited)
        self.waited = 0.0
        cap, refill = self.budget()
        for r in self.replicas:  # each loads the new version (a pause); its budget refills a step's worth
            r.paused_until = max(r.paused_until, self.t) + self.c.load_s
            r.live, r.tokens = self.version, min(cap, max(r.tokens, 0) + refill)

    def tick(self) -> None:
        slow = self.slowdown()
        for r in self.replicas:
            self.start_groups(r)
            self.advance_replica(r, slow)
        self.advance_learner(slow)
        self.t += self.dt


def simulate(c: Costs, p: Pipeline, *, seed: int = 0, dt: float | None = None) -> Prediction:
    """Run ``p`` with costs ``c`` in simulated time (module docstring)."""
    if p.mode == "sync":
        return _simulate_sync(c, p, seed)
    dt = (
        dt
        or min(x for x in (c.group_s, c.step_s, c.publish_s or c.step_s, c.load_s or c.step_s) if x > 0) / 400
    )
    sim = _Sim(c, p, seed, dt)
    limit = 1e6 / dt
    while len(sim.step_ends) < p.steps and sim.t / dt < limit:
        sim.tick()
    ends = sim.step_ends
    if len(ends) < 2:
        raise ValueError("the pipeline made fewer than 2 steps: the costs cannot be run")
    span = ends[-1] - ends[0]
    n = len(ends) - 1
    idle = sum(r.idle_s for r in sim.replicas) / len(sim.replicas)
    return Prediction(
        step_s=span / n,
        learner_idle=sum(sim.learner_idle[1:]) / span,
        rollout_idle=min(1.0, idle / sim.t),
        lag_mean=sum(sim.lags) / max(len(sim.lags), 1),
        dropped=sim.dropped,
    )


def _simulate_sync(c: Costs, p: Pipeline, seed: int) -> Prediction:
    """Generate a batch (its slowest group closes it), then train, publish and load: one after the other."""
    rng = random.Random(seed)
    batch = p.tasks_per_step * p.learners
    per_replica = -(-batch // p.rollouts)
    gens = []
    for _ in range(p.steps):
        sim = _Sim(c, p, rng.randrange(2**31), dt=max(c.group_s, 1e-6) / 400)
        r = _Replica()
        r.inflight = [_Group(sim.work(), c.latency_s, 0) for _ in range(per_replica)]
        while r.inflight:
            sim.advance_replica(r, 1.0)
            sim.t += sim.dt
        gens.append((sim.t, r.idle_s))
    gen = sum(g for g, _ in gens) / len(gens)
    computing = gen - sum(i for _, i in gens) / len(gens)
    step = gen + c.step_s + c.publish_s + c.load_s
    return Prediction(step, gen / step, 1 - computing / step, lag_mean=0.0, dropped=0)
