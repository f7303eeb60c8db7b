"""What a benchmark records of the machine it ran on: the CPU model and the instruction sets that
decide which kernels run (llama.cpp's build flags, oneDNN's run-time dispatch). Imported by the
benchmark scripts beside it (`from machine import cpu_name, cpu_isa`)."""
from __future__ import annotations

# /proc/cpuinfo flags that change a matmul kernel's speed: AVX2/FMA (llama.cpp's portable build),
# AVX-512 and its BF16 / VNNI extensions, AMX tiles (oneDNN's bf16 / int8 on Intel Xeon 4th gen on)
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.split(":", 1)[0].strip() == name)
    except (OSError, StopIteration, IndexError):
        return None


def cpu_name() -> str | None:
    """The CPU model ('model name' of /proc/cpuinfo); None where it cannot be read (not Linux)."""
    return _cpuinfo_field("model name")


def cpu_isa() -> list[str] | None:
    """Which of `ISA_FLAGS` the CPU has, in that order; None where /proc/cpuinfo cannot be read."""
    flags = _cpuinfo_field("flags")
    if flags is None:
        return None
    have = set(flags.split())
    return [f for f in ISA_FLAGS if f in have]


def describe() -> str:
    """One line for a results file: '<model>; ISA avx2, fma, ...' ('unknown CPU' where unreadable)."""
    isa = cpu_isa()
    return f"{cpu_name() or 'unknown CPU'}; ISA {', '.join(isa) if isa else 'unknown'}"
