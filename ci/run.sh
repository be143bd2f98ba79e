#!/usr/bin/env bash
# CI entry point: a fresh 2-core machine, no GPU. Installs nox, then runs the README's test
# command (nox -s tests) after the quick gates (lint, version pins, mypy), then the isolated core
# session, the sdists and wheels built from them (a file missing from an sdist fails its wheel
# build) and the C++ kernels cross-compiled for aarch64, so the NEON set, which no host here
# runs, keeps compiling.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
python3 -m pip install --quiet --disable-pip-version-check nox
nox -s lint check_versions typecheck
nox -s tests
nox -s "isolated(package='memopt-core')"
nox -s build cross_compile
echo "CI finished in $(( $(date +%s) - start )) s"
