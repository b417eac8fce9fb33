"""Distributed checkpoints (torch.distributed.checkpoint) that a re-run resumes from.

Layout under the directory the engine hands the stage: `step-<k>/` (DCP shards of model and
optimizer) and `latest.json`, which rank 0 rewrites atomically only after every rank finished
writing step k, so a crash during a save leaves the previous checkpoint in force. DCP reshards on
load, so a checkpoint can move between world sizes and between ddp/FSDP layouts; zero1's optimizer
shards are per-rank files and need the same world.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    _get_fqns,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.serialization import default_restore_location

from training import strategies
from training.dist import checkpoint_timeout, device, is_dist, is_main, rank
from training.files import write_atomic
from training.loop import Resume
from training.optim import MasterAdamW

LATEST = "latest.json"


@dataclass(frozen=True)
class Layout:
    """What a checkpoint was written by, to say clearly why it can't be loaded elsewhere."""

    strategy: str
    world_size: int


def _barrier() -> None:
    if is_dist():
        dist.barrier()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, zero1: bool) -> dict:
    if zero1:
        return {"model": get_model_state_dict(model)}
    if isinstance(optimizer, MasterAdamW) and optimizer.has_masters:
        return _master_state(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _master_state(model: nn.Module, optimizer: MasterAdamW) -> dict:
    """The state of bf16 training without FSDP in get_state_dict's form, with the fp32 masters in
    place of the bf16 parameters: the checkpoint of an FSDP run in bf16 holds the same (its
    sharded fp32 parameters), so either loads into the other and DCP reshards between worlds."""
    fqn = {}
    for name, p in model.named_parameters():
        (fqn[p],) = _get_fqns(model, name)
    masters = {piece.param: m for piece, m in optimizer.pairs}
    model_sd = {fqn[p]: masters[p] for p in masters}
    state = {fqn[p]: optimizer.state[m] for p, m in masters.items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn[p] for p in masters]}
              for g in optimizer.param_groups]
    return {"model": model_sd, "optim": {"state": state, "param_groups": groups}}


def save(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, losses: list[float],
         lrs: list[float], layout: Layout, zero1: bool) -> None:
    """Save step `step` on every rank (collective), then point `latest.json` at it. The collectives
    run under launcher.checkpoint_timeout_s (writing shards takes longer than a step's collective)."""
    path = root / f"step-{step}"
    path.mkdir(parents=True, exist_ok=True)
    with checkpoint_timeout():
        dcp.save(_state(model, optimizer, zero1), checkpoint_id=str(path))
        if zero1:
            torch.save(optimizer.state_dict(), path / f"zero1-optim-rank{rank()}.pt")
        _barrier()
        if is_main():
            meta = {"step": step, "losses": losses, "lrs": lrs, "path": path.name,
                    "strategy": layout.strategy, "world_size": layout.world_size}
            write_atomic(root / LATEST, json.dumps(meta))
        _barrier()


def _last_line(err: BaseException) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def onto(dev: torch.device) -> Callable[[torch.UntypedStorage, str], torch.UntypedStorage]:
    """torch.load's map_location for a file another rank's device may have written: what was saved
    from a device comes onto `dev` (this rank's), not back onto the device that saved it; what was
    saved from host memory stays there, as a fresh optimizer keeps it (AdamW's step counters: on
    the GPU, each would cost a host sync per step)."""

    def restore(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        return storage if location == "cpu" else default_restore_location(storage, str(dev))

    return restore


def load(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer, layout: Layout, zero1: bool) -> Resume | None:
    """Restore the latest checkpoint into `model` and `optimizer`; None when there is none."""
    latest = root / LATEST
    if not latest.exists():
        return None
    meta = json.loads(latest.read_text())
    saved = Layout(meta["strategy"], meta["world_size"])
    if (zero1 or strategies.get(saved.strategy).shards_optimizer_only) and saved != layout:
        raise ValueError(
            f"checkpoint {root / meta['path']} was written by {saved.strategy} at world {saved.world_size}; zero1's "
            f"optimizer shards reload only into zero1 at the same world size (this run: {layout.strategy} at world "
            f"{layout.world_size})"
        )
    with checkpoint_timeout():
        _restore(root / meta["path"], model, optimizer, saved, layout, zero1)
    return Resume(step=meta["step"], losses=meta["losses"], lrs=meta["lrs"])


def _restore(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, saved: Layout, layout: Layout,
             zero1: bool) -> None:
    """Load the checkpoint at `path` into `model` and `optimizer` (collective)."""
    state = _state(model, optimizer, zero1)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as err:  # noqa: BLE001 - DCP raises many types; the user needs the layouts
        raise ValueError(
            f"checkpoint {path} ({saved.strategy} at world {saved.world_size}) cannot be loaded into "
            f"{layout.strategy} at world {layout.world_size}: {_last_line(err)}"
        ) from err
    if zero1:
        set_model_state_dict(model, state["model"])
        shard = torch.load(path / f"zero1-optim-rank{rank()}.pt", map_location=onto(device()), weights_only=True)
        optimizer.load_state_dict(shard)
        optimizer.copy_to_model()
    elif isinstance(optimizer, MasterAdamW) and optimizer.has_masters:
        optimizer.copy_to_model()  # DCP loaded the masters and moments in place
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
