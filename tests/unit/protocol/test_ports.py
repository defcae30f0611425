"""Ports a launcher plans (docs/reliability.md R-ports): never handed out twice, never in the kernel's
ephemeral range, a span free as a whole. The CI failure this guards against: the learner's "latest"
port (p + 1 of a pair, checked free but not held) was handed out again as another service's port, and
the learner failed to bind on every restart."""

from __future__ import annotations

import socket

import pytest

from teamrl.protocol import ports


def test_no_port_is_handed_out_twice_and_none_from_the_ephemeral_range() -> None:
    lo, hi = ports.ephemeral_range()
    given: list[int] = []
    for _ in range(100):
        p = ports.free_port(2)
        given += [p, p + 1]
        given.append(ports.free_port())
    assert len(given) == len(set(given)), "a port was handed out twice"
    if lo - ports.LOWEST > 1000:
        assert all(ports.LOWEST <= p < lo for p in given), (lo, hi, sorted(given)[:5], sorted(given)[-5:])


def test_a_span_is_free_as_a_whole_and_a_taken_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        # the random draw first lands on a span containing the held port, then elsewhere
        draws = iter([taken - 1, taken, 20000, 20002, 20004, 20006])
        monkeypatch.setattr(ports._rng, "randrange", lambda a, b: next(draws))
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (65000, 65535))
        p = ports.free_port(2)
    assert taken not in (p, p + 1)
    for q in (p, p + 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", q))


def test_span_must_be_positive() -> None:
    with pytest.raises(ValueError, match="span"):
        ports.free_port(0)
