"""Rules over the packages' sources that no behaviour test can guard in general.

- Every tensor factory call in a package names its device. Without one, the tensor lands on
  ``torch.set_default_device``'s device: under "meta" a C++ kernel is handed address 0, under
  "cuda" a device pointer.
- Every factory whose dtype is the default floating dtype names its dtype: under
  ``torch.set_default_dtype(torch.float64)`` AdamBridge's autotune workload was float64, which
  the float32 plan refused.

The behaviour tests cover today's call sites (``test_default_device.py`` in memopt-core,
memopt-checkpoint and memopt-offload); this scan covers the next one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2] / "packages"

#: torch functions that allocate on the default device unless told otherwise (``*_like`` and
#: ``Tensor.new_*`` take their device from a tensor and are not listed).
FACTORIES = frozenset(
    [
        "tensor",
        "as_tensor",
        "empty",
        "zeros",
        "ones",
        "full",
        "arange",
        "rand",
        "randn",
        "randint",
        "randperm",
        "linspace",
        "logspace",
        "eye",
        "empty_strided",
        "scalar_tensor",
    ]
)


#: those whose result takes the default floating dtype whatever their arguments (``tensor``,
#: ``full`` and ``arange`` infer it from their data)
FLOAT_FACTORIES = frozenset(
    ["empty", "zeros", "ones", "rand", "randn", "linspace", "logspace", "eye", "empty_strided"]
)


def factory_calls_without(
    keyword: str, names: frozenset[str], source: str
) -> list[tuple[int, str]]:
    """(line, name) of each ``torch.<name>(...)`` call in ``source`` with no ``keyword=`` (nor
    ``**kwargs``, which may hold it)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in names
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
            and not any(k.arg == keyword or k.arg is None for k in node.keywords)
        ):
            found.append((node.lineno, f"torch.{node.func.attr}"))
    return found


def test_the_scan_finds_what_it_looks_for() -> None:
    source = (
        "import torch\n"
        "a = torch.zeros(3)\n"
        "b = torch.zeros(3, device='cpu')\n"
        "c = torch.tensor([1.0], dtype=torch.float32)\n"
        "d = torch.zeros_like(a)\n"
        "e = torch.empty(2, **kw)\n"
    )
    assert factory_calls_without("device", FACTORIES, source) == [
        (2, "torch.zeros"),
        (4, "torch.tensor"),
    ]
    assert factory_calls_without("dtype", FLOAT_FACTORIES, source) == [
        (2, "torch.zeros"),
        (3, "torch.zeros"),
    ]


def _sources() -> list[Path]:
    sources = sorted(PACKAGES.glob("*/src/**/*.py"))
    assert len(sources) > 20, f"the packages' sources were not found under {PACKAGES}"
    return sources


@pytest.mark.parametrize(
    ("keyword", "names"),
    [("device", FACTORIES), ("dtype", FLOAT_FACTORIES)],
    ids=["device", "dtype"],
)
def test_every_factory_call_in_the_packages_names_its(keyword, names) -> None:
    missing = [
        f"{path.relative_to(PACKAGES)}:{line}: {name}"
        for path in _sources()
        for line, name in factory_calls_without(keyword, names, path.read_text(encoding="utf-8"))
    ]
    assert not missing, f"factory calls without {keyword}= (pass the tensor's):\n" + "\n".join(
        missing
    )
