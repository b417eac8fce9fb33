"""A stage's peak device memory, and on CPU a per-rank budget that fails a rank as CUDA's
out-of-memory would.

On CUDA the allocator knows: the peak is `torch.cuda.max_memory_reserved` and its out-of-memory
error is the budget. The CPU has no per-device allocator, so `StorageTracker` counts what a device
would hold: the bytes of every live tensor storage on the CPU, each storage once however many
views share it (the accounting of the dry run, `training.dryrun`). It is a dispatch mode:
it sees every op this thread runs and autograd runs for it (forward, backward, the optimizer,
DTensor's local ops, FSDP2's and DDP's buffers, gloo collectives' outputs), and the storage
resizes FSDP2 frees and re-allocates its unsharded parameters with. A storage counts from the
first op that outputs or reads it, so tensors made before the tracker started or without an op
(`torch.tensor`, `torch.from_numpy`, a loaded checkpoint) count from their first use; it stops
counting when the storage is freed.

Not seen: memory a library holds outside tensors (gloo's and the DataLoader's own buffers), and
ops that run on threads of their own.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from training.units import GIB, MIB

BUDGET_KEY = "cluster.device_memory_gib"
"""The setting a budget comes from, named in the error."""


class DeviceOutOfMemory(torch.OutOfMemoryError):
    """A rank went over its device-memory budget. A subclass of torch's out-of-memory error, so
    code that handles CUDA's (a probe that backs off) handles this one the same way."""


