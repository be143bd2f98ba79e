"""memopt-kernels-cpu: memopt's C++ CPU kernels.

Registers the ``cpu`` backend with memopt-core (entry point group ``memopt.kernels``): one fused
call per group of CPU tensors for SGD/SGDW, Adam/AdamW and Lion over every state format,
bit-exact with core's pure-torch reference, on a persistent thread pool. The compiled module
``memopt_kernels_cpu._core`` holds the kernels of every instruction set of its architecture
(scalar, AVX2, AVX-512; scalar, NEON) and picks the best one this CPU supports at import
(``MEMOPT_CPU_ISA=scalar|avx2|avx512|neon|auto`` forces one). Validated Python wrappers, the
standalone codecs too, live in :mod:`memopt_kernels_cpu.ops`.
"""

from __future__ import annotations

__version__ = "0.1.0"

try:
    from memopt_kernels_cpu import _core
except ModuleNotFoundError as e:
    if e.name != "memopt_kernels_cpu._core":
        raise
    raise ImportError(
        "memopt_kernels_cpu's compiled extension (_core) is missing: this looks like a source "
        "tree on PYTHONPATH, which has no built extension. Install the package instead: "
        "pip install packages/memopt-kernels-cpu"
    ) from e


def _check_core_version(core_version: object, version: str) -> None:
    """ImportError unless the compiled ``_core`` was built from this version of the package."""
    if core_version != version:
        raise ImportError(
            f"memopt_kernels_cpu {version} found a compiled _core built for version "
            f"{core_version!r} (a stale build). Rebuild and reinstall it: "
            "pip install --force-reinstall --no-deps packages/memopt-kernels-cpu"
        )


_check_core_version(getattr(_core, "__version__", None), __version__)

from memopt_kernels_cpu import ops  # noqa: E402
from memopt_kernels_cpu.backend import BACKEND, CpuBackend  # noqa: E402
from memopt_kernels_cpu.ops import (  # noqa: E402
    cpu_features,
    first_touch,
    get_chunk_size,
    get_isa,
    get_num_threads,
    set_chunk_size,
    set_isa,
    set_num_threads,
    supported_isas,
)

__all__ = [
    "BACKEND",
    "CpuBackend",
    "__version__",
    "cpu_features",
    "first_touch",
    "get_chunk_size",
    "get_isa",
    "get_num_threads",
    "ops",
    "set_chunk_size",
    "set_isa",
    "set_num_threads",
    "supported_isas",
]
