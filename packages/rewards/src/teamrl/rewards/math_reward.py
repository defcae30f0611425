"""Math answer checking: extract the final answer, then compare by string, number, then math-verify.

Pipeline (each stage only runs when the one before could not decide):

1. **Extraction** from the completion: the last ``\\boxed{...}`` (nested braces balanced), else the
   last ``Answer:`` / ``answer is`` line, else the last ``#### ...`` line (GSM8K), else the last
   number in the text. A gold ``"answer"`` containing ``\\boxed`` or ``####`` is extracted the same
   way, so a GSM8K solution string can be the gold as is.
2. **String** equality after light LaTeX clean-up (``$``, ``\\left``, spacing commands, ``\\text{}``,
   ``\\dfrac``, degrees, a leading ``x =``, a trailing full stop).
3. **Numeric** equivalence, exact with ``fractions.Fraction``: integers, decimals, thousands commas
   (``1,234``), ``a/b`` and ``\\frac{a}{b}``, scientific notation with a small exponent, and percent
   (``50%`` equals both ``50`` and ``0.5``). Floats that differ by at most ``rel_tol`` (relative) are
   equal too. This runs in-process, in microseconds: it has no unbounded step (digit counts and
   exponents are capped), and most GSM8K-style answers end here.
4. **Symbolic** equivalence with ``math-verify`` (the checker the field's math rewards use): both
   answers, as written, parsed as LaTeX by ``latex2sympy2_extended`` and compared by its ``verify``
   (sets, intervals, tuples, matrices, units and ``\\text{}``, numeric comparison to 6 places).
   The old hand-written LaTeX-to-sympy translation is gone; docs/math-matching.md compares the two.

Why stage 4 runs in a separate worker process: sympy has no time limit of its own
(``9^{9^{9^{9}}}`` never finishes), and math-verify's timeouts are ``SIGALRM`` alarms, which can only
be armed on a process's main thread: called from any other thread ``parse`` raises ValueError
unless its timeout is off (``None``), and then nothing bounds it. The worker (``python -I -m
teamrl.rewards.math_reward``, its own session, an address-space rlimit) runs math-verify on its main
thread with the alarms on (whole seconds below ``timeout_s``), and the reward still kills it with
``SIGKILL`` to its process group when an answer misses the wall-clock ``timeout_s`` (what an alarm
cannot interrupt); the next call starts a fresh one. The caller's side uses no signal, so any thread
may compute rewards. The worker is long-lived otherwise (importing sympy and the grammar costs about
a second). Only LaTeX is parsed: math-verify's plain-expression mode goes through sympy's
``parse_expr``, which evaluates what it parses.

Reasons: ``ok``, ``no_answer`` (nothing could be extracted), ``unmarked`` (only a last number, with
``last_number=False``), ``wrong_answer``, ``timeout`` (math-verify's alarm, or the worker was killed),
``unparsable`` (the answer is not LaTeX math-verify reads), ``too_complex`` (the worker ran out of
memory or recursion depth).

Call sequence::

    math = MathReward(timeout_s=3.0)
    math("... so the answer is \\boxed{\\frac{1}{2}}", {"answer": "0.5"}).score   # 1.0
    math.close()     # or let it be collected; kills the worker
"""

from __future__ import annotations

import functools
import json
import math as _pymath
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from teamrl.rewards.base import ActView, EpisodeRewards, RewardResult, require, team_outcome
from teamrl.rewards.errors import SandboxUnavailable

# --------------------------------------------------------------------------------------------- extraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\b\s*")
_ANSWER_LINE = re.compile(r"(?i)\banswer\s*(?:is|:)\s*:?[ \t]*([^\n]+)")
_HASHES = re.compile(r"####[ \t]*([^\n]+)")
_NUMBER_IN_TEXT = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[ \t]*/[ \t]*\d+)?%?")


def _braced(text: str, open_at: int) -> tuple[str, int] | None:
    """The content of the brace group opening at ``text[open_at] == "{"`` and the index after it."""
    depth = 0
    for i in range(open_at, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i], i + 1
    return None  # unbalanced (a truncated completion)


def _last_boxed(text: str) -> str | None:
    found = None
    for m in _BOXED.finditer(text):
        at = m.end()
        if at < len(text) and text[at] == "{":
            group = _braced(text, at)
            if group is not None:
                found = group[0]
        elif at < len(text):  # ``\boxed 5``: one token
            token = re.match(r"[^\s$]+", text[at:])
            if token:
                found = token.group(0)
    return found


def _first_math(line: str) -> str:
    """The answer part of an answer line: its first ``$...$`` span, else the text up to a sentence end."""
    span = re.search(r"\$([^$]+)\$", line)
    if span:
        return span.group(1).strip()
    end = re.search(r"\.(?:\s|$)", line)
    return (line[: end.start()] if end else line).strip()


