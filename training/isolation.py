"""One unit of distributed work (a trial of a layout) on process groups of its own, with an
out-of-memory error on any rank agreed by all.

An out-of-memory error strikes one rank at a time, often mid-step while its peers wait in one of
the step's collectives. `run_isolated` runs the work with its collectives on groups made for it
alone (`_TrialWorld`), which the rank that ran out of memory tears down so that its peers' pending
collectives fail within seconds; then every rank, failed, released or done, all-reduces "did I run
out of memory" over the default group, and all either keep the measurement or record the same
error, and go on together. The work's groups are destroyed after it, whatever happened, and the
default group is left as it was. Without a process group it simply runs the work.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any

POLL_S = 0.1
"""How often each rank looks, while a trial runs, for a peer's notice that it ran out of memory."""
_NUMBERS = itertools.count()
"""This process's trials, numbered alike on every rank (all run the same trials in the same
order): each trial's notice has a key of its own."""


CAPTURE_THE_DEFAULT_GROUP = ("torch.distributed.nn.functional", "torch.distributed.fsdp.sharded_grad_scaler",
                             "torch.distributed.optim.zero_redundancy_optimizer")
"""Modules whose functions take the default group of the moment they are imported as a default
argument (`group=group.WORLD`): imported during a trial, they would hold the trial's group for ever
(and keep its connections open, so that a peer waiting on them is not released)."""


def run_isolated(measure: Callable[[], float], log: Callable[[str], None] = print) -> tuple[float | None, str | None]:
    """Run one trial on every rank (`measure`: this rank's median step). Returns, on every rank
    alike, (the slowest rank's step, None), or (None, the error of the lowest rank that ran out of
    memory) when any did."""
    from training.dist import gather_objects, is_dist

    if not is_dist():
        try:
            return measure(), None
        except RuntimeError as err:
            oom = _out_of_memory(err)
            if oom is None:
                raise
            return None, _describe(oom)
        finally:
            _free_memory()
    mine: str | None = None
    step_s = 0.0
    with _TrialWorld(next(_NUMBERS), log) as world:
        try:
            step_s = measure()
        except Exception as err:  # noqa: BLE001 - a released collective raises whatever its backend raises
            oom = _out_of_memory(err)
            if oom is not None:
                mine = _describe(oom)
                world.announce(mine)
            elif not world.announced():
                raise
            del oom  # with `err`, the last references to the trial's objects (and its groups) go
            # Else a peer ran out of memory and tore the trial's groups down under this rank's
            # collective: released, this rank goes on to the agreement with its peers.
    # The trial's groups are gone (on the rank that failed, that is what released its peers); the
    # default group decides.
    out_of_memory, slowest = _agree(mine is not None, step_s)
    if not out_of_memory:
        return slowest, None
    return None, next(message for message in gather_objects(mine) if message is not None)


