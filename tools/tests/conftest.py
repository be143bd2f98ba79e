"""The tools are scripts, not packages: put their folders on sys.path as running them does."""

from __future__ import annotations

import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1]
for folder in ("demo", "bench"):
    path = str(TOOLS / folder)
    if path not in sys.path:
        sys.path.insert(0, path)
