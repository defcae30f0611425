"""``teamrl show RUN``: one self-contained HTML report of a run folder.

Multi-agent runs are hard to debug from numbers alone, so next to the reward curves the report
draws sampled episodes as the graphs they are: one node per agent step (lane = agent, column =
turn), an edge from every parent the step read, and beside the graph each step's message, tool
calls, reward/credit and the policy version it was sampled with. The best and worst episodes of
the most recent policy versions sit side by side.

Design decisions:

* One HTML file with inline CSS and SVG drawn here, no JavaScript, fonts, CDN or network: it opens
  anywhere, can be mailed, and survives the run folder being copied off a cluster. Clicking a node
  jumps to its step card (plain ``href`` anchors; CSS ``:target`` highlights it).
* Everything read from the run folder is foreign (trajectory text is model output, i.e. untrusted):
  every string goes through ``html.escape`` before it reaches the page, ids in the page are
  generated here, never taken from the data.
* A folder that is partly readable still gives a report of what is there; each problem is listed
  at the top of the report and on stderr. Exit code 0 means every file that exists was read in
  full; 2 means the folder is not a run folder or something in it was malformed (the report is
  still written when anything was readable). A torn last line of a JSONL file (the writer was
  mid-line) is expected while a run is live and is only noted.

Inputs (see ``teamrl.cli.run``): ``config.json`` or ``config.toml``; ``metrics.jsonl`` (one object
per learner step: ``step``, ``time``, ``version``, ``reward_mean``, ``reward/<agent>``,
``grad_norm/<agent>``, ...); ``eval.jsonl`` (held-out evaluations); ``samples/step-NNNNNN.arrow``
(each the bytes of ``teamrl.protocol.encode_trajectories``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from teamrl.cli.show_charts import agent_colors, busy_summary, charts, series, timeline_chart
from teamrl.cli.show_graphs import episode_text, episodes
from teamrl.cli.show_run import Run, esc, finite, fmt_num, load_run, pick_best_worst

__all__ = ["build_parser", "load_run", "pick_best_worst", "render", "main"]

EXIT_OK = 0
EXIT_PROBLEM = 2


def build_parser(prog: str = "teamrl show") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Write a self-contained HTML report of a run folder: reward and per-agent curves, "
        "the held-out eval curve, and sampled episodes drawn as graphs (agents as nodes, dependency "
        "edges, each agent's message, tool calls, reward/credit and policy version), with the best "
        "and worst episodes of the most recent policy versions side by side. No network is used; the "
        "page has no scripts.",
        epilog="Exit codes: 0 report written and every file read in full; 2 the folder is not a run "
        "folder or a file in it is malformed (each problem is printed; the report is still written "
        "with whatever was readable).",
    )
    p.add_argument(
        "run", metavar="RUN", help="run folder (config.json|toml, metrics.jsonl, eval.jsonl, samples/)"
    )
    p.add_argument("--out", metavar="FILE", help="output HTML file (default: RUN/report.html)")
    p.add_argument(
        "--episodes", type=int, default=3, metavar="K", help="best and worst episodes shown (default 3 each)"
    )
    p.add_argument(
        "--recent-versions",
        type=int,
        default=3,
        metavar="N",
        help="'recent' = episodes sampled with one of the N newest policy versions (default 3)",
    )
    p.add_argument(
        "--sample-files",
        type=int,
        default=20,
        metavar="N",
        help="read the N newest samples/*.arrow files, plus a few spread over the run (default 20)",
    )
    p.add_argument("--title", help="page title (default: the run folder's name)")
    p.add_argument(
        "--print",
        type=int,
        default=0,
        metavar="N",
        dest="print_episodes",
        help="also print the N newest sampled episodes as text: who said what to whom, rewards, versions",
    )
    return p


# ---------------------------------------------------------------------------------------------
# the page

CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0;color:#222;background:#f6f7f9}
header{background:#20252d;color:#eee;padding:14px 22px}header h1{margin:0;font-size:20px}
header .sum{color:#bbb;margin-top:4px}main{padding:8px 22px 40px}h2{font-size:17px;margin:22px 0 8px}
.problems{background:#fff1f0;border:1px solid #e8a09a;padding:8px 14px;border-radius:6px}
.notes{background:#fffbe6;border:1px solid #e5d48a;padding:8px 14px;border-radius:6px}
.problems li,.notes li{margin:2px 0}.note{color:#555;margin:4px 0 10px}
.charts{display:flex;flex-wrap:wrap;gap:12px}.chart{background:#fff;border:1px solid #dde;border-radius:6px;margin:0;padding:6px 8px}
.chart figcaption{font-weight:600;margin-bottom:2px}.chart.empty p{color:#999;width:540px;margin:8px 0}
.small .chart svg{width:360px;height:auto}.small .chart.empty p{width:340px}
.chart svg{width:560px;height:auto}.chart.wide svg{width:1150px;max-width:100%}
.more summary{cursor:pointer;margin:14px 0 8px;font-weight:600}
.pairs{display:flex;flex-direction:column;gap:14px}.pair{display:grid;grid-template-columns:1fr 1fr;gap:14px;align-items:start}
.episode{background:#fff;border:1px solid #dde;border-radius:6px;padding:8px 10px;min-width:0}
.eh{font-size:14px}.em{font-size:12px;color:#555;overflow-wrap:anywhere}.tag{background:#20252d;color:#fff;border-radius:4px;padding:0 6px;font-size:12px}
.gw{margin:6px 0}.graph{max-width:100%;height:auto}.graph .node rect{stroke-width:2.5}.graph .node:hover rect{stroke-width:4}
.graph .nt{font-size:12px;font-weight:600;fill:#111}.graph .ns{font-size:11px;fill:#333}.graph .nm{font-size:10px;fill:#555;font-family:monospace}
.graph .tb{fill:#20252d}.graph .tt{font-size:9px;fill:#fff}.graph .edge{fill:none;stroke:#555;stroke-width:1.4}.graph .turn{font-size:11px;fill:#777}.graph .lane{font-size:11px;font-weight:600}
.steps summary{cursor:pointer;color:#333;font-size:12px}.step{border-left:4px solid #999;padding:4px 8px;margin:6px 0;background:#fafbfc}
.step:target{background:#fff6cc}.sh{font-size:12px}.facts{color:#555}.role{color:#777}
pre{white-space:pre-wrap;overflow-wrap:anywhere;margin:3px 0;font:12px/1.35 ui-monospace,Menlo,Consolas,"DejaVu Sans Mono",monospace}
.msg{background:#fff;border:1px solid #e6e8ec;padding:4px 6px;max-height:220px;overflow:auto}.cut{font-size:11px;color:#a33}
.tool{font-size:12px;border:1px dashed #bbc;padding:3px 6px;margin-top:4px}.tool pre{background:#f3f4f8}.res{color:#777}
.spread{display:flex;flex-wrap:wrap;gap:12px}.spread .episode{max-width:100%}.none{color:#777}
.cfg pre{background:#fff;border:1px solid #dde;padding:8px;max-height:360px;overflow:auto}
"""


