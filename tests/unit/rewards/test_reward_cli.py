"""``teamrl reward``: JSONL in, one JSON line per record out, malformed lines reported and counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from teamrl.rewards.cli import main

VENV_TEAMRL = Path(sys.executable).parent / "teamrl"


def _write(tmp_path: Path, lines: list[str | bytes]) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


def _out(capsys: pytest.CaptureFixture[str]) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_scores_each_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(
        tmp_path,
        [
            json.dumps({"completion": "The Eiffel Tower", "answers": ["eiffel tower"]}),
            "",
            json.dumps({"completion": "Louvre", "answer": "Eiffel Tower"}),
        ],
    )
    assert main(["qa_em", "--input", str(path)]) == 0
    rows = _out(capsys)
    assert [(r["line"], r["score"], r["reason"]) for r in rows] == [(1, 1.0, "ok"), (3, 0.0, "wrong_answer")]
    assert rows[0]["best_gold"] == "eiffel tower"


def test_malformed_lines_reported_and_run_goes_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(
        tmp_path,
        [
            "{not json",
            "[1, 2]",
            json.dumps({"text": "no completion field", "answer": "x"}),
            json.dumps({"completion": 3, "answer": "x"}),
            json.dumps({"completion": "x"}),  # the reward needs 'answer': TaskFormatError
            b"\xff\xfe",
            json.dumps({"completion": "x", "answer": "x"}),
        ],
    )
    assert main(["qa_f1", "--input", str(path)]) == 1
    rows = _out(capsys)
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert all("error" in r for r in rows[:6])
    assert "completion field 'completion' is missing" in rows[2]["error"]
    assert "neither 'answers' nor 'answer'" in rows[4]["error"]
    assert rows[6]["score"] == 1.0


def test_field_timeout_and_args(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, [json.dumps({"response": "so \\boxed{1/2}", "answer": "0.5"})])
    assert (
        main(
            [
                "math",
                "--input",
                str(path),
                "--field",
                "response",
                "--timeout-s",
                "2",
                "--arg",
                "symbolic=false",
            ]
        )
        == 0
    )
    (row,) = _out(capsys)
    assert (row["score"], row["match"]) == (1.0, "numeric")
    assert (
        main(["length", "--input", str(path), "--field", "response", "--arg", "target=3", "--arg", "limit=6"])
        == 0
    )
    assert _out(capsys)[0]["score"] == -1.0


def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, [json.dumps({"completion": "x", "answer": "x"})])
    for argv in (
        ["nope", "--input", str(path)],
        ["qa_em", "--input", str(path), "--timeout-s", "1"],
        ["qa_em"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    assert main(["qa_em", "--input", str(tmp_path / "missing.jsonl")]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    for name in ("math", "code", "qa_em", "qa_f1", "format", "length"):
        assert name in help_text


def test_teamrl_command_subprocess(tmp_path: Path) -> None:
    path = _write(tmp_path, [json.dumps({"completion": "the answer", "answers": ["Answer"]}), "oops"])
    proc = subprocess.run(
        [str(VENV_TEAMRL), "reward", "qa_em", "--input", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert rows[0] == {"line": 1, "score": 1.0, "reason": "ok", "prediction": "answer", "best_gold": "Answer"}
    assert rows[1]["line"] == 2 and "error" in rows[1]
    assert "1 scored, 1 unreadable" in proc.stderr


def test_reward_modules_import_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "import teamrl.rewards.cli, teamrl.rewards.math_reward, teamrl.rewards.code_reward\n"
        "import teamrl.rewards.credit, teamrl.rewards.qa, teamrl.rewards.shaping, teamrl.rewards.sandbox\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'sympy')\n"
        "         or m.startswith(('teamrl.learner', 'teamrl.rollout'))]\n"
        "print(heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
