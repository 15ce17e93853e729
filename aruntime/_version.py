"""The package version: the installed distribution's, else the one pyproject.toml next to the sources names."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path


def _version() -> str:
    try:
        return importlib.metadata.version("aruntime")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.exists() else None
        return found.group(1) if found else "0+unknown"


__version__ = _version()
"""This aruntime's version (``aruntime.__version__``)."""
