"""Fail when a package's pin on a sibling does not admit the sibling's local version.

Each package under ``packages/`` has its own static version; siblings pin each other with ranges
(awkward's check_cpp_constraint idea). A release that bumps one package without widening the pins
of its dependents would install a combination nobody tested: this check catches it before that.
Also checks that each package's ``__version__`` equals its ``pyproject.toml`` version.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the packages support Python 3.10, where nox brings tomli (tomllib's origin)
    import tomli as tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    projects = {}
    for pyproject in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        projects[pyproject.parent] = tomllib.loads(pyproject.read_text())["project"]
    versions = {canonicalize_name(p["name"]): Version(p["version"]) for p in projects.values()}

    problems = []
    for folder, project in projects.items():
        name = project["name"]
        pins = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            pins.extend(extra)
        for pin in pins:
            req = Requirement(pin)
            local = versions.get(canonicalize_name(req.name))
            if local is None:
                continue
            if not req.specifier:
                problems.append(f"{name}: pin on sibling {req.name} has no version range")
            elif not req.specifier.contains(local, prereleases=True):
                problems.append(f"{name}: requires {pin!r}, but the local {req.name} is {local}")
            else:
                print(f"ok  {name} -> {req.name}{req.specifier} admits {local}")
        init = next((folder / "src").glob("*/__init__.py"), None)
        if init is not None:
            match = re.search(r'^__version__ = "([^"]+)"', init.read_text(), re.MULTILINE)
            # the same string, not an equal version: memopt-kernels-cpu compares its extension's
            # version with __version__ as strings at import ("0.1" there would fail "0.1.0")
            if not match or match.group(1) != project["version"]:
                found = match.group(1) if match else "none"
                problems.append(
                    f"{name}: __version__ in {init.relative_to(ROOT)} is {found}, "
                    f"pyproject.toml says {project['version']}"
                )
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
