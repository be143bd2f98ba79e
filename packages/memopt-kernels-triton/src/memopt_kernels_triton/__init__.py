"""memopt-kernels-triton: fused Triton GPU kernels for memopt's optimizers.

Registers the ``triton`` backend with memopt-core (entry point group ``memopt.kernels``): one
kernel launch per group of tensors for SGD/SGDW, Adam/AdamW and Lion over every state format,
bit-exact with core's pure-torch reference. Importing this package does not import triton:
:data:`BACKEND` reports itself unavailable, with the reason, where triton or CUDA is missing. The
kernels and their Python wrappers (standalone ECC / q8 codecs too) live in
:mod:`memopt_kernels_triton.ops`, imported on first use.
"""

from __future__ import annotations

from typing import Any

from memopt_kernels_triton.backend import BACKEND, TritonBackend

# not "ops": a star import would import triton, which importing this package never does
__all__ = ["BACKEND", "TritonBackend", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "ops":  # imports triton
        import importlib

        return importlib.import_module("memopt_kernels_triton.ops")
    raise AttributeError(f"module 'memopt_kernels_triton' has no attribute {name!r}")
