#!/usr/bin/env bash
# CI entry point: a fresh 2-core machine, no GPU. Installs nox, then runs the README's test
# command (nox -s tests) after the quick gates (lint, version pins) and the isolated core session.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
python3 -m pip install --quiet --disable-pip-version-check nox
nox -s lint check_versions
nox -s tests
nox -s "isolated(package='memopt-core')"
echo "CI finished in $(( $(date +%s) - start )) s"
