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


def verdicts(reward) -> list[tuple[float, str]]:
    return [(r.score, r.reason) for r in (reward(c, {"answer": g}) for c, g, _, _ in CASES)]


def timing(reward, n: int = 1000) -> tuple[float, float]:
    """Seconds for ``n`` calls cycling through CASES: cold (a fresh cache per pass is not possible
    without a fresh reward, so the first pass is the uncached one) and in a 4-thread pool."""
    reward._cache.clear() if hasattr(reward, "_cache") else None
    t0 = time.perf_counter()
    for i in range(n):
        c, g, _, _ = CASES[i % len(CASES)]
        reward(c, {"answer": g})
    serial = time.perf_counter() - t0
    reward._cache.clear()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(
            pool.map(
                lambda i: reward(CASES[i % len(CASES)][0], {"answer": CASES[i % len(CASES)][1]}), range(n)
            )
        )
    return serial, time.perf_counter() - t0


def uncached_ms(reward, repeat: int = 3) -> float:
    """Mean ms per call over CASES with the symbolic cache emptied before every call."""
    t0 = time.perf_counter()
    for _ in range(repeat):
        for c, g, _, _ in CASES:
            reward._cache.clear()
            reward(c, {"answer": g})
    return (time.perf_counter() - t0) * 1000 / (repeat * len(CASES))


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
                results[name] = verdicts(reward)
                times[name] = (*timing(reward), uncached_ms(reward))
            finally:
                reward.close()
    wants = [w for _, _, w, _ in CASES]
    right = {k: sum(v[0] == w for v, w in zip(vs, wants, strict=True)) for k, vs in results.items()}
    lines = [table(results["old"], results["new"]), ""]
    lines.append(f"Right: old {right['old']}/{len(CASES)}, math-verify {right['new']}/{len(CASES)}.")
    for k in ("old", "new"):
        s, p, u = times[k]
        lines.append(
            f"- {'old' if k == 'old' else 'math-verify'}: 1,000 calls over the cases {s:.2f} s in one thread, "
            f"{p:.2f} s in 4 threads (symbolic results cached, as in a GRPO group); {u:.1f} ms a call uncached"
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
