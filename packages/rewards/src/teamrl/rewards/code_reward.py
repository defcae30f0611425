"""Code reward: run the candidate program and its unit tests in the sandbox; score the pass rate.

Task formats (the test sources come from the operator's data set and are trusted; the completion
is not):

* ``"tests"``: a list of assert statements (each string is one test), or one Python source. A
  source is split with ``ast`` into its top-level statements: each top-level ``assert`` is one
  test, the other statements (imports, helpers) are setup run in order; a source without
  top-level asserts is tested through its ``def test_*()`` functions, one test each, or else
  through ``check(candidate)``. Optional ``"entry_point"``: the function the candidate must define,
  bound to the name ``candidate`` before the tests.
* HumanEval: ``"test"`` (a source defining ``check(candidate)``) and ``"entry_point"``; the run is
  ``check(<entry_point>)``, score 1 or 0. When the task also has ``"prompt"`` and the completion
  does not define the entry point itself, the completion is taken as the prompt's continuation.

Score: passed tests / tests (partial credit survives a later crash or timeout: only the tests that
reported a pass count). ``details``: ``pass_rate``, ``all_passed``, ``passed``, ``total``,
``failures`` (first few), ``wall_s``, ``sandbox`` (``"namespace"``: the bubblewrap sandbox;
``"process"``: the fallback without file-system, PID or network namespaces, see ``sandbox.py``). A fenced Markdown code block in the completion is used in
place of the completion when present (``extract_code``).

Reasons: ``ok``, ``tests_failed``, ``syntax_error``, ``runtime_error``, ``exited_early``
(``sys.exit``/``os._exit`` before the tests finished), ``timeout``, ``output_limit``,
``memory_limit``, ``recursion_limit``, ``file_size_limit``, ``cpu_limit``, ``network_blocked``,
``process_blocked``, ``missing_entry_point``, ``test_setup_error``, ``crashed`` (killed by a
signal), ``sandbox_failed`` (the harness did not start).
"""

from __future__ import annotations

import ast
import errno
import re
import signal
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from teamrl.rewards.base import ActView, EpisodeRewards, RewardResult, team_outcome
from teamrl.rewards.errors import TaskFormatError
from teamrl.rewards.sandbox import Limits, SandboxOutcome, Step, run_python

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def extract_code(completion: str, entry_point: str | None = None) -> str:
    """The fenced code block to run: the last one defining ``entry_point`` (or any function), else the last."""
    blocks = [b for b in _FENCE.findall(completion) if b.strip()]
    if not blocks:
        return completion
    wanted = (
        re.compile(rf"def\s+{re.escape(entry_point)}\s*\(") if entry_point else re.compile(r"def\s+\w+\s*\(")
    )
    defining = [b for b in blocks if wanted.search(b)]
    return (defining or blocks)[-1]


def _entry_point(task: Mapping[str, Any]) -> str | None:
    ep = task.get("entry_point")
    if ep is None:
        return None
    if not isinstance(ep, str) or not _IDENT.fullmatch(ep):
        raise TaskFormatError(f"code reward: 'entry_point' should be a Python identifier, got {ep!r}")
    return ep


def _split_source(source: str, entry_point: str | None) -> list[Step]:
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise TaskFormatError(f"code reward: task tests do not parse: {exc}") from exc
    steps: list[Step] = []
    setup: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assert):
            if setup:
                steps.append(Step("setup", "\n".join(setup)))
                setup = []
            steps.append(Step("test", ast.unparse(node)))
        else:
            setup.append(ast.unparse(node))
    if setup:
        steps.append(Step("setup", "\n".join(setup)))
    if any(s.kind == "test" for s in steps):
        return steps
    test_funcs = [
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        and n.name.startswith("test")
        and not n.args.args
    ]
    steps += [Step("test", f"{name}()") for name in test_funcs]
    has_check = any(isinstance(n, ast.FunctionDef) and n.name == "check" for n in tree.body)
    if not test_funcs and has_check and entry_point:
        steps.append(Step("test", f"check({entry_point})"))
    if not any(s.kind == "test" for s in steps):
        raise TaskFormatError(
            "code reward: task tests have no top-level assert, no test_*() function and no check()"
        )
    return steps


def build_steps(task: Mapping[str, Any]) -> list[Step]:
    """The sandbox steps for a task (raises ``TaskFormatError`` naming what is missing)."""
    entry_point = _entry_point(task)
    entry = [Step("entry", f"candidate = {entry_point}")] if entry_point else []
    if "tests" in task:
        tests = task["tests"]
        if isinstance(tests, str):
            return entry + _split_source(tests, entry_point)
        if isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests):
            for t in tests:
                try:
                    ast.parse(t)
                except SyntaxError as exc:
                    raise TaskFormatError(f"code reward: test {t!r} does not parse: {exc}") from exc
            return entry + [Step("test", t) for t in tests]
        raise TaskFormatError(
            f"code reward: 'tests' should be a source string or a non-empty list of strings, got {tests!r}"[
                :300
            ]
        )
    if "test" in task:
        if not isinstance(task["test"], str) or entry_point is None:
            raise TaskFormatError(
                "code reward: HumanEval form needs a 'test' source string and an 'entry_point'"
            )
        try:
            ast.parse(task["test"])
        except SyntaxError as exc:
            raise TaskFormatError(f"code reward: task 'test' does not parse: {exc}") from exc
        return [*entry, Step("setup", task["test"]), Step("test", f"check({entry_point})")]
    raise TaskFormatError(f"code reward: task record has neither 'tests' nor 'test' (fields: {sorted(task)})")


