"""``teamrl reward NAME --input FILE.jsonl``: score a JSONL file offline with a registered reward.

Each input line is a JSON object holding the completion (field ``--field``, default
``completion``) and the task fields the reward reads. Output: one JSON line per record on stdout,
``{"line": n, "score": ..., "reason": ..., ...details}``, where ``n`` is the 1-based line number in
the file. A record that cannot be scored (bad JSON, not an object, no completion, a task field the
reward rejects) prints ``{"line": n, "error": "..."}`` instead and the run goes on; the exit code
is 0 when every non-blank line was readable, else 1 (2 for usage errors). A summary goes to stderr.

Called by ``teamrl.cli.main`` as ``main(argv)`` with the arguments after ``reward``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from typing import Any

from teamrl.rewards.base import REWARDS, get_reward
from teamrl.rewards.errors import RewardError


def _parse_arg(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--arg expects KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw  # a bare string
    return key.strip(), value


def build_parser() -> argparse.ArgumentParser:
    names = sorted(REWARDS)
    p = argparse.ArgumentParser(
        prog="teamrl reward",
        description="Score a JSONL file offline with a reward; one JSON line per record on stdout.",
        epilog="registered rewards: " + ", ".join(names),
    )
    p.add_argument("name", choices=names, metavar="NAME", help="the reward: " + ", ".join(names))
    p.add_argument("--input", required=True, help="JSONL file, one record per line ('-' reads stdin)")
    p.add_argument(
        "--field", default="completion", help="the field holding the completion (default: completion)"
    )
    p.add_argument(
        "--timeout-s", type=float, default=None, help="per-record timeout for rewards that take one"
    )
    p.add_argument(
        "--arg",
        action="append",
        default=[],
        type=_parse_arg,
        metavar="KEY=VALUE",
        help="a keyword argument for the reward's factory (VALUE read as JSON, else a string); repeatable",
    )
    return p


def _score_line(reward: Any, raw: bytes, field: str) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return {"error": f"not UTF-8: {exc}"}
    try:
        record = json.loads(text)
    except ValueError as exc:
        return {"error": f"not JSON: {exc}"}
    if not isinstance(record, dict):
        return {"error": f"expected a JSON object, got {type(record).__name__}"}
    completion = record.get(field)
    if not isinstance(completion, str):
        what = "missing" if field not in record else f"a {type(completion).__name__}, not a string"
        return {"error": f"completion field {field!r} is {what}"}
    try:
        return reward(completion, record).to_json()
    except RewardError as exc:
        return {"error": str(exc)}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    kwargs = dict(args.arg)
    if args.timeout_s is not None:
        params = inspect.signature(REWARDS[args.name]).parameters
        if "timeout_s" not in params:
            parser.error(f"reward {args.name!r} takes no timeout (--timeout-s)")
        kwargs["timeout_s"] = args.timeout_s
    try:
        reward = get_reward(args.name, **kwargs)
    except (TypeError, ValueError) as exc:
        parser.error(f"cannot build reward {args.name!r} with {kwargs}: {exc}")
    try:
        stream = sys.stdin.buffer if args.input == "-" else open(args.input, "rb")
    except OSError as exc:
        print(f"teamrl reward: cannot read {args.input}: {exc}", file=sys.stderr)
        return 2
    scored = bad = 0
    total = 0.0
    out = sys.stdout
    try:
        for n, raw in enumerate(stream, start=1):
            if not raw.strip():
                continue
            result = _score_line(reward, raw, args.field)
            if "error" in result:
                bad += 1
            else:
                scored += 1
                total += float(result["score"])
            out.write(json.dumps({"line": n, **result}, default=str) + "\n")
            out.flush()
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()
        close = getattr(reward, "close", None)
        if callable(close):
            close()
    mean = total / scored if scored else float("nan")
    print(
        f"teamrl reward {args.name}: {scored} scored, {bad} unreadable, mean score {mean:.4f}",
        file=sys.stderr,
    )
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
