"""Where MLflow data lives: the store a `tracking.uri` names, made ready and checked without
importing MLflow (which takes about a second).

A `sqlite:///` URI is a database file: its folder is created, and the first client on a new file
migrates its schema under a file lock. An `http(s)://` URI is a tracking server: it is asked for
`/health` and must answer in seconds (MLflow's own client retries for minutes). Anything else is
handed to MLflow as it is.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from common.errors import ConfigError

SQLITE = "sqlite:///"


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///` URI, else None."""
    return Path(uri[len(SQLITE):]) if uri.startswith(SQLITE) else None


def is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def prepare_store(uri: str) -> Path | None:
    """Make the store of `uri` ready to open, or fail with one line: a sqlite file's folder is
    created (the file is MLflow's to create), a server must answer. Returns the sqlite file."""
    db = sqlite_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    elif is_server(uri):
        check_server(uri)
    return db


def check_server(uri: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds on a server that doesn't answer (MLflow's own client retries for minutes)."""
    import urllib.error
    import urllib.request

    from pipelines.redact import redact_text

    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s).close()
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise ConfigError("tracking.uri", redact_text(uri), f"no MLflow server answers there ({reason}); start one "
                          "or use sqlite:///outputs/mlflow.db") from None


@contextlib.contextmanager
def schema_lock(db: Path | None) -> Iterator[None]:
    """Held around the first client call on a sqlite store: that call migrates a new file's
    schema, and concurrent first calls can corrupt it for good (four drivers starting at once on
    a new store did, on this project's CI machine). Nothing to hold for a server."""
    if db is None:
        yield
        return
    with open(db.with_name(db.name + ".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
