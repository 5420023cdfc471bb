"""Benchmarks measure the checkout they live in: importing this module puts its root
first on ``sys.path``, so ``import sparsenn`` (and ``models``) resolve to this tree
whatever the working directory or an editable install elsewhere would give.

Every benchmark script imports it before ``sparsenn``; scripts it starts in fresh
processes run the same file, so they import it too."""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["ROOT"]

ROOT = Path(__file__).resolve().parents[1]
if sys.path[:1] != [str(ROOT)]:
    sys.path.insert(0, str(ROOT))
