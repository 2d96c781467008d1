"""What a sweep cell's numbers depend on besides its config, recorded in each cell's summary (``environment``):
docs/EXPERIMENTS.md, "What is and is not bit-reproducible". A cell re-run with the same config, seed, threads
per cell, library versions and CPU instruction set gives the same numbers; change any of them and float
reductions are summed in another order, so a run follows the same curve only until the first sampled token
differs."""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path

PACKAGES = ("heterorl", "torch", "transformers", "numpy")
# the instruction-set extensions torch's CPU kernels choose between (each changes the order of float sums)
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")


def _cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, list[str]]:
    """The CPU's model name and which of `CPU_FLAGS` it has ("unknown", [] where /proc/cpuinfo is not there)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return platform.processor() or "unknown", []
    fields = dict(line.split(":", 1) for line in text.splitlines()[:40] if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return fields.get("model name", "unknown"), [f for f in CPU_FLAGS if f in flags]


def run_environment(threads_per_cell: int, cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """The facts a cell's bit-exact result depends on: the torch threads it computed with, the package versions,
    Python's, the machine's architecture, the CPU's model and instruction-set extensions."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    model, flags = _cpu(cpuinfo)
    return {"threads_per_cell": threads_per_cell, "packages": versions, "python": platform.python_version(),
            "machine": platform.machine(), "cpu": model, "cpu_flags": flags}
