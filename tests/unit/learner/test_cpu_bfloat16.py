"""A bfloat16 learner on a CPU that emulates bfloat16 says so (teamrl.learner.cpu): measured 23x slower
than float32 on a 2-core AVX2 machine, where it had silently made a 30-minute run's first step last
over 15 minutes."""

from __future__ import annotations

from pathlib import Path

from teamrl.learner.cpu import bfloat16_warning, native_bfloat16

AVX2 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx fma avx2\n"
AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def test_the_cpu_flags_decide(tmp_path: Path) -> None:
    (tmp_path / "avx2").write_text(AVX2)
    (tmp_path / "amx").write_text(AMX)
    assert native_bfloat16(tmp_path / "avx2") is False
    assert "23x slower" in bfloat16_warning(tmp_path / "avx2")
    assert native_bfloat16(tmp_path / "amx") is True and bfloat16_warning(tmp_path / "amx") == ""
    assert native_bfloat16(tmp_path / "missing") is None and bfloat16_warning(tmp_path / "missing") == ""
