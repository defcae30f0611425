"""Tools an agent may call in the middle of its response: a sandboxed Python executor and BM25 search.

Call syntax (what a model writes; documented in each agent profile that has tools)::

    <tool name="python">print(2 ** 10)</tool>
    <tool name="search">capital of Veloria</tool>

The executor samples with ``</tool>`` as a stop string, parses the first complete call
(:func:`parse_tool_call`), runs the tool off the event loop, and appends
``<result>...</result>`` to the agent's context before letting it continue, at most
``max_tool_rounds`` times per step. Tool output is untrusted text: it is truncated to
``max_chars`` and never interpreted.

Design decisions:

* **A tool is a callable ``(arguments: str) -> str``** with a ``name``; it never raises for what
  the model wrote (bad code, an empty query): the failure is the result text, as for rewards.
  Only operator errors (an unreadable corpus) raise, at construction.
* **The Python tool reuses ``teamrl.rewards.sandbox``** (rlimits, own process group, no network,
  wall-clock kill); it reports stdout, then the error the harness caught, if any.
* **Latency is a setting of every tool** (``latency_s``, default 0): the seconds a call takes
  before its result comes back, as a web search API or a remote test runner takes (0.3-1 s). The
  executor awaits it on the event loop (``asyncio.sleep``), so other episodes keep generating while
  one waits: no core idles on a sleeping episode (docs/running.md, "Tool and reward latency").
* **BM25 is written here** (Robertson-Sparck Jones idf with the +1 inside the log so it is
  never negative, ``k1=1.5``, ``b=0.75``): a corpus of a few thousand passages needs no index
  library, and the ranking is deterministic (ties broken by document order).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from teamrl.rewards.sandbox import Limits, run_python

TOOL_STOP = "</tool>"
_CALL = re.compile(r"<tool\s+name\s*=\s*\"([A-Za-z_][\w-]*)\"\s*>(.*?)</tool>", re.DOTALL)


@runtime_checkable
class Tool(Protocol):
    """``tool(arguments) -> result text``; never raises for anything the model wrote."""

    name: str
    latency_s: float  # optional (0 when absent): seconds a call waits before its result (docstring)

    def __call__(self, arguments: str) -> str: ...


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str
    end: int  # index in the text just after the closing ``</tool>``


def parse_tool_call(text: str) -> ParsedCall | None:
    """The first complete ``<tool name="...">...</tool>`` in ``text``, or ``None``."""
    m = _CALL.search(text)
    if m is None:
        return None
    return ParsedCall(m.group(1), m.group(2).strip(), m.end())


def format_result(result: str) -> str:
    return f"<result>{result}</result>"


def _truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"...[{len(text) - max_chars} chars cut]"


def _latency(name: str, latency_s: float) -> float:
    if not isinstance(latency_s, int | float) or isinstance(latency_s, bool) or not 0.0 <= latency_s <= 600.0:
        raise ValueError(
            f"tool {name!r}: latency_s must be a number of seconds in [0, 600], got {latency_s!r}"
        )
    return float(latency_s)


class PythonTool:
    """Run the model's code in the sandbox; the result is its stdout plus any error it raised."""

    def __init__(
        self,
        name: str = "python",
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        max_chars: int = 2000,
        latency_s: float = 0.0,
    ) -> None:
        self.name = name
        self.latency_s = _latency(name, latency_s)
        self.limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb, output_bytes=max(max_chars * 4, 1024))
        self.max_chars = max_chars

    def __call__(self, arguments: str) -> str:
        out = run_python(arguments, [], self.limits)
        parts = [out.stdout.rstrip("\n")] if out.stdout.strip() else []
        err = out.find("candidate_error")
        if err is not None:
            parts.append(f"{err.get('etype', 'Error')}: {err.get('msg', '')}".rstrip(": "))
        exited = out.find("candidate_exit")
        if exited is not None:
            parts.append(f"SystemExit: {exited.get('code', '')}")
        if out.timed_out:
            parts.append(f"TimeoutError: killed after {self.limits.timeout_s:g} s")
        elif out.output_limited:
            parts.append("OutputLimit: output cut")
        elif out.find("candidate_ok") is None and err is None and exited is None:
            parts.append(f"the interpreter died (status {out.returncode})")
        return _truncate("\n".join(parts) or "(no output)", self.max_chars)


