"""Whether this machine's CPU computes bfloat16 natively.

A bfloat16 matmul needs AVX-512 BF16 or AMX; without them PyTorch emulates it. Measured (bare
PyTorch, one thread, [2048, 576] x [576, 1536] forward and backward): 113 ms in float32 and 2,670 ms in
bfloat16 on a 2-core AVX2 AMD EPYC, 23x slower, where the AVX-512 BF16 / AMX machine of
docs/real-model.md trains SmolLM2 2.6x faster in bfloat16. So a bfloat16 learner on such a CPU is
correct but slow, and says so (the plan before any process starts, the learner in its log).
"""

from __future__ import annotations

from pathlib import Path

NATIVE_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def native_bfloat16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool | None:
    """True where the CPU lists ``avx512_bf16`` or ``amx_bf16``, False where it lists neither, None
    where ``cpuinfo`` cannot be read (not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return bool(NATIVE_FLAGS & set(line.partition(":")[2].split()))
    return None


def bfloat16_warning(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The warning for a bfloat16 learner on this CPU ("" where it is native or unknown)."""
    if native_bfloat16(cpuinfo) is not False:
        return ""
    return (
        "learner dtype bfloat16 on a CPU without native bfloat16 (no avx512_bf16 or amx_bf16 in "
        "/proc/cpuinfo): PyTorch emulates it, measured 23x slower than float32 on such a CPU "
        "(teamrl.learner.cpu); use float32 here unless the learner runs on a GPU"
    )