def extract_answer(text: str) -> tuple[str, str] | None:
    """``(answer, method)`` with method in boxed / answer_line / hashes / last_number, or None."""
    boxed = _last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip(), "boxed"
    for method, pattern in (("answer_line", _ANSWER_LINE), ("hashes", _HASHES)):
        last = None
        for last in pattern.finditer(text):  # noqa: B007 - only the last match is wanted
            pass
        if last is not None and _first_math(last.group(1)):
            return _first_math(last.group(1)), method
    numbers = _NUMBER_IN_TEXT.findall(text)
    if numbers:
        return numbers[-1], "last_number"
    return None


# ---------------------------------------------------------------------------------------- normalisation

_DROP = (
    r"\left",
    r"\right",
    r"\!",
    r"\,",
    r"\;",
    r"\:",
    r"\displaystyle",
    r"\$",
    "$",
    "^\\circ",
    "^{\\circ}",
    r"\circ",
)
_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_LEADING_VAR = re.compile(r"^[A-Za-z]\w*\s*=\s*(?=\S)")


def normalize_math(answer: str) -> str:
    """Light, meaning-preserving clean-up of a LaTeX-ish answer string."""
    s = answer.strip()
    s = _TEXT_CMD.sub(r"\1", s)
    for token in _DROP:
        s = s.replace(token, "")
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac").replace(r"\%", "%")
    s = s.replace("\\ ", " ")
    s = " ".join(s.split())
    s = _LEADING_VAR.sub("", s)
    s = s.rstrip(".").strip()
    return s


# --------------------------------------------------------------------------------------------- numbers

_MAX_DIGITS = 400
_DECIMAL = re.compile(r"([+-])?(\d{1,3}(?:,\d{3})+|\d*)(?:\.(\d+))?(?:[eE]([+-]?\d{1,3}))?")
_FRAC = re.compile(r"([+-])?\\frac\{([^{}]+)\}\{([^{}]+)\}")


def _decimal(s: str) -> Fraction | None:
    m = _DECIMAL.fullmatch(s)
    if m is None or not (m.group(2) or m.group(3)) or len(s) > _MAX_DIGITS:
        return None
    sign, whole, frac, exp = m.groups()
    whole = whole.replace(",", "") or "0"
    value = Fraction(int(whole + (frac or "")), 10 ** len(frac or ""))
    if exp:
        value *= Fraction(10) ** int(exp)
    return -value if sign == "-" else value


def to_number(answer: str) -> tuple[Fraction, bool] | None:
    """``(value, is_percent)`` for a purely numeric answer, else None. Never slow: sizes are capped."""
    s = answer.replace(" ", "")
    percent = s.endswith("%")
    if percent:
        s = s[:-1]
    value = _decimal(s)
    if value is None:
        m = _FRAC.fullmatch(s)
        parts = (m.group(2), m.group(3)) if m else tuple(s.split("/")) if s.count("/") == 1 else None
        if parts is None:
            return None
        num, den = _decimal(parts[0]), _decimal(parts[1])
        if num is None or den is None or den == 0:
            return None
        value = num / den
        if m and m.group(1) == "-":
            value = -value
    return value, percent


def numbers_equal(a: tuple[Fraction, bool], b: tuple[Fraction, bool], rel_tol: float) -> bool:
    """Exact or within ``rel_tol``; a percent side also matches as its value divided by 100."""

    def readings(x: tuple[Fraction, bool]) -> list[Fraction]:
        return [x[0], x[0] / 100] if x[1] else [x[0]]

    for u in readings(a):
        for v in readings(b):
            if u == v:
                return True
            scale = max(abs(u), abs(v))
            if scale and abs(u - v) <= Fraction(rel_tol) * scale:
                return True
    return False


# ---------------------------------------------------------------------------- symbolic (worker side)


def _expressions(parsed: list[Any]) -> bool:
    """Whether math-verify's parse produced a sympy object (else it only kept the answer as a string)."""
    import sympy
    from sympy.matrices import MatrixBase

    return any(isinstance(x, sympy.Basic | MatrixBase) for x in parsed)


@functools.lru_cache(maxsize=2048)
def _parsed(answer: str, soft: int) -> tuple[Any, ...]:
    """math-verify's reading of one answer, remembered (parsing is most of a verdict's time, and a GRPO
    group's completions share one gold). A timeout raises, so it is never remembered."""
    from math_verify import LatexExtractionConfig, parse

    return tuple(parse(f"${answer}$", [LatexExtractionConfig()], parsing_timeout=soft, raise_on_error=True))


