"""Stand-ins for kernel packages in the backend registry: fake ``memopt.kernels`` entry points
(:func:`install`) and a backend that runs core's torch step and records what it was given."""

from __future__ import annotations

import importlib.metadata

from memopt_core import backends
from memopt_core.backends import KERNEL_API, GroupStep
from memopt_core.torch_backend import TorchBackend

__all__ = ["FakeEntryPoint", "OldBackend", "RecordingBackend", "install"]


class FakeEntryPoint:
    def __init__(self, name, obj=None, error=None):
        self.name, self.value, self.group = name, f"fake_{name}:backend", "memopt.kernels"
        self._obj, self._error = obj, error

    def load(self):
        if self._error is not None:
            raise self._error
        return self._obj


class RecordingBackend:
    """A kernel-package stand-in: delegates to the torch backend and records what it was given."""

    KERNEL_API = KERNEL_API

    def __init__(self, name="cpu", rules=("sgd", "adam", "lion"), usable=True):
        self.name, self.rules, self.usable, self.calls = name, rules, usable, []

    def available(self):
        return (True, "ok") if self.usable else (False, "no AVX2 on this CPU")

    def supports(self, rule, spec, device, param_dtype):
        return rule in self.rules and device.type == "cpu"

    def step(self, work: GroupStep):
        self.calls.append(work)
        TorchBackend().step(work)


class OldBackend(RecordingBackend):
    KERNEL_API = 0


def install(monkeypatch, *eps):
    real = importlib.metadata.entry_points

    def fake_entry_points(**kw):
        if kw != {"group": "memopt.kernels"}:  # other libraries (triton, ...) look up theirs
            return real(**kw)
        return list(eps)

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    backends.refresh_backends()
