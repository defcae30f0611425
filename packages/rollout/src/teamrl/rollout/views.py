"""Output views: what the other agents (and the reward) read of an agent's response.

An agent's ``output`` names its view: a key of :data:`OUTPUT_VIEWS` or ``module:function``
(``str -> str``). ``{out[<node>]}`` in a template and ``ActView.output`` are that view of the act's
full text; e.g. ``math_answer`` gives a verifier the solver's boxed answer, not its reasoning.
"""

from __future__ import annotations

from collections.abc import Callable

from teamrl.rollout.spec import resolve_name


def _addition_candidate(text: str) -> str:
    from teamrl.rewards import addition

    return addition.parse_answer(text)[:3].rjust(3, "0")


def _math_answer(text: str) -> str:
    from teamrl.rewards.math_reward import extract_answer

    found = extract_answer(text)
    return found[0] if found else text.strip()


def _code(text: str) -> str:
    from teamrl.rewards.code_reward import extract_code

    return extract_code(text)


OUTPUT_VIEWS: dict[str, Callable[[str], str]] = {
    "text": lambda t: t,
    "strip": str.strip,
    "addition_candidate": _addition_candidate,
    "math_answer": _math_answer,
    "code": _code,
}


def output_view(name: str) -> Callable[[str], str]:
    """The view named ``name`` (a key of OUTPUT_VIEWS or ``module:function``)."""
    return resolve_name(OUTPUT_VIEWS, name, "output view")
