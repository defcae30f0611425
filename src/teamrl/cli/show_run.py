"""``teamrl show``: the run folder read as data (config, metrics, evaluations, sampled episodes, the
services' timeline and the buffer's stats), with every problem recorded rather than raised
(``Run.problems``: exit code 2; ``Run.notes``: absent optional parts, torn last lines).
"""

from __future__ import annotations

import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from teamrl.protocol.trajectory import GraphTrajectory

SAMPLE_NAME = re.compile(r"^step-(\d+)\.arrow$")


@dataclass
class Sample:
    """One decoded episode and where it came from."""

    traj: GraphTrajectory
    file: str
    file_step: int | None

    @property
    def version(self) -> int:
        """The newest policy version that acted in the episode (async runs mix versions)."""
        return max((s.policy_version for s in self.traj.steps), default=-1)

    @property
    def key(self) -> tuple[float, float, str]:
        """Ranking key: team reward, then summed step credit, then id (deterministic ties)."""
        credit = sum(finite(s.reward) or 0.0 for s in self.traj.steps)
        return (finite(self.traj.reward) or 0.0, credit, self.traj.episode_id)


@dataclass
class Run:
    path: Path
    config_name: str = ""
    config_text: str = ""
    metrics: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    sample_files_total: int = 0
    sample_files_read: int = 0
    problems: list[str] = field(default_factory=list)  # malformed input: exit code 2
    notes: list[str] = field(default_factory=list)  # absent optional parts, torn last lines: exit 0
    spread_files: list[str] = field(default_factory=list)  # files picked across the run's history
    timeline: list[dict] = field(default_factory=list)  # timeline.jsonl: one state interval each
    buffer_stats: list[dict] = field(default_factory=list)  # buffer/stats.jsonl: queue depths

    @property
    def readable(self) -> bool:
        return bool(self.config_text or self.metrics or self.evals or self.samples)


def finite(v: Any) -> float | None:
    """``v`` as a plottable float, else None. Beyond +-1e150 counts as not finite: the axis
    arithmetic (spans, tick steps) would overflow."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:  # an int too large for a float
        return None
    return f if math.isfinite(f) and abs(f) < 1e150 else None


def read_jsonl(path: Path, run: Run) -> list[dict]:
    """The JSON objects of ``path``; malformed lines become problems, a torn last line a note."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        run.problems.append(f"{path.name}: cannot read ({e.strerror or e})")
        return []
    rows: list[dict] = []
    lines = text.split("\n")
    bad: list[int] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # no newline after it: the writer was cut mid-line
                run.notes.append(
                    f"{path.name}: last line is incomplete (run still writing or killed); skipped"
                )
            else:
                bad.append(i + 1)
            continue
        if isinstance(obj, dict):
            rows.append(obj)
        else:
            bad.append(i + 1)
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        run.problems.append(
            f"{path.name}: {len(bad)} line(s) are not JSON objects (line {shown}); expected one object per line"
        )
    return rows


def _read_config(run: Run) -> None:
    for name in ("config.json", "config.toml"):
        path = run.path / name
        if not path.exists():
            continue
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            run.problems.append(f"{name}: cannot read ({e.strerror or e})")
            return
        try:
            if name.endswith(".json"):
                text = json.dumps(json.loads(text), indent=2, sort_keys=True)
            else:
                import tomllib

                tomllib.loads(text)
        except (ValueError, TypeError) as e:  # JSONDecodeError and TOMLDecodeError are ValueErrors
            run.problems.append(f"{name}: not valid {name.rsplit('.', 1)[1].upper()} ({e})")
        run.config_name, run.config_text = name, text
        return
    run.notes.append("no config.json or config.toml in the run folder")


def _sample_files(run: Run, newest: int) -> list[tuple[Path, int | None]]:
    folder = run.path / "samples"
    if not folder.is_dir():
        run.notes.append(
            "no samples/ folder: no episodes to draw (the training loop writes samples/step-NNNNNN.arrow)"
        )
        return []
    files: list[tuple[Path, int | None]] = []
    for p in folder.iterdir():
        if not p.name.endswith(".arrow"):
            continue
        m = SAMPLE_NAME.match(p.name)
        if m is None:
            run.notes.append(f"samples/{p.name}: name is not step-NNNNNN.arrow; read, sorted last")
        files.append((p, int(m.group(1)) if m else None))
    files.sort(key=lambda f: (f[1] is None, f[1] if f[1] is not None else 0, f[0].name))
    run.sample_files_total = len(files)
    if not files:
        run.notes.append("samples/ holds no .arrow files yet")
        return []
    # The newest files for the best/worst comparison, plus up to 6 spread over the whole run.
    chosen = set(range(max(0, len(files) - max(1, newest)), len(files)))
    spread = sorted({round(i * (len(files) - 1) / 5) for i in range(6)}) if len(files) > 1 else [0]
    run.spread_files = [files[i][0].name for i in spread]
    chosen.update(spread)
    return [files[i] for i in sorted(chosen)]


