"""Multi-turn search QA: a searcher with a local BM25 tool, then an answerer.

The searcher may issue up to two ``<tool name="search">query</tool>`` calls (each result is
appended and it continues) and ends with notes; the answerer reads the question and the
searcher's whole transcript (queries, results, notes) and answers with a short phrase. The
reward is token F1 (``teamrl.rewards.qa``, SQuAD normalisation) of the answer; the searcher shares
it. Both agents share one adapter (full parameter sharing).

Data: the bundled corpus ``data/search_corpus.jsonl`` (30 short documents about invented places,
people and things, so a model cannot answer from memory) and ``data/search_qa.jsonl`` (questions
with answers in it); any NQ/HotpotQA-style JSONL plus a corpus JSONL of ``{"id", "title", "text"}``
works by pointing ``tasks.path`` and ``tools.search.corpus`` at them.
"""

from __future__ import annotations

from typing import Any

MODEL = "policy"

SEARCHER = (
    "You research questions with a search engine over a document collection. To search, write "
    '<tool name="search">your query</tool> and stop; the top documents come back in '
    "<result></result>. You may search at most twice. Then write the facts that answer the question."
)
ANSWERER = "You answer questions from the notes you are given. Reply with a short phrase only."

SEARCH_QA: dict[str, Any] = {
    "name": "search-qa",
    "description": "searcher (BM25 tool) -> answerer on a bundled corpus (or NQ/HotpotQA JSONL)",
    "models": {MODEL: {"path": ""}},
    "adapters": {"team-lora": {"model": MODEL, "rank": 8}},
    "agents": [
        {
            "id": "searcher",
            "role": "searcher",
            "profile": SEARCHER,
            "model": MODEL,
            "adapter": "team-lora",
            "template": "Question: {task[question]}",
            "sampling": {"max_tokens": 128, "temperature": 1.0, "top_p": 1.0},
            "tools": ["search"],
            "max_tool_rounds": 2,
        },
        {
            "id": "answerer",
            "role": "answerer",
            "profile": ANSWERER,
            "model": MODEL,
            "adapter": "team-lora",
            "template": "Question: {task[question]}\n\nNotes:\n{out[searcher]}",
            "output": "strip",
            "sampling": {"max_tokens": 32, "temperature": 1.0, "top_p": 1.0},
        },
    ],
    "graph": {"kind": "static", "edges": [["searcher", "answerer"]]},
    "tools": {"search": {"kind": "bm25", "corpus": "builtin:search_corpus.jsonl", "k": 3}},
    "reward": {"name": "outcome", "kwargs": {"reward": "qa_f1", "answer_role": "answerer"}},
    "tasks": {"builtin": "search-qa"},
}
