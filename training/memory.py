"""Memory measured from the tensors themselves (CPU) or the CUDA allocator (GPU).

On CPU there is no allocator high-water mark per device, so the peak of a training step is
counted: parameters + gradients + optimizer state + the activations autograd saved for backward
(captured with saved-tensor hooks, de-duplicated by storage). It is an upper bound of the live
set, since gradients grow while activations are freed; on CUDA `max_memory_allocated` is used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from training.units import GIB

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class StepMemory:
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    activation_bytes: int
    peak_bytes: int
    source: str
    """`cuda_allocator` or `tensor_count`."""
    reserve_ratio: float = 1.0
    """CUDA: the caching allocator's peak reserved over its peak allocated bytes for the step (its
    fragmentation and rounding); 1 where tensors are counted."""


def _local(t: torch.Tensor) -> torch.Tensor:
    # Sharded (DTensor) parameters count only the shard this rank holds.
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes held by this rank. The optimizer's share is
    its state and any parameters of its own: the fp32 masters of bf16 parameters (training/optim.py)."""
    import torch

    params = list(model.parameters())
    param_bytes = sum(tensor_bytes(p) for p in params)
    grad_bytes = sum(tensor_bytes(p.grad) for p in params if p.grad is not None)
    optim_bytes = 0
    if optimizer is not None:
        own = {storage_id(p) for p in params}  # zero1's fp32 masters are views of the parameters
        for group in optimizer.param_groups:
            optim_bytes += sum(tensor_bytes(m) for m in group["params"] if storage_id(m) not in own)
        for state in optimizer.state.values():
            optim_bytes += sum(tensor_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return param_bytes, grad_bytes, optim_bytes


def storage_id(t: torch.Tensor) -> int:
    """Which storage a tensor views: the storage object itself, not its address, so that it also
    tells meta tensors (which all have address 0) apart."""
    return _local(t).untyped_storage()._cdata


def packed(t: torch.Tensor) -> torch.Tensor:
    """What a saved-tensor pack hook that only observes should store for `t`: `t` detached (the
    same storage). autograd gives the unpacked tensor back its place in the graph; storing `t`
    itself ties an op's saved output to the op's own node, a reference cycle that only running
    backward through the node breaks. A graph never backwarded then lives for the whole run: torch's
    pipeline schedule infers the first stage's shapes with a real forward it never backwards, and
    the first pipeline rank held that microbatch's saved activations in every later step (measured:
    1.46 MB of a 7.96 MB peak on the memory test's GPT at pp=2, m=2)."""
    return t.detach()


_KEPT_OBSERVERS: list[Callable[[torch.Tensor], object]] = []
"""The saved-bytes counters active now (SavedActivations, memory_audit)."""


def kept_for_backward(output: object) -> None:
    """Report an op's output tensors that are held for backward outside autograd's saved tensors
    (selective activation checkpointing caches them: training/parallel/ac.py) to the saved-bytes
    counters active now, which count them as saved."""
    import torch

    tensors = [output] if isinstance(output, torch.Tensor) else output if isinstance(output, tuple | list) else []
    for observe in list(_KEPT_OBSERVERS):
        for t in tensors:
            if isinstance(t, torch.Tensor):
                observe(t)


class SavedActivations:
    """Counts the bytes autograd saves for backward, and what selective checkpointing keeps
    (kept_for_backward), excluding the parameters themselves."""

    def __init__(self, model: nn.Module):
        import torch

        self._param_ptrs = {storage_id(p) for p in model.parameters()}
        self._seen: dict[int, int] = {}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _kept(self, t: torch.Tensor) -> None:
        self._pack(t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = _local(t)  # DTensors (TP) save their local shard; the wrapper has no storage
        try:
            key, nbytes = storage_id(local), local.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            key, nbytes = id(t), tensor_bytes(local)
        if key not in self._param_ptrs:
            self._seen[key] = nbytes
        return packed(t)

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> SavedActivations:
        self._ctx.__enter__()
        _KEPT_OBSERVERS.append(self._kept)
        return self

    def __exit__(self, *exc: object) -> None:
        _KEPT_OBSERVERS.remove(self._kept)
        self._ctx.__exit__(*exc)


class StepProbe:
    """Measures one training step from the inside: enter before its forward, call `finish` right
    after its optimizer step (before gradients are zeroed).

    Parameter bytes are the larger of what the rank holds after forward and after the step:
    ZeRO-2 keeps gathered parameters from forward to backward, ZeRO-3 frees them."""

    def __init__(self, model: nn.Module, dev: torch.device):
        self.model, self.dev = model, dev
        self.saved = SavedActivations(model)
        self._after_forward: dict[int, int] = {}
        """Each chunk's largest parameter bytes after its forward (one chunk but on pipeline ranks
        holding several stages, each gathered by its own FSDP root)."""
        self._hooks: list = []

    def __enter__(self) -> StepProbe:
        import torch

        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            torch.cuda.reset_peak_memory_stats(self.dev)
        from training.parallel.chunks import parts

        self._hooks = [part.register_forward_hook(self._on_forward) for part in parts(self.model)]
        self.saved.__enter__()
        return self

    def _on_forward(self, module: nn.Module, args: object, output: object) -> None:
        held = sum(tensor_bytes(p) for p in module.parameters())
        self._after_forward[id(module)] = max(self._after_forward.get(id(module), 0), held)

    def __exit__(self, *exc: object) -> None:
        self.saved.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()

    def finish(self, optimizer: torch.optim.Optimizer) -> StepMemory:
        import torch

        params, grads, optim = state_bytes(self.model, optimizer)
        params = max(params, sum(self._after_forward.values()))
        activations = self.saved.bytes
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            allocated = torch.cuda.max_memory_allocated(self.dev)
            ratio = torch.cuda.max_memory_reserved(self.dev) / allocated if allocated else 1.0
            return StepMemory(params, grads, optim, activations, allocated, "cuda_allocator", ratio)
        return StepMemory(params, grads, optim, activations, params + grads + optim + activations, "tensor_count")


def measure_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: Callable[[], None],
    dev: torch.device,
) -> StepMemory:
    """Run `step` (one forward, backward and optimizer step) and measure its memory."""
    with StepProbe(model, dev) as probe:
        step()
    return probe.finish(optimizer)


def device_memory_bytes(dev: torch.device, ranks_per_host: int) -> int:
    """Memory one rank may use: the GPU's total, or this host's RAM shared by its ranks."""
    import torch

    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory
    with open("/proc/meminfo") as f:
        total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return total_kib * 1024 // max(ranks_per_host, 1)


@dataclass(frozen=True)
class AuditRow:
    phase: str
    """`forward` or `backward`."""
    module: str
    live_bytes: int
    """Memory in use right after this module (CUDA allocator, or counted from the tensors)."""
    peak_bytes: int
    """The highest in-use memory seen so far."""


def top_level_modules(model: nn.Module, blocks: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """Embedding, each block, head...: the model's children, descending into whatever holds the
    blocks (a block list, a Hugging Face base model) until each block is a row of its own."""
    ids = {id(b) for b in blocks}

    def holds_blocks(module: nn.Module) -> bool:
        return any(id(m) in ids for m in module.modules())

    out: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if id(child) not in ids and holds_blocks(child):
                visit(f"{full}.", child)
            else:
                out.append((full, child))

    visit("", model)
    return out


def memory_audit(model: nn.Module, blocks: list[nn.Module], loss: Callable[[], torch.Tensor],
                 dev: torch.device) -> list[AuditRow]:
    """The memory in use after each top-level module (each block a row) of one forward and backward.

    On CPU and the meta device (the plan's audit: training/planner/anatomy.py meta_memory_audit) the live set
    is counted: parameters + the activations saved so far (attributed to the module that saved them)
    + gradients; a module's activations are freed once its backward ran."""
    import torch

    modules = top_level_modules(model, blocks)
    params = sum(tensor_bytes(p) for p in model.parameters())
    saved: dict[str, int] = {}
    done: set[str] = set()
    rows: list[AuditRow] = []
    current = [""]
    param_ptrs = {storage_id(p) for p in model.parameters()}
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = _local(t)
        try:
            ptr = storage_id(local)
        except (RuntimeError, NotImplementedError):
            ptr = id(t)
        if ptr not in param_ptrs and ptr not in seen:
            seen.add(ptr)
            saved[current[0]] = saved.get(current[0], 0) + tensor_bytes(local)
        return packed(t)

    def live() -> int:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            return torch.cuda.memory_allocated(dev)
        grads = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        return params + grads + sum(v for k, v in saved.items() if k not in done)

    def record(phase: str, name: str) -> None:
        now = live()
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else max([now, *(r.peak_bytes for r in rows)])
        rows.append(AuditRow(phase, name, now, peak))

    def after_backward(name: str) -> None:
        done.add(name)
        record("backward", name)

    handles = []
    for name, module in modules:
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: current.__setitem__(0, n)))
        handles.append(module.register_forward_hook(lambda m, a, o, n=name: record("forward", n)))
        handles.append(module.register_full_backward_hook(lambda m, gi, go, n=name: after_backward(n)))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    _KEPT_OBSERVERS.append(pack)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            value = loss()
        value.backward()
    finally:
        _KEPT_OBSERVERS.remove(pack)
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    return rows


def audit_table(rows: list[AuditRow]) -> str:
    lines = ["| phase | module | in use (GiB) | peak so far (GiB) |", "|---|---|---:|---:|"]
    lines += [f"| {r.phase} | {r.module} | {r.live_bytes / GIB:.6f} | {r.peak_bytes / GIB:.6f} |" for r in rows]
    return "\n".join(lines) + "\n"
