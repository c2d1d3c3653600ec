"""Where qprobe keeps its cache and journals (private to the user)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """``$QPROBE_CACHE`` or ``~/.cache/qprobe``, created with mode 0700."""
    base = Path(os.environ.get("QPROBE_CACHE") or Path.home() / ".cache" / "qprobe")
    # mkdir(parents=True) applies the mode to the leaf only: make the base private first.
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = base.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path