def symbolic_equal(pred: str, gold: str, timeout_s: float) -> tuple[bool, str]:
    """Worker side: ``(equal, reason)`` by math-verify, reason compared / unparsable / timeout.

    Both answers are read as LaTeX only (``LatexExtractionConfig``): its ``ExprExtractionConfig`` would
    hand plain text to sympy's ``parse_expr``, which evaluates what it parses. math-verify's own
    timeouts are ``SIGALRM`` alarms in whole seconds: they work here because the worker runs this on
    its main thread (in a thread they cannot be armed); the parent's kill at ``timeout_s`` stays the
    bound for what an alarm cannot interrupt."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    soft = max(1, int(timeout_s))
    try:
        p, g = list(_parsed(pred, soft)), list(_parsed(gold, soft))
        if not (_expressions(p) and _expressions(g)):
            return False, "unparsable"
        return bool(verify(g, p, timeout_seconds=soft, raise_on_error=True)), "compared"
    except TimeoutException:
        return False, "timeout"
    except (MemoryError, RecursionError):
        raise
    except Exception:
        return False, "unparsable"


def _worker_main(argv: list[str]) -> int:
    """Worker loop: one JSON request per stdin line -> one JSON reply per stdout line."""
    import resource

    memory_mb = int(argv[0]) if argv else 0
    if memory_mb > 0:
        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # imports sympy's parts, the LaTeX grammar and simplify before "ready": the first answer's time
    # limit is then the answer's own
    symbolic_equal("\\frac{x^2-1}{2}", "\\frac{(x-1)(x+1)}{2}", 30.0)
    _parsed.cache_clear()

    out = sys.stdout.buffer

    def reply(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj).encode() + b"\n")
        out.flush()

    reply({"ready": True})
    for line in sys.stdin.buffer:
        req = json.loads(line)
        try:
            equal, reason = symbolic_equal(req["a"], req["b"], float(req["timeout_s"]))
        except (MemoryError, RecursionError):
            reply({"equal": False, "reason": "too_complex"})
            return 3  # memory may be fragmented or held: let the parent start a fresh worker
        reply({"equal": equal, "reason": reason})
    return 0


# ---------------------------------------------------------------------------- symbolic (parent side)


def _kill_group(proc: subprocess.Popen) -> None:
    # Only while the leader is unreaped: its pid (= the group id) cannot have been reused then.
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass


class SympyWorker:
    """A killable math-verify process. ``compare(pred, gold, timeout_s)`` -> ``(equal, reason)``.

    Reason "timeout" after math-verify's alarm or a kill. Thread-safe (one request at a time): no
    signal is used on the caller's side, so rewards may be computed in any thread. After ``fork()``
    the child starts its own worker.
    ``stats`` counts starts, timeouts and crashes (what this fault boundary caught).
    """

    def __init__(self, memory_mb: int = 1024, startup_timeout_s: float = 60.0) -> None:
        self.memory_mb = memory_mb
        self.startup_timeout_s = startup_timeout_s
        self.stats = {"starts": 0, "timeouts": 0, "crashes": 0}
        self._proc: subprocess.Popen | None = None
        self._owner = 0
        self._buf = b""
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None

    def _start(self) -> None:
        cmd = [sys.executable, "-I", "-m", "teamrl.rewards.math_reward", str(self.memory_mb)]
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
                cwd="/",
            )
        except OSError as exc:
            raise SandboxUnavailable(f"cannot start the sympy worker {cmd}: {exc}") from exc
        self._proc, self._owner, self._buf = proc, os.getpid(), b""
        self.stats["starts"] += 1
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _kill_group, proc)
        hello = self._read_reply(time.monotonic() + self.startup_timeout_s)
        if not (isinstance(hello, dict) and hello.get("ready")):
            self._stop()
            raise SandboxUnavailable(
                f"the sympy worker did not start within {self.startup_timeout_s:.0f} s ({cmd}); is sympy installed?"
            )

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # kills and reaps the group once
            self._finalizer = None
        self._proc = None

    def _read_reply(self, deadline: float) -> Any:
        """One JSON line from the worker, or None on timeout / EOF / garbage."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            poller = select.poll()  # not select(): a big parent process may hold fds above 1024
            poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
            if not poller.poll(max(1, int(left * 1000))):
                return None
            chunk = os.read(fd, 65536)
            if not chunk or len(self._buf) > 1 << 20:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return None

    def compare(self, a: str, b: str, timeout_s: float) -> tuple[bool, str]:
        with self._lock:
            if self._proc is None or self._owner != os.getpid() or self._proc.poll() is not None:
                self._proc = None
                self._start()
            assert self._proc is not None and self._proc.stdin is not None
            request = json.dumps({"a": a, "b": b, "timeout_s": timeout_s}).encode() + b"\n"
            try:
                self._proc.stdin.write(request)
                self._proc.stdin.flush()
            except OSError:
                self.stats["crashes"] += 1
                self._stop()
                return False, "too_complex"
            answer = self._read_reply(time.monotonic() + timeout_s)
            if not isinstance(answer, dict):
                timed_out = self._proc.poll() is None
                self.stats["timeouts" if timed_out else "crashes"] += 1
                self._stop()
                return False, "timeout" if timed_out else "too_complex"
            if answer.get("reason") == "too_complex":
                self.stats["crashes"] += 1
                self._stop()
            elif answer.get("reason") == "timeout":  # math-verify's own alarm: the worker lives on
                self.stats["timeouts"] += 1
            return bool(answer.get("equal")), str(answer.get("reason", "unparsable"))

    def close(self) -> None:
        with self._lock:
            self._stop()


