"""The math matcher on tricky equivalences: the hand-written LaTeX-to-sympy matcher (from git history)
against math-verify (the current ``teamrl.rewards.math_reward``), and the time of 1,000 calls.

    .venv/bin/python tests/bench/math_matching.py --old aae5115 --write docs/math-matching.md

``CASES`` is also checked by tests/unit/rewards/test_math_equivalences.py (the "want" column).
The old matcher runs from ``git show <commit>:packages/rewards/src/teamrl/rewards/math_reward.py``
with its worker started from that same file, so both columns come from real runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODULE = "packages/rewards/src/teamrl/rewards/math_reward.py"

# (completion, gold, want score, what it tests)
CASES: list[tuple[str, str, float, str]] = [
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, "fraction = decimal"),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0, "\\dfrac"),
    ("\\boxed{\\tfrac{2}{4}}", "\\frac{1}{2}", 1.0, "unreduced fraction"),
    ("\\boxed{3/4}", "\\frac{3}{4}", 1.0, "a/b vs \\frac"),
    ("\\boxed{\\frac{1}{3}}", "0.333", 0.0, "rounded decimal is not 1/3"),
    ("\\boxed{0.3333333}", "\\frac{1}{3}", 1.0, "decimal to 6 places"),
    ("The answer is $\\boxed{42}$.", "42", 1.0, "\\boxed inside $...$"),
    ("\\boxed{\\boxed{7}}", "7", 1.0, "nested \\boxed"),
    ("\\boxed{10 \\text{ cm}}", "10", 1.0, "unit in \\text"),
    ("\\boxed{5\\text{ dollars}}", "5", 1.0, "unit word"),
    ("\\boxed{90^\\circ}", "90", 1.0, "degrees"),
    ("#### 1,000", "1000", 1.0, "thousands separator"),
    ("\\boxed{1{,}000}", "1000", 1.0, "LaTeX thousands {,}"),
    ("\\boxed{1,000,000}", "10^6", 1.0, "separators vs power"),
    ("\\boxed{50\\%}", "0.5", 1.0, "percent vs fraction"),
    ("\\boxed{50\\%}", "50", 1.0, "percent vs number"),
    ("\\boxed{12.5\\%}", "\\frac{1}{8}", 1.0, "percent vs \\frac"),
    ("\\boxed{-3}", "-3", 1.0, "negative"),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0, "negative fraction"),
    ("\\boxed{\\frac{-1}{2}}", "-\\frac{1}{2}", 1.0, "sign inside the fraction"),
    ("\\boxed{3}", "-3", 0.0, "sign matters"),
    ("\\boxed{0.25}", "\\frac{1}{4}", 1.0, "decimal vs \\frac"),
    ("\\boxed{2.50}", "2.5", 1.0, "trailing zero"),
    ("The answer is 5.", "5", 1.0, "integer with a trailing period"),
    ("\\boxed{5.}", "5", 1.0, "trailing period in \\boxed"),
    ("\\boxed{x = 3}", "3", 1.0, "x = in front"),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0, "surd simplification"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0, "\\sqrt3 without braces"),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", 1.0, "\\pi"),
    ("\\boxed{x^2-1}", "(x-1)(x+1)", 1.0, "expanded vs factored"),
    ("\\boxed{x^2+1}", "(x-1)(x+1)", 0.0, "different polynomial"),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0, "pair, spacing"),
    ("\\boxed{(\\frac{1}{2}, 2)}", "(0.5, 4/2)", 1.0, "pair of numbers"),
    ("\\boxed{[1, 3)}", "[1,3)", 1.0, "interval"),
    ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", 1.0, "set order"),
    ("\\boxed{1, 2}", "2, 1", 1.0, "answer list order"),
    ("\\boxed{\\infty}", "\\infty", 1.0, "infinity"),
    ("\\boxed{2 \\times 10^3}", "2000", 1.0, "\\times 10^n"),
    ("\\boxed{e^{i\\pi}}", "-1", 1.0, "Euler"),
    ("\\boxed{\\text{(B)}}", "B", 1.0, "multiple-choice letter"),
    ("no answer here", "3", 0.0, "nothing to extract"),
]


def load_old(commit: str, tmp: Path):
    """The matcher as of ``commit``, with its sympy worker started from that same source."""
    src = subprocess.run(
        ["git", "show", f"{commit}:{MODULE}"], capture_output=True, text=True, check=True
    ).stdout
    path = tmp / "old_math_reward.py"
    path.write_text(src.replace('"-m", "teamrl.rewards.math_reward"', f'"{path}"'))
    spec = importlib.util.spec_from_file_location("old_math_reward", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def verdicts(reward) -> tuple[list[tuple[float, str]], float]:
    """Each case's (score, reason) on first sight, and the mean ms of the calls that reached the
    symbolic stage (the worker started beforehand, nothing about the cases cached yet)."""
    reward("\\boxed{y+1}", {"answer": "1+y"})  # starts the worker
    out, symbolic = [], []
    for c, g, _, _ in CASES:
        t0 = time.perf_counter()
        r = reward(c, {"answer": g})
        dt = time.perf_counter() - t0
        out.append((r.score, r.reason))
        if r.details.get("match") not in ("string", "numeric") and r.reason != "no_answer":
            symbolic.append(dt)
    return out, 1000 * sum(symbolic) / max(1, len(symbolic))


def timing(reward, n: int = 1000) -> tuple[float, float, float]:
    """Seconds for ``n`` calls cycling through CASES: with the reward's cache of verdicts emptied
    before every call, with that cache (a GRPO group repeats its answers), and from a 4-thread pool."""

    def call(i: int) -> None:
        c, g, _, _ = CASES[i % len(CASES)]
        reward(c, {"answer": g})

    t0 = time.perf_counter()
    for i in range(n):
        reward._cache.clear()
        call(i)
    uncached = time.perf_counter() - t0
    reward._cache.clear()
    t0 = time.perf_counter()
    for i in range(n):
        call(i)
    cached = time.perf_counter() - t0
    reward._cache.clear()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(call, range(n)))
    return uncached, cached, time.perf_counter() - t0


def table(old: list[tuple[float, str]], new: list[tuple[float, str]]) -> str:
    def cell(v: tuple[float, str], want: float) -> str:
        mark = "ok" if v[0] == want else "**wrong**"
        return f"{v[0]:.0f} {mark}" + ("" if v[1] in ("ok", "wrong_answer", "no_answer") else f" ({v[1]})")

    rows = ["| completion | gold | case | want | old | math-verify |", "|---|---|---|---|---|---|"]
    for (c, g, want, what), o, n in zip(CASES, old, new, strict=True):
        esc = lambda s: "`" + s.replace("|", "\\|") + "`"  # noqa: E731
        rows.append(f"| {esc(c)} | {esc(g)} | {what} | {want:.0f} | {cell(o, want)} | {cell(n, want)} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="aae5115", help="commit holding the hand-written matcher")
    ap.add_argument("--write", help="write the markdown table here")
    args = ap.parse_args()
    from teamrl.rewards.math_reward import MathReward

    with tempfile.TemporaryDirectory() as tmp:
        old_mod = load_old(args.old, Path(tmp))
        results, times = {}, {}
        for name, cls in (("old", old_mod.MathReward), ("new", MathReward)):
            reward = cls(timeout_s=3.0)
            try:
                results[name], first_ms = verdicts(reward)
                times[name] = (first_ms, *timing(reward))
            finally:
                reward.close()
    wants = [w for _, _, w, _ in CASES]
    right = {k: sum(v[0] == w for v, w in zip(vs, wants, strict=True)) for k, vs in results.items()}
    lines = [table(results["old"], results["new"]), ""]
    lines.append(f"Right: old {right['old']}/{len(CASES)}, math-verify {right['new']}/{len(CASES)}.")
    load = os.getloadavg()[0]
    lines.append(f"\nTimings ({os.cpu_count()} CPUs, load average {load:.1f} while measuring):\n")
    for k in ("old", "new"):
        first_ms, uncached, cached, threads = times[k]
        lines.append(
            f"- {'old' if k == 'old' else 'math-verify'}: {first_ms:.1f} ms a symbolic verdict on first "
            f"sight; 1,000 calls over the cases {uncached:.2f} s with the reward's cache of verdicts "
            f"emptied before each call, {cached:.2f} s with it, {threads:.2f} s from 4 threads"
        )
    out = "\n".join(lines)
    print(out)
    if args.write:
        doc = Path(args.write)
        text = doc.read_text() if doc.exists() else ""
        begin, end = "<!-- table: begin -->", "<!-- table: end -->"
        if begin in text:
            text = text[: text.index(begin) + len(begin)] + "\n" + out + "\n" + text[text.index(end) :]
            doc.write_text(text)
        else:
            doc.write_text(f"{begin}\n{out}\n{end}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