class _TrialWorld:
    """The process groups of one trial, made when it starts and destroyed when it ends.

    Where an out-of-memory error strikes decides who waits for whom. On CPU the budget's tracker
    (training/budget.py) raises at an allocation, and CUDA's allocator too: in the forward, the
    backward or the optimizer step of one rank, while its peers already wait in a collective of
    that step (DDP's bucket all-reduce, FSDP's all-gather or reduce-scatter, a TP or pipeline
    exchange, zero1's broadcast, the loop's loss average at the end). Nothing the failing rank
    later sends on the default group can match such a collective, and a group that must survive
    cannot be torn down under it. So the trial's collectives never run on the default group: a
    fresh group of every rank stands in for it while the trial runs (made under it, the device
    mesh's groups are fresh too; its dimensions that span every rank reuse "the default group",
    which is then this one; the loop's loss average runs on it), and the rank that runs out of
    memory releases its peers from whatever collective of the trial they wait in:

    - it posts a notice under the trial's key in the default group's store, then aborts and
      destroys every group of the trial and drops what referenced them. On gloo, freeing a group
      closes its connections, and a peer's pending collective on them fails at once ("Connection
      closed by peer"); a peer so released frees its own groups, which releases any rank waiting
      on it in turn;
    - every rank watches for the notice on a thread while the trial runs and aborts its own groups
      of the trial when it appears: NCCL's communicator abort is local (a peer's kernels would wait
      for the failed rank until the watchdog's timeout), and the watcher's abort ends them. (Gloo
      has no abort of its own: there the failing rank's freeing does it.)

    A rank whose trial then fails with the notice posted was released, not broken; one that fails
    without it re-raises (a genuine error fails the stage, as it did). Then every rank meets on the
    default group, which no trial touched, for the agreement.

    Not covered: a rank waiting in the creation of a group (a store wait, which no abort ends) for
    a rank that failed before it got there. The stand-in world is made when every rank is between
    trials, and a model that declares its initialisation stays on the meta device until the mesh
    exists; a model built whole allocates before the mesh, and on a mesh with groups of more than
    one rank and fewer than all, a rank that fails that early leaves its peers to the timeout.

    The trial's groups are the groups the process holds beyond those it held before (torch's
    registry); they are destroyed after every trial, whatever happened, so that trials do not pile
    up communicators, and DTensor's caches of their meshes are cleared (`_forget_meshes`).
    """

    def __init__(self, number: int, log: Callable[[str], None]):
        from torch.distributed import distributed_c10d as c10d

        self.log = log
        self.c10d = c10d
        self.default = c10d._get_default_group()
        self.store = c10d._get_default_store()
        self.key = f"scalestudy/trials/{number}/out-of-memory"
        self.before: set[Any] = set()
        self.failed = False
        self.stop = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="trials-oom-watcher", daemon=True)

    def __enter__(self) -> _TrialWorld:
        import importlib

        import torch.distributed as dist

        for name in CAPTURE_THE_DEFAULT_GROUP:  # before it is the trial's
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
        self.before = set(self.c10d._world.pg_map)
        world = dist.new_group(timeout=_timeout(self.default), group_desc="trial_world")
        self.c10d._update_default_pg(world)
        del world
        self.watcher.start()
        return self

    def groups(self) -> list[Any]:
        """The groups made during the trial, the newest first."""
        return [pg for pg in reversed(list(self.c10d._world.pg_map)) if pg not in self.before]

    def announce(self, message: str) -> None:
        """Tell every rank that this one ran out of memory in the trial (before its groups go)."""
        self.failed = True
        self.store.set(self.key, message)

    def announced(self) -> bool:
        return self.store.check([self.key])

    def _watch(self) -> None:
        aborted: weakref.WeakSet[Any] = weakref.WeakSet()  # never keeps a group of the trial alive
        seen = False
        while not self.stop.wait(POLL_S):
            seen = seen or self.announced()
            if not seen:
                continue
            for pg in self.groups():  # groups the trial may still be making, too
                if pg not in aborted:
                    aborted.add(pg)
                    with contextlib.suppress(Exception):
                        pg.abort()

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        self.stop.set()
        self.watcher.join()
        self.c10d._update_default_pg(self.default)
        failed = self.failed or exc[0] is not None or self.announced()
        groups = self.groups()
        held = [weakref.ref(pg) for pg in groups]
        for pg in groups:
            try:
                # A failed trial's groups may have collectives pending: abort them, where destroy
                # could wait for them.
                (self.c10d._abort_process_group if failed else dist.destroy_process_group)(pg)
            except Exception as err:  # noqa: BLE001 - a group that won't go must not fail the next trial
                self.log(f"process group {pg.group_name} of the trial could not be released: {err}")
        del groups
        pg = None  # the last one, else still held here
        _forget_meshes()
        _free_memory()
        leaked = sum(ref() is not None for ref in held)
        if leaked:
            self.log(f"{leaked} process group(s) of the trial are still referenced after it"
                          + (": peers waiting on them wait for the collective timeout" if failed else ""))


def _timeout(group: Any) -> Any:
    """`group`'s collective timeout (the launcher's), for the group standing in for it; None: torch's."""
    from training.dist import device

    try:
        return group._get_backend(device()).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _agree(out_of_memory: bool, step_s: float) -> tuple[bool, float]:
    """Over the default group: whether any rank ran out of memory, and the slowest rank's step."""
    import torch
    import torch.distributed as dist

    from training.dist import device

    flags = torch.tensor([float(out_of_memory), step_s], dtype=torch.float64, device=device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    oom, slowest = flags.tolist()
    return oom > 0, slowest


def _out_of_memory(err: BaseException) -> BaseException | None:
    """The out-of-memory error `err` is or wraps (the pipeline schedule re-raises a stage's error as
    its own): CUDA's, a CPU budget's (a subclass), or one a library words its own way; None."""
    import torch

    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, RuntimeError) and (isinstance(err, torch.OutOfMemoryError)
                                              or "out of memory" in str(err).lower()):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _describe(err: BaseException) -> str:
    first = (str(err).splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:200]}"


def _forget_meshes() -> None:
    """Clear DTensor's caches of what it computed on the trial's device meshes. They key on the
    meshes, and a DeviceMesh equals any other over the same ranks and dimension names whatever its
    process groups: the next trial's mesh would hit them and be handed back this trial's, whose
    groups are gone ("Could not resolve the process group registered under the name ..."), and
    they would keep this trial's groups (and the connections they hold) alive."""
    import functools
    import sys

    import torch

    with contextlib.suppress(ImportError, AttributeError):
        from torch.distributed.tensor import DTensor, _redistribute, _sharding_prop

        # Sharding propagation's cache is per thread (the autograd engine's too, on GPUs): a new one
        # forgets every thread's.
        propagator = DTensor._op_dispatcher.sharding_propagator
        propagator.propagate_op_sharding = _sharding_prop.LocalLRUCache(propagator.propagate_op_sharding_non_cached)
        _redistribute.clear_redistribute_planner_cache()
    with contextlib.suppress(AttributeError):
        torch._C._clear_DTensor_sharding_propagator_cache()  # its C++ dispatch's own
    for name, module in list(sys.modules.items()):  # the functools caches, wherever they are
        if module is None or not name.startswith(("torch.distributed.tensor", "torch.distributed.device_mesh")):
            continue
        for value in list(vars(module).values()):
            members = list(vars(value).values()) if isinstance(value, type) and value.__module__ == name else []
            for item in (value, *members):
                item = getattr(item, "__func__", item)  # a static or class method's function
                if isinstance(item, functools._lru_cache_wrapper):
                    item.cache_clear()


def _free_memory() -> None:
    """Collect what the trial left (reference cycles keep models and their groups), and hand the
    freed device memory back (CUDA's cache)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
