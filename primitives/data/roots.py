"""Where data lives: the embedded default dataset and the shared real measurements."""

from __future__ import annotations

import os
from pathlib import Path

EMBEDDED_DATA_DIR = Path(__file__).resolve().parent / "embedded"
SHARED_ENV = "STEPSYNTH_SHARED"


def default_data_dir() -> Path:
    """The embedded synthetic default dataset shipped in the package."""
    return EMBEDDED_DATA_DIR


def shared_data_root() -> Path:
    """``$STEPSYNTH_SHARED`` or ``<repo>/../shared``: where the read-only shared data lives."""
    env = os.environ.get(SHARED_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "shared"
