"""Rules over the packages' sources that no behaviour test can guard in general.

Every tensor factory call in a package names its device. Without one, the tensor lands on
``torch.set_default_device``'s device: under "meta" a C++ kernel is handed address 0, under
"cuda" a device pointer (stop 52's fix; the behaviour tests cover today's call sites, this scan
covers the next one).
"""

from __future__ import annotations

import ast
from pathlib import Path

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


def factory_calls_without_device(source: str) -> list[tuple[int, str]]:
    """(line, name) of each ``torch.<factory>(...)`` call in ``source`` with no ``device=``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in FACTORIES
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
            and not any(k.arg == "device" or k.arg is None for k in node.keywords)
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
    assert factory_calls_without_device(source) == [(2, "torch.zeros"), (4, "torch.tensor")]


def test_every_factory_call_in_the_packages_names_its_device() -> None:
    sources = sorted(PACKAGES.glob("*/src/**/*.py"))
    assert len(sources) > 20, f"the packages' sources were not found under {PACKAGES}"
    missing = [
        f"{path.relative_to(PACKAGES)}:{line}: {name}"
        for path in sources
        for line, name in factory_calls_without_device(path.read_text(encoding="utf-8"))
    ]
    assert not missing, "factory calls without device= (pass the tensor's device):\n" + "\n".join(
        missing
    )
