"""teamrl.protocol.timeline: state intervals as Prometheus seconds and as batched JSONL records."""

from __future__ import annotations

import json
import time

from teamrl.protocol.timeline import STATE_SECONDS, Timeline, read_timeline


def _seconds(service: str, state: str) -> float:
    return STATE_SECONDS.labels(service, state)._value.get()


def test_intervals_are_counted_and_written_in_batches(tmp_path) -> None:
    path = tmp_path / "timeline.jsonl"
    tl = Timeline("svc-a", "1", path, flush_every=3, flush_s=3600)
    tl.enter("work")
    time.sleep(0.02)
    with tl.state("export"):  # nested: back to "work" afterwards
        time.sleep(0.01)
    assert not path.exists()  # two records pending: below flush_every
    tl.enter("sample_wait")
    assert len(path.read_text().splitlines()) == 3  # work, export, work: one batch
    tl.close()
    recs = read_timeline(path)
    assert [r["state"] for r in recs] == ["work", "export", "work", "sample_wait"]
    assert all(r["service"] == "svc-a" and r["replica"] == "1" and r["t1"] >= r["t0"] for r in recs)
    assert all(a["t1"] == b["t0"] for a, b in zip(recs, recs[1:], strict=False))  # contiguous
    assert _seconds("svc-a", "work") >= 0.02 and _seconds("svc-a", "export") >= 0.01


def test_without_a_path_only_counts(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TEAMRL_TIMELINE", raising=False)
    tl = Timeline.from_env("svc-b")
    tl.enter("work")
    time.sleep(0.01)
    tl.close()
    assert tl.path is None and _seconds("svc-b", "work") > 0
    monkeypatch.setenv("TEAMRL_TIMELINE", str(tmp_path / "t.jsonl"))
    tl = Timeline.from_env("svc-b", "2")
    tl.enter("work")
    tl.close()
    assert json.loads((tmp_path / "t.jsonl").read_text())["replica"] == "2"


def test_a_torn_last_line_is_skipped(tmp_path) -> None:
    path = tmp_path / "timeline.jsonl"
    path.write_text('{"service":"s","state":"a","t0":1,"t1":2}\n{"service":"s","sta')
    assert len(read_timeline(path)) == 1
