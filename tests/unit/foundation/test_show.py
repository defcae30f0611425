"""``teamrl show``: the HTML report of a run folder, its escaping, its failure modes, and (when a
chromium binary is installed) that a real browser renders the episode graphs.

``TEAMRL_SHOW_EXAMPLE_PNG=docs/show_example.png pytest tests/unit/foundation/test_show.py -k chromium``
also writes docs/running.md's screenshot from the same synthetic run.
"""

from __future__ import annotations

import html
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from teamrl.cli import show
from teamrl.protocol import ToolCall, encode_trajectories, example_trajectories

HOSTILE = '</pre><script>alert("x")</script><img src=x onerror=alert(1)>&amp;'


def make_run(path: Path, steps: int = 80, files: int = 6, per_file: int = 6) -> Path:
    """A run folder like ``teamrl run`` writes, with synthetic numbers and example trajectories."""
    rng = random.Random(0)
    (path / "samples").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"steps": steps, "lr": 5e-4, "mode": "async"}))
    with (path / "metrics.jsonl").open("w") as f:
        for s in range(steps):
            r = 0.3 + 0.4 * (1 - math.exp(-s / 30)) + rng.gauss(0, 0.08)
            row = {
                "step": s,
                "time": 2.0 * s + 5,
                "version": s + 1,
                "reward_mean": r,
                "reward/solver": r,
                "reward/critic": 0.5 + 0.3 * r + rng.gauss(0, 0.05),
                "grad_norm/solver": math.exp(rng.gauss(0, 0.5)),
                "grad_norm/critic": 0.3 * math.exp(rng.gauss(0, 0.5)),
                "loss/solver": rng.random(),
                "probe_err": float("nan"),
            }
            f.write(json.dumps(row) + "\n")
    with (path / "eval.jsonl").open("w") as f:
        for s in range(0, steps + 1, 20):
            f.write(
                json.dumps({"step": s, "time": 2.0 * s, "reward_mean": 0.35 + s / 300, "eval_seconds": 3.0})
                + "\n"
            )
    for k in range(files):
        step = k * (steps // files)
        trajs = example_trajectories(per_file, seed=k)
        for t in trajs:
            for st in t.steps:
                st.policy_version = step
        (path / "samples" / f"step-{step:06d}.arrow").write_bytes(encode_trajectories(trajs))
    return path


class Dom(HTMLParser):
    """Tags and attributes of a page, to check structure without regexes over markup."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def parse(text: str) -> list[tuple[str, dict[str, str | None]]]:
    d = Dom()
    d.feed(text)
    return d.tags


def nodes(tags) -> list[dict]:
    return [a for t, a in tags if t == "g" and a.get("class") == "node"]


def test_report_of_a_run_folder(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    assert show.main([str(run)]) == 0
    page = (run / "report.html").read_text()
    assert capsys.readouterr().out.strip() == str(run / "report.html")
    tags = parse(page)
    # Self-contained: no scripts, nothing fetched from anywhere.
    assert not [t for t, _ in tags if t in ("script", "link", "img", "iframe")]
    assert "http://" not in page.replace("http://www.w3.org", "") and "https://" not in page
    # Curves: reward, per agent, grad norm, eval; each a drawn line (matplotlib: a group curve-N).
    for title in (
        "Reward against learner steps",
        "Reward per agent",
        "Gradient norm per agent",
        "Held-out evaluation",
    ):
        assert title in page
    assert sum(1 for t, a in tags if t == "g" and (a.get("id") or "").startswith("curve-")) >= 6
    # Episodes as graphs: the best and worst of the newest versions, one node per step, edges.
    loaded = show.load_run(run)
    best, worst, versions = show.pick_best_worst(loaded.samples, 3, 3)
    assert len(best) == len(worst) == 3 and versions == [65, 52, 39]
    assert {s.version for s in best + worst} <= set(versions)
    assert min(s.key for s in best) >= max(s.key for s in worst)
    drawn = nodes(tags)
    assert len(drawn) >= sum(len(s.traj.steps) for s in best + worst)
    edges = [a for t, a in tags if t == "path" and a.get("class") == "edge"]
    assert len(edges) == page.count('class="edge"') and edges
    assert "best #1" in page and "worst #3" in page
    t = best[0].traj
    for i, st in enumerate(t.steps):
        assert f'id="b0-s{i}"' in page  # the step card a node links to
        assert st.response_text in page
    assert f"policy v{t.steps[0].policy_version}" in page
    assert "credit per agent" in page and "turn rewards" in page


def test_untrusted_text_is_escaped(tmp_path):
    run = make_run(tmp_path / "run", files=1)
    trajs = example_trajectories(2, seed=9)
    t = trajs[0]
    t.reward = 99.0  # surely the best episode, so every field below is rendered
    t.episode_id, t.task_id, t.workflow, t.metadata = HOSTILE, HOSTILE, HOSTILE, {HOSTILE: HOSTILE}
    for st in t.steps:
        st.policy_version = 1000
        st.agent_id = st.role = st.adapter = HOSTILE if st.agent_id == "solver" else st.agent_id
        st.response_text = HOSTILE * 3
        st.tool_calls = [ToolCall(HOSTILE, HOSTILE, HOSTILE)]
    (run / "samples" / "step-999999.arrow").write_bytes(encode_trajectories(trajs))
    (run / "eval.jsonl").write_text(json.dumps({"step": 1, HOSTILE: 0.5}) + "\n")
    assert show.main([str(run), "--title", HOSTILE]) == 0
    page = (run / "report.html").read_text()
    tags = parse(page)
    assert not [t for t, _ in tags if t in ("script", "img")]
    assert not [a for _, a in tags for k in a if k.startswith("on")]
    assert "<script" not in page and "&lt;script&gt;" in page
    assert page.count(html.escape(HOSTILE, quote=True)) >= 10  # the hostile episode was rendered


def test_missing_folder_is_exit_2(tmp_path, capsys):
    assert show.main([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_empty_folder_is_exit_2_without_report(tmp_path, capsys):
    assert show.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "nothing readable" in err and "metrics.jsonl is missing" in err
    assert not (tmp_path / "report.html").exists()


def test_partly_readable_folder_still_gives_a_report(tmp_path, capsys):
    run = make_run(tmp_path / "run", files=2)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines.insert(3, "{not json")
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "samples" / "step-000050.arrow").write_bytes(b"\x00garbage" * 20)
    (run / "config.json").write_text("{oops")
    out = tmp_path / "elsewhere" / "r.html"
    assert show.main([str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl: 1 line(s) are not JSON objects (line 4)" in err
    assert "samples/step-000050.arrow: not a trajectory batch" in err
    assert "config.json: not valid JSON" in err
    page = out.read_text()
    assert "Problems reading the run folder" in page and "step-000050.arrow" in page
    assert nodes(parse(page)) and "Reward against learner steps" in page


def test_torn_last_line_is_only_a_note(tmp_path, capsys):
    run = make_run(tmp_path / "run", files=1)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 80, "rew')
    assert show.main([str(run)]) == 0
    assert "last line is incomplete" in capsys.readouterr().err


def test_empty_sample_file_and_extreme_values_are_tolerated(tmp_path, capsys):
    run = make_run(tmp_path / "run", files=1)
    (run / "samples" / "step-000099.arrow").write_bytes(b"")
    with (run / "metrics.jsonl").open("a") as f:
        for row in ({"step": 90, "reward_mean": 1e308}, {"step": 91, "reward_mean": -1e308}, {"step": "x"}):
            f.write(json.dumps(row) + "\n")
        f.write('{"step": 92, "reward_mean": NaN, "grad_norm/solver": -1, "reward/solver": true}\n')
    assert show.main([str(run)]) == 0
    assert "step-000099.arrow: empty" in capsys.readouterr().err


def test_metrics_only_run(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    shutil.rmtree(run / "samples")
    (run / "eval.jsonl").unlink()
    assert show.main([str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "No sampled episodes to draw" in page and "no eval.jsonl" in page
    assert not nodes(parse(page))


def test_best_and_worst_are_disjoint_in_a_small_pool(tmp_path):
    run = make_run(tmp_path / "run", files=1, per_file=3)
    samples = show.load_run(run).samples
    best, worst, _ = show.pick_best_worst(samples, 3, 1)
    assert len(best) == 3 and worst == []
    best, worst, _ = show.pick_best_worst(samples, 2, 1)
    assert len(best) == 2 and len(worst) == 1 and worst[0] not in best


def test_help_is_quick_and_light():
    code = (
        "import sys\nfrom teamrl.cli.main import main\ntry:\n    main(['show', '--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('pyarrow', 'torch', 'vllm') if m in sys.modules]\nprint('HEAVY', heavy)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "self-contained HTML report" in proc.stdout and "--out FILE" in proc.stdout
    assert "HEAVY []" in proc.stdout, proc.stdout + proc.stderr


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _browser(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
    ]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=180)


def test_chromium_renders_the_graphs(tmp_path):
    binary = _chromium()
    if binary is None:
        pytest.skip("no chromium binary (Debian: apt-get install chromium; scripts/setup.sh tries it)")
    run = make_run(tmp_path / "run")
    title = "synthetic example (made-up metrics, teamrl.protocol.example_trajectories)"
    assert show.main([str(run), "--title", title]) == 0
    page = (run / "report.html").read_text()
    url = (run / "report.html").resolve().as_uri()
    dom = _browser(binary, tmp_path / "profile", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    tags = parse(dom.stdout)
    rendered = nodes(tags)
    assert rendered and len(rendered) == len(nodes(parse(page)))
    # The best episode's graph has one node per step, each linking to its step card.
    section = re.search(r'<section class="episode" id="b0">.*?</section>', dom.stdout, re.S)
    assert section is not None
    best = show.pick_best_worst(show.load_run(run).samples, 3, 3)[0][0]
    assert len(nodes(parse(section.group(0)))) == len(best.traj.steps)
    assert sum(1 for t, a in tags if t == "svg" and a.get("class") == "graph") >= 6
    png = tmp_path / "shot.png"
    shot = _browser(binary, tmp_path / "profile", f"--screenshot={png}", "--window-size=1400,2100", url)
    assert shot.returncode == 0, shot.stderr[-2000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000  # a blank page compresses far below this
    if target := os.environ.get("TEAMRL_SHOW_EXAMPLE_PNG"):
        shutil.copyfile(png, target)


def test_print_shows_the_newest_episodes_as_text(tmp_path, capsys):
    run = make_run(tmp_path / "run", files=2, per_file=3)
    assert show.main([str(run), "--print", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("episode ") == 2 and "team reward" in out
    assert "-lora v40)" in out  # the newest file's policy version (file k=1 holds step 80 // 2 * 1)
    assert "<- read #0" in out  # a step that read an earlier one says so


def _timeline(run: Path) -> None:
    """A learner that waits for data 3 s of every 4, two rollouts always generating."""
    recs = []
    for k in range(10):
        t = 100.0 + 4 * k
        recs.append({"service": "learner", "replica": "0", "state": "sample_wait", "t0": t, "t1": t + 3})
        recs.append(
            {"service": "learner", "replica": "0", "state": "forward_backward", "t0": t + 3, "t1": t + 4}
        )
        for r in ("0", "1"):
            recs.append({"service": "rollout", "replica": r, "state": "generating", "t0": t, "t1": t + 4})
    (run / "timeline.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    (run / "buffer").mkdir()
    stats = [{"time": 100.0 + 5 * k, "size": k % 3, "groups_pending": 1} for k in range(8)]
    (run / "buffer" / "stats.jsonl").write_text("".join(json.dumps(x) + "\n" for x in stats))


def test_timeline_lanes_and_busy_fractions(tmp_path):
    run = make_run(tmp_path / "run", files=1)
    _timeline(run)
    assert show.main([str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "Where the time goes" in page
    assert "learner-0 25% busy" in page and "rollout-0 100% busy" in page
    assert "rollout-bound: the learner waited for data 75% of its time" in page
    tags = parse(page)
    assert sum(1 for t, a in tags if t == "g" and (a.get("id") or "").startswith("lane-")) >= 3
    assert not [t for t, _ in tags if t in ("script", "link", "img", "iframe")]


def test_no_timeline_is_not_a_problem(tmp_path):
    run = make_run(tmp_path / "run", files=1)
    assert show.main([str(run)]) == 0
    assert "Where the time goes" not in (run / "report.html").read_text()
