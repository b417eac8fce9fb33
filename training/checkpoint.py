"""Distributed checkpoints (torch.distributed.checkpoint) that a re-run resumes from.

Layout under the directory the engine hands the stage: `step-<k>/` (DCP shards of model and
optimizer) and `latest.json`, which rank 0 rewrites atomically only after every rank finished
writing step k, so a crash during a save leaves the previous checkpoint in force. DCP reshards on
load, so a checkpoint can move between world sizes and between ddp/FSDP layouts; zero1's optimizer
shards are per-rank files and need the same world. The optimizer's state is saved flattened by
parameter name (`state.<name>.exp_avg`, `param_groups.<name>.lr`: torch's
flatten_optimizer_state_dict), so that pipeline ranks, which hold different parameters, write
disjoint keys. A pipeline rank holding several stages (training/parallel/chunks.py) saves its
chunks under the whole model's names, as any other layout does.
"""

from __future__ import annotations

import json
import re
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

from common.files import write_atomic
from training import strategies
from training.dist import checkpoint_timeout, device, is_dist, is_main, rank
from training.loop import Resume
from training.optim import MasterAdamW
from training.parallel.chunks import PipelineChunks

LATEST = "latest.json"
CHUNK = re.compile(r"^chunks\.\d+\.")
"""The prefix a PipelineChunks puts before each chunk's names (`chunks.1.layers.6.w`)."""


@dataclass(frozen=True)
class Layout:
    """What a checkpoint was written by, to say clearly why it can't be loaded elsewhere."""

    strategy: str
    world_size: int


def _barrier() -> None:
    if is_dist():
        dist.barrier()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, zero1: bool) -> tuple[dict, dict[str, str]]:
    """The state to save or load into, under the whole model's names, and those names -> the
    model's own where they differ (a pipeline rank's chunks: `layers.6.w` -> `chunks.1.layers.6.w`)."""
    state = _own_state(model, optimizer, zero1)
    if not isinstance(model, PipelineChunks):
        return state, {}
    back: dict[str, str] = {}

    def plain(name: str) -> str:
        back[CHUNK.sub("", name)] = name
        return CHUNK.sub("", name)

    return _renamed(state, plain), back


def _flat(state: dict) -> dict:
    """What DCP writes and reads: `state` with the optimizer's part keyed by parameter name."""
    if "optim" not in state:
        return dict(state)
    optim = state["optim"]
    flat = {f"state.{name}.{k}": v for name, values in optim["state"].items() for k, v in values.items()}
    for group in optim["param_groups"]:
        flat.update({f"param_groups.{name}.{k}": v for name in group["params"] for k, v in group.items()
                     if k != "params"})
    return {"model": state["model"], "optim": flat}


def _nested(flat: dict, like: dict) -> dict:
    """`flat`, as DCP loaded it, back in the form of `like` (the state it was flattened from)."""
    if "optim" not in like:
        return flat
    optim, values = like["optim"], flat["optim"]
    state = {name: {k: values[f"state.{name}.{k}"] for k in keys} for name, keys in optim["state"].items()}
    groups = [{**{k: values[f"param_groups.{g['params'][0]}.{k}"] if g["params"] else v for k, v in g.items()
                  if k != "params"}, "params": g["params"]} for g in optim["param_groups"]]
    return {"model": flat["model"], "optim": {"state": state, "param_groups": groups}}


def _renamed(state: dict, rename: Callable[[str], str]) -> dict:
    """`state` ({"model": ..., "optim": ...}) with every parameter name passed through `rename`."""
    out = {"model": {rename(k): v for k, v in state["model"].items()}}
    if "optim" in state:
        optim = state["optim"]
        groups = [{**g, "params": [rename(k) for k in g["params"]]} for g in optim["param_groups"]]
        out["optim"] = {"state": {rename(k): v for k, v in optim["state"].items()}, "param_groups": groups}
    return out


def _own_state(model: nn.Module, optimizer: torch.optim.Optimizer, zero1: bool) -> dict:
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
        dcp.save(_flat(_state(model, optimizer, zero1)[0]), checkpoint_id=str(path))
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
    state, back = _state(model, optimizer, zero1)
    flat = _flat(state)
    try:
        dcp.load(flat, checkpoint_id=str(path))
    except Exception as err:  # noqa: BLE001 - DCP raises many types; the user needs the layouts
        raise ValueError(
            f"checkpoint {path} ({saved.strategy} at world {saved.world_size}) cannot be loaded into "
            f"{layout.strategy} at world {layout.world_size}: {_last_line(err)}"
        ) from err
    state = _nested(flat, state)
    if back:
        state = _renamed(state, lambda name: back.get(name, name))
    if zero1:
        set_model_state_dict(model, state["model"])
        shard = torch.load(path / f"zero1-optim-rank{rank()}.pt", map_location=onto(device()), weights_only=True)
        optimizer.load_state_dict(shard)
        optimizer.copy_to_model()
    elif isinstance(optimizer, MasterAdamW) and optimizer.has_masters:
        optimizer.copy_to_model()  # DCP loaded the masters and moments in place
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