def _error_reason(event: Mapping[str, Any]) -> str:
    etype = event.get("etype", "")
    if etype in ("SyntaxError", "IndentationError", "TabError"):
        return "syntax_error"
    if etype == "MemoryError":
        return "memory_limit"
    if etype == "RecursionError":
        return "recursion_limit"
    if event.get("blocked"):
        return "network_blocked" if str(event.get("msg", "")).startswith("network") else "process_blocked"
    if event.get("errno") == errno.EFBIG:
        return "file_size_limit"
    return "runtime_error"


def _death_reason(outcome: SandboxOutcome) -> str:
    rc = outcome.returncode
    if rc is None or rc >= 0:
        return "exited_early"
    sig = -rc
    if sig == signal.SIGXCPU:
        return "cpu_limit"
    if sig == signal.SIGXFSZ:
        return "file_size_limit"
    return "crashed"


def score_outcome(outcome: SandboxOutcome, steps: list[Step]) -> RewardResult:
    """Turn the sandbox's report into a score and one reason (see the module docstring)."""
    total = sum(s.kind == "test" for s in steps)
    # One report per step index: a forked copy of the harness (possible in the process sandbox)
    # reporting the same steps again must not count twice.
    first: dict[Any, dict[str, Any]] = {}
    for e in outcome.events:
        if e["event"] == "step":
            first.setdefault(e.get("index"), e)
    step_events = list(first.values())
    passed = sum(1 for e in step_events if e.get("kind") == "test" and e.get("passed"))
    failures = [
        {k: e.get(k) for k in ("index", "kind", "etype", "msg")} for e in step_events if not e.get("passed")
    ][:5]
    details: dict[str, Any] = {
        "pass_rate": passed / total if total else 0.0,
        "all_passed": total > 0 and passed == total,
        "passed": passed,
        "total": total,
        "failures": failures,
        "wall_s": round(outcome.wall_s, 3),
        "sandbox": outcome.sandbox,
    }
    started = outcome.find("started")
    cand_error = outcome.find("candidate_error")
    if cand_error is not None:
        details["error"] = {k: cand_error.get(k) for k in ("etype", "msg")}
        reason = _error_reason(cand_error)
    elif outcome.find("candidate_exit") is not None:
        reason = "exited_early"
    elif outcome.timed_out:
        reason = "timeout"
    elif outcome.output_limited:
        reason = "output_limit"
    elif started is None:
        reason = "sandbox_failed"
        details["stderr"] = outcome.stderr[-500:]
    elif outcome.find("done") is None:
        reason = _death_reason(outcome)
    else:
        broken = next((e for e in step_events if e.get("kind") != "test" and not e.get("passed")), None)
        if broken is not None:
            missing = broken.get("kind") == "entry" and broken.get("etype") == "NameError"
            reason = "missing_entry_point" if missing else "test_setup_error"
        else:
            reason = "ok" if passed == total else "tests_failed"
    score = details["pass_rate"]
    return RewardResult(float(score), reason, details)


class CodeReward:
    """Pass rate of the task's unit tests on the completion's program, run in the sandbox.

    ``timeout_s`` is the wall-clock limit for the whole run (candidate + all tests), ``memory_mb``
    its address space. ``isolation``: ``"auto"`` (the namespace sandbox where it runs, else the
    process sandbox with a logged warning), ``"namespace"`` (required) or ``"process"``. The other
    keywords are ``sandbox.Limits`` fields.
    """

    name = "code"

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        output_bytes: int = 64_000,
        file_size_mb: int = 16,
        site_packages: bool = False,
        extract: bool = True,
        isolation: Literal["auto", "namespace", "process"] = "auto",
    ) -> None:
        self.limits = Limits(
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            output_bytes=output_bytes,
            file_size_mb=file_size_mb,
            site_packages=site_packages,
            isolation=isolation,
        )
        self.extract = extract

    def __call__(self, completion: str, task: Mapping[str, Any]) -> RewardResult:
        steps = build_steps(task)
        entry_point = _entry_point(task)
        code = extract_code(completion, entry_point) if self.extract else completion
        prompt = task.get("prompt")
        if (
            isinstance(prompt, str)
            and entry_point
            and not re.search(rf"def\s+{re.escape(entry_point)}\s*\(", code)
        ):
            code = prompt + code
        return score_outcome(run_python(code, steps, self.limits), steps)

    def episode(self, task: Mapping[str, Any], acts: Sequence[ActView]) -> EpisodeRewards:
        return team_outcome(self, task, acts)