_WORD = re.compile(r"[a-z0-9]+")
_STOPWORDS = frozenset(
    "a an and are as at be by did do does for from has have in is it its of on or the to was were what "
    "when where which who whom whose why how with".split()
)


def tokenize_words(text: str) -> list[str]:
    """Lower-case alphanumeric words without common English stop words."""
    return [w for w in _WORD.findall(text.lower()) if w not in _STOPWORDS]


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str


class BM25Index:
    """Okapi BM25 over a fixed collection: ``search(query, k) -> [(doc, score)]`` best first."""

    def __init__(self, docs: Sequence[Document], k1: float = 1.5, b: float = 0.75) -> None:
        if not docs:
            raise ValueError("BM25Index needs at least one document")
        self.docs = list(docs)
        self.k1, self.b = k1, b
        self._tf = [Counter(tokenize_words(f"{d.title} {d.text}")) for d in self.docs]
        self._len = [sum(tf.values()) for tf in self._tf]
        self._avg = sum(self._len) / len(self._len) or 1.0
        df: Counter[str] = Counter()
        for tf in self._tf:
            df.update(tf.keys())
        n = len(self.docs)
        self._idf = {w: math.log(1.0 + (n - c + 0.5) / (c + 0.5)) for w, c in df.items()}

    def scores(self, query: str) -> list[float]:
        terms = tokenize_words(query)
        out = []
        for tf, dl in zip(self._tf, self._len, strict=True):
            s = 0.0
            norm = self.k1 * (1.0 - self.b + self.b * dl / self._avg)
            for w in terms:
                f = tf.get(w, 0)
                if f:
                    s += self._idf[w] * f * (self.k1 + 1.0) / (f + norm)
            out.append(s)
        return out

    def search(self, query: str, k: int = 3) -> list[tuple[Document, float]]:
        sc = self.scores(query)
        order = sorted(range(len(sc)), key=lambda i: (-sc[i], i))
        return [(self.docs[i], sc[i]) for i in order[:k] if sc[i] > 0.0]


def read_documents(path: str | Path) -> list[Document]:
    """Documents from JSONL (``{"id", "title", "text"}``; ``contents``/``body`` accepted for text)."""
    path = Path(path)
    docs = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from e
            text = rec.get("text", rec.get("contents", rec.get("body")))
            if not isinstance(text, str):
                raise ValueError(f"{path}:{n}: document has no 'text' string (fields {sorted(rec)})")
            docs.append(Document(str(rec.get("id", n)), str(rec.get("title", "")), text))
    return docs


class SearchTool:
    """BM25 search: the result lists the top ``k`` documents as ``[title] text`` lines."""

    def __init__(
        self,
        index: BM25Index,
        name: str = "search",
        k: int = 3,
        max_chars: int = 1500,
        latency_s: float = 0.0,
    ) -> None:
        self.name = name
        self.latency_s = _latency(name, latency_s)
        self.index = index
        self.k = k
        self.max_chars = max_chars

    def __call__(self, arguments: str) -> str:
        if not tokenize_words(arguments):
            return "(empty query)"
        hits = self.index.search(arguments, self.k)
        if not hits:
            return "(no results)"
        return _truncate("\n".join(f"[{d.title}] {d.text}" for d, _ in hits), self.max_chars)


def build_tool(name: str, spec: Mapping[str, Any], resolve_path: Any = None) -> Tool:
    """A tool from its workflow config table (``kind = "python" | "bm25"`` plus keywords)."""
    kind = spec.get("kind")
    kwargs = {k: v for k, v in spec.items() if k != "kind"}
    if kind == "python":
        return PythonTool(name=name, **kwargs)
    if kind == "bm25":
        corpus = kwargs.pop("corpus")
        path = resolve_path(corpus) if resolve_path else Path(corpus)
        return SearchTool(BM25Index(read_documents(path)), name=name, **kwargs)
    raise ValueError(f"tool {name!r}: unknown kind {kind!r} (known: python, bm25)")


def tool_names(tools: Iterable[Tool]) -> list[str]:
    return [t.name for t in tools]
