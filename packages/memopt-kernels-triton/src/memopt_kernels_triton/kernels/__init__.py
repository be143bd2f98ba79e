"""The Triton kernels (importing this package imports triton): one kernel family per module."""