def _summary(run: Run) -> str:
    m = run.metrics
    bits = []
    steps = [v for r in m if (v := finite(r.get("step"))) is not None]
    if steps:
        bits.append(f"{len(m)} learner steps (last step {fmt_num(max(steps))})")
    vers = [v for r in m if (v := finite(r.get("version"))) is not None]
    if vers:
        bits.append(f"policy version {fmt_num(max(vers))}")
    times = [v for r in m if (v := finite(r.get("time"))) is not None]
    if times:
        bits.append(f"{max(times):.0f} s wall time")
    _, ys = series(m, "reward_mean")
    if ys:
        k = max(1, min(10, len(ys) // 5))
        bits.append(
            f"train reward {fmt_num(sum(ys[:k]) / k)} → {fmt_num(sum(ys[-k:]) / k)} (mean of first/last {k})"
        )
    _, ey = series(run.evals, "reward_mean")
    if ey:
        bits.append(f"held-out reward {fmt_num(ey[0])} → {fmt_num(ey[-1])}, best {fmt_num(max(ey))}")
    bits.append(f"{len(run.samples)} sampled episodes")
    bits += busy_summary(run)
    return " · ".join(esc(b) for b in bits)


def render(run: Run, k: int = 3, recent: int = 3, title: str | None = None) -> str:
    title = title or run.path.resolve().name or str(run.path)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">",
        f"<title>teamrl · {esc(title)}</title><style>{CSS}</style></head><body>",
        f'<header><h1>teamrl run: {esc(title)}</h1><div class="sum">{_summary(run)}</div></header><main>',
    ]
    if run.problems:
        items = "".join(f"<li>{esc(p)}</li>" for p in run.problems)
        parts.append(f'<div class="problems"><b>Problems reading the run folder</b><ul>{items}</ul></div>')
    if run.notes:
        items = "".join(f"<li>{esc(p)}</li>" for p in run.notes)
        parts.append(f'<div class="notes"><b>Notes</b><ul>{items}</ul></div>')
    parts.append("<h2>Curves</h2>")
    colors = agent_colors(run)
    parts.append(charts(run, colors))
    if run.timeline:
        parts.append("<h2>Where the time goes</h2>")
        parts.append(
            '<p class="note">One lane per service: a bar per state interval (timeline.jsonl); grey and '
            "light bars are waiting on another service. Busy: the share of a lane's time (start-up "
            "excluded) not spent waiting. Below: the buffer's queue depth.</p>"
        )
        parts.append(timeline_chart(run))
    parts.append(episodes(run, k, recent, colors))
    if run.config_text:
        parts.append(
            f'<details class="cfg"><summary><h2 style="display:inline">Config ({esc(run.config_name)})</h2></summary>'
            f"<pre>{esc(run.config_text)}</pre></details>"
        )
    parts.append("</main></body></html>\n")
    return "".join(parts)


def main(argv: list[str] | None = None, prog: str = "teamrl show") -> int:
    args = build_parser(prog).parse_args(argv)
    run_dir = Path(args.run)
    if not run_dir.is_dir():
        what = "is a file, not a folder" if run_dir.exists() else "does not exist"
        print(f"teamrl show: run folder {run_dir} {what}", file=sys.stderr)
        return EXIT_PROBLEM
    if args.episodes < 0 or args.recent_versions < 1 or args.sample_files < 1:
        print(
            "teamrl show: --episodes must be >= 0, --recent-versions and --sample-files >= 1", file=sys.stderr
        )
        return EXIT_PROBLEM
    run = load_run(run_dir, args.sample_files)
    for p in run.problems:
        print(f"teamrl show: problem: {p}", file=sys.stderr)
    for n in run.notes:
        print(f"teamrl show: note: {n}", file=sys.stderr)
    if not run.readable:
        print(
            f"teamrl show: {run_dir} holds nothing readable (expected config.json|toml, metrics.jsonl, "
            "eval.jsonl or samples/step-NNNNNN.arrow); no report written",
            file=sys.stderr,
        )
        return EXIT_PROBLEM
    if args.print_episodes > 0:
        newest = sorted(run.samples, key=lambda x: (x.version, x.traj.episode_id))[-args.print_episodes :]
        for smp in newest:
            print(episode_text(smp.traj) + "\n")
    out = Path(args.out) if args.out else run_dir / "report.html"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # errors="replace": lone surrogates from JSON escapes cannot be encoded; they become "?"
        out.write_text(
            render(run, args.episodes, args.recent_versions, args.title), encoding="utf-8", errors="replace"
        )
    except OSError as e:
        print(f"teamrl show: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return EXIT_PROBLEM
    print(out)
    return EXIT_PROBLEM if run.problems else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
