"""Shared fixtures of memopt-checkpoint's tests: ``device`` (cpu, and cuda marked ``gpu``) from
:mod:`memopt_core.device_fixture`."""

from __future__ import annotations

from memopt_core.device_fixture import device

__all__ = ["device"]
