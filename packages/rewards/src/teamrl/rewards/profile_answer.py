"""The judge's answer in language-space policy improvement (``teamrl.rewards.profiles``): its
format and its parser.

**Answer format** (documented for the judge in the prompt and parsed by
:func:`parse_profile_answer`)::

    <summary>
    what in this agent's behaviour caused the successes and the failures
    </summary>
    <profile>
    the complete revised system prompt
    </profile>

Tags, not JSON: a system prompt is multi-line prose, which models write more reliably without
JSON string escaping. Tags are matched case-insensitively; the last complete ``<profile>`` block
counts (models that draft and then revise put the final one last); ``<summary>`` is optional.

**The judge's answer is foreign input.** It is refused, the old profile kept and
``teamrl_profile_proposals_rejected_total{reason}`` incremented, when: the judge raised
(``judge_error``) or timed out (``judge_timeout``, both in ``teamrl.rewards.profile_learner``); the
answer is not text (``not_text``) or longer than ``max_answer_chars`` (``answer_too_long``); it has
no complete profile block (``unparsable``); the profile is empty (``empty``), longer than
``max_profile_chars`` (``too_long``), contains control characters, lone surrogates or U+FFFD
(``binary``), or is a JSON document rather than prose (``not_prose``), or is the format's
placeholder copied, in any case (``template_echo``); ``ProfileLearner`` also refuses a profile under
``min_length_ratio`` of the one it replaces (``too_short``, off unless set; the learner's
``profile_min_length_ratio`` is 0.3: SmolLM2-135M paraphrased the placeholder,
"The complete updated version of the profile"). Parsing is linear in the answer's length and never decodes
JSON, so deep nesting cannot exhaust the stack. A profile equal to the old one
(whitespace aside) is ``unchanged``: not a rejection, and no new version.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from teamrl.protocol.control import MAX_PROFILE_CHARS
from teamrl.rewards.profiles import ProposalRejected

PREFILL = "<profile>\n"  # how a judge's answer may be begun for it (profile_round.judge_from_engine)
PLACEHOLDER = "the complete revised profile"  # what the format asks for inside <profile>
_TAG = re.compile(r"<(/?)(profile|summary)\s*>", re.IGNORECASE)
_ALLOWED_CONTROLS = frozenset("\n\t\r")


def _last_block(text: str, name: str) -> str | None:
    """Content of the last complete ``<name>...</name>`` block, or None. Linear in ``len(text)``."""
    open_at = None  # end of the latest opening tag not yet closed
    last = None
    for m in _TAG.finditer(text):
        if m.group(2).lower() != name:
            continue
        if m.group(1):
            if open_at is not None:
                last = text[open_at : m.start()]
                open_at = None
        else:
            open_at = m.end()
    return last


def _is_binary(text: str) -> bool:
    for ch in text:
        if ch in _ALLOWED_CONTROLS:
            continue
        if ch == "\ufffd" or unicodedata.category(ch) in ("Cc", "Cs"):
            return True
    return False


def parse_profile_answer(
    answer: Any, max_answer_chars: int = 200_000, max_profile_chars: int = MAX_PROFILE_CHARS
) -> tuple[str, str]:
    """``(profile, summary)`` from a judge answer in the module's format; raises :class:`ProposalRejected`."""
    if not isinstance(answer, str):
        raise ProposalRejected("not_text", f"judge answer is {type(answer).__name__}, not text")
    if len(answer) > max_answer_chars:
        raise ProposalRejected(
            "answer_too_long", f"judge answer has {len(answer)} characters, cap {max_answer_chars}"
        )
    profile = _last_block(answer, "profile")
    if profile is None:
        raise ProposalRejected("unparsable", "no complete <profile>...</profile> block in the judge answer")
    profile = profile.strip()
    if not profile:
        raise ProposalRejected("empty", "the <profile> block is empty")
    if len(profile) > max_profile_chars:
        raise ProposalRejected("too_long", f"profile has {len(profile)} characters, cap {max_profile_chars}")
    if _is_binary(profile):
        raise ProposalRejected("binary", "profile contains control characters, surrogates or U+FFFD")
    if " ".join(profile.lower().rstrip(".").split()) == PLACEHOLDER:
        raise ProposalRejected(
            "template_echo", "the judge copied the format's placeholder instead of a profile"
        )
    if profile[0] in "{[":
        raise ProposalRejected("not_prose", "profile is a JSON document, not a system prompt")
    summary = (_last_block(answer, "summary") or "").strip()[:4000]
    if _is_binary(summary):
        summary = ""
    return profile, summary