def load_run(path: Path, sample_files: int = 20) -> Run:
    run = Run(path=path)
    _read_config(run)
    metrics = path / "metrics.jsonl"
    from teamrl.cli.plots import group_folders

    groups = group_folders(path)
    if not metrics.exists() and groups:  # a team of different models: one learner group per base
        metrics = groups[0] / "metrics.jsonl"
        others = ", ".join(str(g) for g in groups[1:])
        run.notes.append(
            f"learner groups: {', '.join(g.name for g in groups)}; steps shown are "
            f"{groups[0].name}'s (teamrl show {others} for the others' metrics)"
        )
    if metrics.exists():
        run.metrics = read_jsonl(metrics, run)
    else:
        run.problems.append("metrics.jsonl is missing (every run writes one object per learner step there)")
    evals = path / "eval.jsonl"
    if evals.exists():
        run.evals = read_jsonl(evals, run)
    else:
        run.notes.append("no eval.jsonl (held-out evaluation disabled or not reached yet)")
    _read_timeline(run)
    _read_samples(run, _sample_files(run, sample_files))
    return run


def _read_timeline(run: Run) -> None:
    """The services' state intervals (teamrl.protocol.timeline) and the buffer's stats, if any."""
    path = run.path / "timeline.jsonl"
    if path.exists():
        rows = read_jsonl(path, run)
        keys = ("t0", "t1")
        run.timeline = [
            r
            for r in rows
            if all(finite(r.get(k)) is not None for k in keys) and "service" in r and "state" in r
        ]
        if len(run.timeline) < len(rows):
            run.problems.append(
                f"timeline.jsonl: {len(rows) - len(run.timeline)} record(s) without service, state, t0, t1"
            )
    stats = run.path / "buffer" / "stats.jsonl"
    if stats.exists():
        run.buffer_stats = read_jsonl(stats, run)


def _read_samples(run: Run, files: list[tuple[Path, int | None]]) -> None:
    """Decode the chosen sample files into ``run.samples`` (each episode once)."""
    if files:
        from teamrl.protocol import ProtocolError, decode_trajectories

        seen: set[tuple[str, int]] = set()
        for p, step in files:
            try:
                data = p.read_bytes()
            except OSError as e:
                run.problems.append(f"samples/{p.name}: cannot read ({e.strerror or e})")
                continue
            if not data:  # created, not yet written: a live run's newest file
                run.notes.append(f"samples/{p.name}: empty (still being written?); skipped")
                continue
            try:
                trajs = decode_trajectories(data)
            except ProtocolError as e:
                run.problems.append(
                    f"samples/{p.name}: not a trajectory batch ({type(e).__name__}: {e}); "
                    "expected the bytes of teamrl.protocol.encode_trajectories"
                )
                continue
            run.sample_files_read += 1
            for t in trajs:
                k = (t.incarnation, t.seq)
                if k in seen:
                    continue
                seen.add(k)
                run.samples.append(Sample(t, p.name, step))


def pick_best_worst(
    samples: list[Sample], k: int, recent: int
) -> tuple[list[Sample], list[Sample], list[int]]:
    """Best and worst ``k`` episodes among those sampled with the ``recent`` newest versions.

    The two lists are disjoint (a small pool gives fewer worst episodes rather than repeats).
    """
    versions = sorted({s.version for s in samples}, reverse=True)[: max(1, recent)]
    pool = sorted((s for s in samples if s.version in set(versions)), key=lambda s: s.key)
    best = list(reversed(pool[-k:])) if k > 0 else []
    taken = {id(s) for s in best}
    worst = [s for s in pool if id(s) not in taken][:k]
    return best, worst, versions


def esc(s: Any) -> str:
    return html.escape(str(s), quote=True)


def fmt_num(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e5 or a < 1e-3:
        return f"{v:.2g}"
    return f"{v:.4g}"
