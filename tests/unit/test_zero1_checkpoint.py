"""zero1's optimizer shards (one torch.save file per rank) come back onto the loading rank's device,
not onto the device that wrote them: a file written on "cuda:1" (each storage's tag, as torch.save
writes it on a GPU) loads here, and its state equals what was saved."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from training import checkpoint
from training.checkpoint import Layout, onto
from training.dist import device
from training.optim import MasterAdamW

ELSEWHERE = "cuda:1"
_tagging: list[bool] = []


def _tag(storage: object) -> str | None:
    """torch.save's device tag: "cuda:1" for what the test saves from the CPU inside `written_on_another_device`
    (scalars aside, with `keep_scalars`), as if another rank's GPU had written the file."""
    if not _tagging or getattr(storage, "device", None) != torch.device("cpu"):
        return None
    if _tagging[-1] and storage.nbytes() <= 4:  # type: ignore[attr-defined]
        return None
    return ELSEWHERE


@contextlib.contextmanager
def written_on_another_device(keep_scalars: bool = False) -> Iterator[None]:
    entry = (1, _tag, lambda storage, location: None)  # ahead of torch's own ("cpu" is 10)
    torch.serialization.register_package(*entry)
    _tagging.append(keep_scalars)
    try:
        yield
    finally:
        _tagging.pop()
        torch.serialization._package_registry.remove(entry)


def trained() -> tuple[nn.Module, MasterAdamW]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = MasterAdamW(list(model.parameters()), {}, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def tensors(optimizer: MasterAdamW) -> list[torch.Tensor]:
    sd = optimizer.state_dict()
    return [t for state in sd["state"].values() for t in state.values()] + sd["masters"]


def test_a_file_written_on_another_device_loads_as_saved():
    """The premise: without a map_location, the file goes back to the device that wrote it."""
    model, optimizer = trained()
    buffer = __import__("io").BytesIO()
    with written_on_another_device():
        torch.save(optimizer.state_dict(), buffer)
    if torch.cuda.device_count() < 2:
        buffer.seek(0)
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(buffer, weights_only=True)
    buffer.seek(0)
    loaded = torch.load(buffer, map_location=onto(device()), weights_only=True)
    assert all(t.device == device() for state in loaded["state"].values() for t in state.values())


def test_device_saved_storages_come_onto_the_given_device_and_host_ones_stay():
    model, optimizer = trained()
    buffer = __import__("io").BytesIO()
    with written_on_another_device(keep_scalars=True):
        torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, map_location=onto(torch.device("meta")), weights_only=True)
    for state in loaded["state"].values():
        assert state["step"].device == torch.device("cpu"), "AdamW's step counter: host memory, as saved"
        assert state["exp_avg"].is_meta and state["exp_avg_sq"].is_meta
    assert all(m.is_meta for m in loaded["masters"])


def test_zero1_optimizer_state_round_trips_onto_this_ranks_device(tmp_path, monkeypatch):
    model, optimizer = trained()
    saved_params = [p.detach().clone() for p in model.parameters()]
    saved_state = [t.clone() for t in tensors(optimizer)]
    layout = Layout("zero1", 1)
    with written_on_another_device():
        checkpoint.save(tmp_path, 3, model, optimizer, [1.0, 0.9, 0.8], [1e-2] * 3, layout, zero1=True)
    # Move on: one more step changes the parameters, the moments and the step counters.
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    assert not torch.equal(tensors(optimizer)[1], saved_state[1])

    loads = []
    real_load = torch.load

    def recorded_load(f, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - torch.load's own
        if str(f).endswith(".pt"):  # the zero1 file (DCP reads its own shards too)
            loads.append(kwargs)
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", recorded_load)
    resume = checkpoint.load(tmp_path, model, optimizer, layout, zero1=True)
    assert resume is not None and resume.step == 3 and resume.losses == [1.0, 0.9, 0.8]
    assert len(loads) == 1 and loads[0]["weights_only"] is True and callable(loads[0]["map_location"])
    restored = tensors(optimizer)
    assert len(restored) == len(saved_state)
    for got, want in zip(restored, saved_state, strict=True):
        assert got.device == want.device and torch.equal(got, want)
    for p, want in zip(model.parameters(), saved_params, strict=True):
        assert p.device == device() and torch.equal(p.detach(), want)
