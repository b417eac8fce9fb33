"""The test workers' host lock (tests/helpers.py): a block inside `host_to_itself` starts only
once no other worker's test holds the host, and holds theirs back while it runs."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

import tests.helpers as helpers

HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_SH)
print("held", flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


@pytest.fixture
def run_lock(monkeypatch):
    """A run of its own: its lock file, and a fresh descriptor in this process."""
    run = uuid.uuid4().hex
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", run)
    monkeypatch.setattr(helpers, "_HOST_LOCK", None)
    path = Path(tempfile.gettempdir()) / f"scalestudy-tests-{run}.lock"
    yield path
    if helpers._HOST_LOCK is not None:
        os.close(helpers._HOST_LOCK)
    path.unlink(missing_ok=True)


def test_the_host_to_itself_waits_for_the_other_workers_test(run_lock):
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(run_lock)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        inside = threading.Event()

        def timed_block():
            with helpers.host_to_itself():
                inside.set()

        waiter = threading.Thread(target=timed_block, daemon=True)
        waiter.start()
        assert not inside.wait(1.0), "entered while another worker's test held the host"
        other.stdin.close()  # that test ends
        assert inside.wait(30), "never entered once the host was free"
        waiter.join(30)
    finally:
        other.kill()
        other.wait()


def test_inside_the_block_no_other_test_starts(run_lock):
    with helpers.sharing_the_host(), helpers.host_to_itself():
        fd = os.open(run_lock, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        finally:
            os.close(fd)


def test_one_process_takes_no_lock(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)
    monkeypatch.setattr(helpers, "_HOST_LOCK", None)
    with helpers.sharing_the_host(), helpers.host_to_itself():
        assert helpers._host_lock() is None