# ------------------------------------------------------------------------------------------- the reward


def _gold_answer(value: str | int | float) -> str:
    if isinstance(value, float):
        if not _pymath.isfinite(value):
            return str(value)
        return repr(value)
    text = str(value)
    if "\\boxed" in text or "\\fbox" in text or "####" in text:
        found = extract_answer(text)
        if found is not None:
            return found[0]
    return text


def _as_written(answer: str) -> str:
    """What math-verify reads: the answer as written (it normalises LaTeX itself, ``\\text{}`` units
    included), less ``$`` delimiters and a sentence's full stop."""
    return answer.strip().strip("$").strip().rstrip(".").strip()


class MathReward:
    """1.0 if the completion's final answer equals the task's ``"answer"``, else 0.0 with a reason.

    ``timeout_s`` bounds the symbolic check of one answer (wall clock; the worker is killed past it),
    ``memory_mb`` its address space; ``symbolic=False`` stops after the numeric stage;
    ``max_chars`` keeps only the completion's tail (where final answers are);
    ``last_number=False`` takes only a marked answer (``\\boxed{}``, an ``Answer:`` line, ``####``): a
    completion whose answer would be its last number alone scores 0 with reason ``unmarked`` (the
    fallback also rewards noise that happens to end in the right number).
    Results of symbolic checks are cached (``cache_size`` pairs): a GRPO group repeats answers.
    """

    name = "math"

    def __init__(
        self,
        timeout_s: float = 3.0,
        memory_mb: int = 1024,
        rel_tol: float = 1e-6,
        symbolic: bool = True,
        max_chars: int = 20_000,
        cache_size: int = 4096,
        last_number: bool = True,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"MathReward timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.rel_tol = float(rel_tol)
        self.symbolic = symbolic
        self.max_chars = max_chars
        self.cache_size = cache_size
        self.last_number = last_number
        self.worker = SympyWorker(memory_mb=memory_mb)
        self._cache: dict[tuple[str, str], tuple[bool, str]] = {}
        self._cache_lock = threading.Lock()

    def _symbolic(self, pred: str, gold: str) -> tuple[bool, str]:
        key = (pred, gold)
        with self._cache_lock:
            if key in self._cache:
                return self._cache[key]
        verdict = self.worker.compare(pred, gold, self.timeout_s)
        if verdict[1] != "timeout":  # a timeout may be load; do not remember it
            with self._cache_lock:
                if len(self._cache) >= self.cache_size:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[key] = verdict
        return verdict

    def __call__(self, completion: str, task: Mapping[str, Any]) -> RewardResult:
        gold_raw = require(task, "answer", (str, int, float), self.name)
        gold_text = _gold_answer(gold_raw)
        gold = normalize_math(gold_text)
        found = extract_answer(completion[-self.max_chars :])
        if found is None:
            return RewardResult(0.0, "no_answer", {"extracted": None, "method": None, "gold": gold})
        pred = normalize_math(found[0])
        details: dict[str, Any] = {"extracted": pred, "method": found[1], "gold": gold}
        if found[1] == "last_number" and not self.last_number:
            return RewardResult(0.0, "unmarked", details)
        if not pred:
            return RewardResult(0.0, "no_answer", details)
        if pred == gold or pred.replace(" ", "") == gold.replace(" ", ""):
            return RewardResult(1.0, "ok", {**details, "match": "string"})
        pred_num, gold_num = to_number(pred), to_number(gold)
        if pred_num is not None and gold_num is not None:
            if numbers_equal(pred_num, gold_num, self.rel_tol):
                return RewardResult(1.0, "ok", {**details, "match": "numeric"})
            return RewardResult(0.0, "wrong_answer", details)
        if not self.symbolic:
            return RewardResult(0.0, "wrong_answer", details)
        equal, reason = self._symbolic(_as_written(found[0]), _as_written(gold_text))
        if equal:
            return RewardResult(1.0, "ok", {**details, "match": "symbolic"})
        return RewardResult(0.0, "wrong_answer" if reason == "compared" else reason, details)

    def episode(self, task: Mapping[str, Any], acts: Sequence[ActView]) -> EpisodeRewards:
        return team_outcome(self, task, acts)

    def close(self) -> None:
        """Kill the math-verify worker (a later call starts a new one)."""
        self.worker.close()


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
