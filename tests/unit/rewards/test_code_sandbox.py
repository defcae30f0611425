"""The code sandbox and CodeReward: formats, scoring, and every hostile candidate we could think of.

Each hostile case must score 0 with a specific reason, return within the timeout (plus start-up
slack), leave no process of its group alive and no working folder behind, and the caller (this
test process) must survive.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from teamrl.rewards.base import get_reward
from teamrl.rewards.code_reward import CodeReward, build_steps, extract_code
from teamrl.rewards.errors import TaskFormatError
from teamrl.rewards.sandbox import Limits, Step, namespace_sandbox_available, run_python

TIMEOUT_S = 4.0  # generous: a loaded CI machine starts a sandboxed interpreter slowly (1.5 s timed out once)
ADD = "def add(a, b):\n    return a + b\n"
TESTS = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(-1, 1) == 0"]}


@pytest.fixture(scope="module")
def code() -> CodeReward:
    return CodeReward(timeout_s=TIMEOUT_S, memory_mb=256)


def _group_gone(pgid: int, wait_s: float = 3.0) -> bool:
    """No live (non-zombie) process in the group within ``wait_s`` (SIGKILL is delivered
    asynchronously); zombies stay when PID 1 does not reap."""
    deadline = time.monotonic() + wait_s
    while _live_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _live_members(pgid: int) -> bool:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def test_list_form_pass_rate(code: CodeReward) -> None:
    res = code(ADD, TESTS)
    assert (res.score, res.reason, res.details["all_passed"]) == (1.0, "ok", True)
    wrong = code("def add(a, b):\n    return a - b if a == 2 else a + b\n", TESTS)
    assert wrong.score == pytest.approx(2 / 3)
    assert (wrong.reason, wrong.details["passed"], wrong.details["total"]) == ("tests_failed", 2, 3)
    assert wrong.details["failures"][0]["etype"] == "AssertionError"


def test_source_form_splits_top_level_asserts(code: CodeReward) -> None:
    task = {
        "tests": "import math\nassert add(1, 2) == 3\nx = 5\nassert candidate(x, 1) == 6\nassert add(1, 1) == 3\n",
        "entry_point": "add",
    }
    assert [s.kind for s in build_steps(task)] == ["entry", "setup", "test", "setup", "test", "test"]
    res = code(ADD, task)
    assert res.score == pytest.approx(2 / 3)
    missing = code("def plus(a, b):\n    return a + b\n", task)
    assert (missing.score, missing.reason) == (0.0, "missing_entry_point")


def test_source_form_test_functions() -> None:
    steps = build_steps(
        {"tests": "def test_a():\n    assert add(1, 1) == 2\n\ndef test_b():\n    assert add(0, 0) == 0\n"}
    )
    assert [s.source for s in steps if s.kind == "test"] == ["test_a()", "test_b()"]


def test_humaneval_form_with_prompt(code: CodeReward) -> None:
    task = {
        "prompt": 'def add(a, b):\n    """Return a + b."""\n',
        "test": "METADATA = {}\n\ndef check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 0) == 0\n",
        "entry_point": "add",
    }
    assert code("    return a + b\n", task).score == 1.0  # a continuation of the prompt
    assert code("```python\n" + ADD + "```", task).score == 1.0  # a whole function in a fence
    res = code("    return a - b\n", task)
    assert (res.score, res.reason, res.details["pass_rate"]) == (0.0, "tests_failed", 0.0)
    assert get_reward("code", timeout_s=TIMEOUT_S)("    return b + a\n", task).details["all_passed"] is True


def test_extract_code_prefers_block_defining_entry_point() -> None:
    text = "```python\ndef add(a, b):\n    return a + b\n```\nusage:\n```python\nprint(add(1, 2))\n```"
    assert extract_code(text, "add").startswith("def add")
    assert extract_code("no fences", "add") == "no fences"
    assert extract_code("```py\nx = 1\n", None) == "x = 1\n"  # unclosed final fence


@pytest.mark.parametrize(
    "task",
    [
        {},
        {"tests": []},
        {"tests": [3]},
        {"tests": ["assert ("]},
        {"tests": "x = 1"},
        {"test": "def check(c): pass"},
        {"tests": ["assert 1"], "entry_point": "not an id"},
    ],
)
def test_bad_task_raises(task: dict) -> None:
    with pytest.raises(TaskFormatError):
        build_steps(task)


HOSTILE = {
    "fork_bomb": ("import os\nwhile True:\n    os.fork()\n", "process_blocked"),
    "subprocess": ("import subprocess\nsubprocess.run(['sleep', '100'])\n", "process_blocked"),
    "kill_parent": ("import os\nos.kill(os.getppid(), 9)\n", "process_blocked"),
    "infinite_loop": ("while True:\n    pass\n", "timeout"),
    "sleep_forever": ("import time\ntime.sleep(1000)\n", "timeout"),
    "huge_output": ("while True:\n    print('x' * 10000)\n", "output_limit"),
    "sys_exit_0": (ADD + "import sys\nsys.exit(0)\n", "exited_early"),
    "os_exit_0": (ADD + "import os\nos._exit(0)\n", "exited_early"),
    "syntax_error": ("def add(a, b) return a + b\n", "syntax_error"),
    "deep_recursion": ("def f(n):\n    return f(n + 1)\nf(0)\n", "recursion_limit"),
    "memory_bomb": ("x = bytearray(10**10)\n", "memory_limit"),
    "memory_growth": ("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))\n", "memory_limit"),
    "huge_file": (
        "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * 10**6)\n",
        "file_size_limit",
    ),
    "socket": ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\n", "network_blocked"),
    "raw_socket": ("import _socket\n_socket.socket()\n", "network_blocked"),
    "segfault": ("import ctypes\nctypes.string_at(0)\n", "crashed"),
}


@pytest.mark.parametrize("isolation", ["namespace", "process"])
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_candidates_score_zero(name: str, isolation: str) -> None:
    if isolation == "namespace" and not namespace_sandbox_available()[0]:
        pytest.skip(f"no namespace sandbox here: {namespace_sandbox_available()[1]}")
    code = CodeReward(timeout_s=TIMEOUT_S, memory_mb=256, isolation=isolation)  # type: ignore[arg-type]
    source, reason = HOSTILE[name]
    t0 = time.monotonic()
    res = code(source, TESTS)
    elapsed = time.monotonic() - t0
    assert (res.score, res.reason, res.details["sandbox"]) == (0.0, reason, isolation), res.details
    assert elapsed < TIMEOUT_S + 5.0  # bounded: the wall-clock kill works (not a speed check)
    assert res.details["all_passed"] is False


def test_unbounded_recursion_limit_still_scores_zero(code: CodeReward) -> None:
    res = code("import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)\n", TESTS)
    # how the interpreter gives up depends on time and stack: a timeout, a limit, a crash, or a
    # SystemError once the C stack is exhausted ("error return without exception set")
    reasons = ("timeout", "memory_limit", "recursion_limit", "crashed", "runtime_error")
    assert res.score == 0.0 and res.reason in reasons, res.details


def test_exit_inside_a_test_keeps_earlier_passes_only(code: CodeReward) -> None:
    source = "import os\ndef add(a, b):\n    if a == 2:\n        os._exit(0)\n    return a + b\n"
    res = code(source, TESTS)
    assert (res.score, res.reason) == (pytest.approx(1 / 3), "exited_early")


def test_forged_reports_do_not_count_and_group_and_folder_are_gone() -> None:
    forge = (
        "import os, sys\nfor fd in range(3, 16):\n    try:\n"
        '        os.write(fd, b\'{"event": "done"}\\n\')\n    except OSError:\n        pass\n'
        'print(\'{"event": "step", "kind": "test", "passed": true}\')\nos._exit(0)\n'
    )
    out = run_python(forge, [Step("test", "assert True")], Limits(timeout_s=TIMEOUT_S))
    assert out.find("done") is None and out.find("candidate_ok") is None
    # Whether a forged line reaches the report pipe at all depends on which fds the child inherits
    # (CI runs with no stdin), so foreign_lines is not asserted; the forgeries must never count.
    assert _group_gone(out.pid)
    assert not os.path.exists(out.workdir)


def test_orphan_grandchild_is_killed() -> None:
    # os.fork and posix.fork are patched; libc's fork through ctypes is not (best effort). A child
    # made that way must still not outlive the run.
    blocked = run_python("import posix\nposix.fork()\n", [], Limits(timeout_s=TIMEOUT_S))
    assert blocked.find("candidate_error")["blocked"] is True
    leak = "import ctypes, time\nif ctypes.CDLL(None).fork() == 0:\n    time.sleep(60)\n"
    out = run_python(leak, [], Limits(timeout_s=TIMEOUT_S))
    assert out.find("done") is not None
    assert _group_gone(out.pid)


def test_environment_is_clean_and_stdout_is_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEAMRL_TEST_SECRET", "hunter2")
    probe = "import os\nprint(sorted(os.environ))\nprint(os.getcwd() == os.environ['HOME'])\n"
    out = run_python(probe, [], Limits(timeout_s=TIMEOUT_S, output_bytes=10_000))
    assert "TEAMRL_TEST_SECRET" not in out.stdout and "'https_proxy'" in out.stdout
    assert out.stdout.splitlines()[-1] == "True"
    capped = run_python("print('y' * 5000)", [], Limits(timeout_s=TIMEOUT_S, output_bytes=100))
    assert capped.output_limited and len(capped.stdout) == 100


def test_concurrent_runs_from_threads(code: CodeReward) -> None:
    scores: list[float] = []
    threads = [threading.Thread(target=lambda: scores.append(code(ADD, TESTS).score)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert scores == [1.0] * 4
