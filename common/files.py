"""Files written whole or not at all: the one atomic write every layer uses."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_file(path: Path | str) -> Iterator[Path]:
    """A temporary path beside `path` to write (streamed, however long); renamed into place when
    the block ends without error, removed when it raises: a reader (another rank, a re-run after a
    crash) sees the old file or the new one, never half of it."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: Path | str, data: bytes | str) -> None:
    """Write `data` to `path` atomically (atomic_file)."""
    with atomic_file(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)
