"""Where the project's own files are: a leaf module (it imports nothing of the project), so that
any module may ask without importing the one that happens to use the path most."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The project's root: run.py, conf/ and the packages."""
CONF_DIR = ROOT / "conf"
"""The Hydra config tree run.py composes."""