class StorageTracker(TorchDispatchMode):
    """Live and peak bytes of this process's CPU tensor storages. With `budget_bytes`, the op whose
    outputs take the live total over it raises DeviceOutOfMemory instead of returning them (they
    are freed, and the peak never holds more than the budget)."""

    def __init__(self, budget_bytes: int | None = None, rank: int = 0, budget_gib: float | None = None):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.rank = rank
        self.budget_gib = budget_bytes / GIB if budget_gib is None and budget_bytes is not None else budget_gib
        """The budget as it was set, for the error message."""
        self.current_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        """id(storage) -> (a weak reference to it whose callback un-counts it, the bytes counted)."""
        self._lock = threading.RLock()
        """A storage may be freed on another thread (a collective's, when its work completes)."""
        self._resize: Callable[..., Any] | None = None
        self._host: dict[int, weakref.ref] = {}
        """Storages made under `host_side`: host memory, never counted."""
        self._on_host = False

    def __enter__(self) -> StorageTracker:
        self._resize = resize = torch.UntypedStorage.resize_

        def tracked_resize(storage: torch.UntypedStorage, size: int) -> Any:
            out = resize(storage, size)
            self._resized(storage)
            return out

        # Storage resizes are not ops a dispatch mode sees.
        torch.UntypedStorage.resize_ = tracked_resize  # type: ignore[method-assign]
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        _ACTIVE.remove(self)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if DTensor in types:
            return NotImplemented  # DTensor runs its local ops, which come back here
        out = func(*args, **(kwargs or {}))
        self._add_all((out, args, kwargs))
        error = self._over_budget()
        if error is not None:
            del out  # the op failed: what it allocated is freed
            raise error
        return out

    def _add_all(self, tree: Any) -> None:
        # By hand: torch's pytree would cost more than the rest of the tracker together.
        if isinstance(tree, torch.Tensor):
            self._add(tree)
        elif isinstance(tree, (list, tuple)):
            for item in tree:
                self._add_all(item)
        elif isinstance(tree, dict):
            for item in tree.values():
                self._add_all(item)

    def _add(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            self._add_all([getattr(t, name) for name in names])
        # Fake tensors (DTensor's sharding propagation runs ops on them) and meta ones hold no memory.
        elif t.is_cpu and not isinstance(t, FakeTensor):
            self._count(t.untyped_storage())

    def _resized(self, storage: torch.UntypedStorage) -> None:
        if storage.device.type == "cpu":
            self._count(storage)
            self._check()

    def _count(self, storage: torch.UntypedStorage) -> None:
        """Count `storage` at its size now: once, however many tensors view it; again by the
        difference when it was resized."""
        key, nbytes = id(storage), storage.nbytes()
        host = self._host.get(key)
        if host is not None and host() is storage:
            return
        if self._on_host:
            self._host[key] = weakref.ref(storage, lambda ref: self._host.pop(key, None))
            return
        known = self._live.get(key)
        if known is not None and known[1] == nbytes:
            return
        with self._lock:
            if known is None:
                self._live[key] = (weakref.ref(storage, lambda ref: self._freed(key, ref)), nbytes)
                self.current_bytes += nbytes
            else:
                self._live[key] = (known[0], nbytes)
                self.current_bytes += nbytes - known[1]
            if self.budget_bytes is None or self.current_bytes <= self.budget_bytes:
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _freed(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            known = self._live.get(key)
            if known is not None and known[0] is ref:
                del self._live[key]
                self.current_bytes -= known[1]

    def _check(self) -> None:
        error = self._over_budget()
        if error is not None:
            raise error

    def _over_budget(self) -> DeviceOutOfMemory | None:
        if self.budget_bytes is None or self.current_bytes <= self.budget_bytes:
            return None
        return DeviceOutOfMemory(
            f"rank {self.rank}: device memory budget exceeded: {_size(self.current_bytes)} in use > "
            f"{_size(self.budget_bytes)} ({BUDGET_KEY}={self.budget_gib:g})")


_ACTIVE: list[StorageTracker] = []


@contextlib.contextmanager
def host_side() -> Iterator[None]:
    """Tensors made in this block are host memory, not the device's: a data set in RAM, as it is
    on a GPU machine (on CPU "device" and host are one memory, but only the device's is budgeted).
    What a step then takes from it onto the device (the batch) is counted again."""
    for tracker in _ACTIVE:
        tracker._on_host = True
    try:
        yield
    finally:
        for tracker in _ACTIVE:
            tracker._on_host = False


def stage_peak_bytes() -> int | None:
    """This process's peak device memory so far in the running stage: the tracker's under a CPU
    budget, CUDA's allocator's; None where nothing measures it."""
    if _ACTIVE:
        return _ACTIVE[-1].peak_bytes
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_reserved()
    return None


def _size(nbytes: int) -> str:
    if nbytes >= GIB / 10:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / MIB:.2f} MiB" if nbytes >= MIB / 10 else f"{nbytes} bytes"


class DeviceMemory:
    """The peak device memory of this process over a `with` block (`peak_bytes`, set when the block
    ends, also when it raised).

    On CUDA: the allocator's `max_memory_reserved`; its out-of-memory error is the budget, so
    `budget_gib` is not applied. On CPU with `budget_gib`: a StorageTracker holds the process to
    it. On CPU without one nothing is tracked and `peak_bytes` stays None: the tracker's Python
    call per op (~10 us) would slow the very steps the stages time (gpt-tiny's by 55-140 %)."""

    def __init__(self, budget_gib: float | None = None, rank: int = 0):
        self.budget_gib, self.rank = budget_gib, rank
        self.peak_bytes: int | None = None
        self._cuda = torch.cuda.is_available()
        self._tracker: StorageTracker | None = None

    def __enter__(self) -> DeviceMemory:
        if self._cuda:
            if torch.cuda.is_initialized():
                torch.cuda.reset_peak_memory_stats()
        elif self.budget_gib is not None:
            self._tracker = StorageTracker(int(self.budget_gib * GIB), self.rank, self.budget_gib).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(*exc)
            self.peak_bytes = self._tracker.peak_bytes
        elif self._cuda:
            # A stage that never touched the device (no CUDA context) holds none of it.
            self.peak_bytes = torch.cuda.max_memory_reserved() if torch.cuda.is_initialized() else 0
