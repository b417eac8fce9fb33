"""Files written whole or not at all: the one atomic write every layer uses."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path | str, data: bytes | str) -> None:
    """Write `data` to a temporary file beside `path` and rename it into place: a reader (another
    rank, a re-run after a crash) sees the old file or the new one, never half of it."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    if isinstance(data, str):
        tmp.write_text(data)
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)
