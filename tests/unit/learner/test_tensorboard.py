"""TensorBoard event files written with tensorboardX: CRC-32C, record framing, scalars round trip.

The files are also read back with TensorBoard's own reader (``tensorboard``, a dev dependency), so
the check does not rest on our reader agreeing with our writer.
"""

from __future__ import annotations

import math

import pytest

from teamrl.learner.tensorboard import EventWriter, crc32c, read_records, read_scalars


def test_crc32c_known_answers() -> None:
    # RFC 3720 B.4 test vectors for CRC-32C
    assert crc32c(b"") == 0
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(b"\xff" * 32) == 0x62A8AB43


def test_scalars_round_trip_and_file_version_first(tmp_path) -> None:
    w = EventWriter(tmp_path)
    w.scalars(0, {"reward/solver": 0.25, "loss/solver-lora": -1.5, "skip": math.nan})
    w.scalars(7, {"reward/solver": 0.5})
    w.close()
    assert w.path.name.startswith("events.out.tfevents.")
    recs = list(read_records(w.path))
    assert b"brain.Event:2" in recs[0]
    assert read_scalars(w.path) == [
        (0, "reward/solver", 0.25),
        (0, "loss/solver-lora", -1.5),
        (7, "reward/solver", 0.5),
    ]


def test_a_corrupt_record_is_detected(tmp_path) -> None:
    w = EventWriter(tmp_path)
    w.scalars(1, {"x": 1.0})
    w.close()
    data = bytearray(w.path.read_bytes())
    data[-6] ^= 0xFF  # inside the last record's payload
    w.path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        list(read_records(w.path))


def test_tensorboard_reads_our_file(tmp_path) -> None:
    from tensorboard.backend.event_processing import event_accumulator as ea

    w = EventWriter(tmp_path)
    for step in range(3):
        w.scalars(step, {"reward_mean": 0.1 * step, "loss/solver-lora": -float(step), "skip": math.nan})
    w.close()
    acc = ea.EventAccumulator(str(tmp_path))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["loss/solver-lora", "reward_mean"]  # NaN is not written
    got = [(e.step, round(e.value, 5)) for e in acc.Scalars("reward_mean")]
    assert got == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert [e.value for e in acc.Scalars("loss/solver-lora")] == [0.0, -1.0, -2.0]
    # Both readers see the same scalars, in order.
    theirs = sorted((e.step, tag, e.value) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag))
    assert theirs == sorted((s, t, pytest.approx(v)) for s, t, v in read_scalars(w.path))
