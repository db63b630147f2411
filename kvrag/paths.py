"""Where kvrag keeps its files: one root, `$KVRAG_HOME` or the user cache dir."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

__all__ = ["kvrag_home"]


def kvrag_home() -> Path:
    """The root of converted models, cached digests and the default disk store."""
    root = os.environ.get("KVRAG_HOME")
    path = Path(root) if root else Path(platformdirs.user_cache_dir("kvrag"))
    path.mkdir(parents=True, exist_ok=True)
    return path
