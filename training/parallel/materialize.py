"""Nobody holds the whole model: build on the meta device, shard, then give each rank its shard.

torchtitan's order. The model is built with its parameters on the meta device (its buffers, small,
on the host: rotary tables and masks are computed in constructors); the parallel techniques shard
it there; then `materialize` allocates each rank's share on its device and initialises it.

Initialisation is the model's own, one module at a time: a module with parameters of its own gets
a full-size twin on the host, seeded by the module's name (not by the order or the ranks that reach
it), is reset and initialised as its model declares, and each rank keeps its shard of the result.
So the values are the same under every layout (parity with one process holds) while no rank ever
holds more than one module's full parameters beside its shard.

A model opts in by declaring `init_module` on its class: a function of one module that initialises
it as the model's constructor would (GPT-2's normal(0, 0.02), say), or None when torch's own
`reset_parameters` is the model's initialisation. Hugging Face models declare theirs already
(`_init_weights`). A model that declares nothing is built whole on the host, as its constructor
initialises it.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from training.config import ModelConfig
from training.contract.spec import ModelSpec
from training.contract.weights import Weights

InitFn = Callable[[nn.Module], None]

WEIGHTS_DIR = "weights_dir"
"""The attribute by which a model built from a checkpoint's config names the checkpoint's directory:
its tensors are read there, each rank its shard, when the model is materialized."""

UNDECLARED = object()
"""The model says nothing of its initialisation: it is built on the host."""


def declared_init(model: nn.Module) -> InitFn | None | object:
    """The model's per-module initialiser: its `init_module` (None: torch's defaults), Hugging
    Face's `_init_weights`, or UNDECLARED."""
    if "init_module" in dir(type(model)):
        return model.init_module
    init = getattr(model, "_init_weights", None)
    if init is not None and hasattr(model, "config"):
        return init
    return UNDECLARED


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Construct modules with their parameters on the meta device and their buffers on the host
    (each parameter is created, then replaced by its meta twin: one at a time, never the model)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_on_device(cfg: ModelConfig, seed: int, dev: torch.device) -> tuple[nn.Module, ModelSpec]:
    """The model for `dev` and its declarations: on the meta device, pending its shards, when it
    declares its initialisation; otherwise built whole on the host and moved to `dev`."""
    from training.contract.calls import build_model
    from training.contract.spec import Pending, model_spec

    with parameters_on_meta():
        model = build_model(cfg, seed)
    init = declared_init(model)
    if init is UNDECLARED:
        model = build_model(cfg, seed).to(dev)
        return model, model_spec(model, cfg)
    spec = model_spec(model, cfg)
    # A checkpoint (a factory's `weights_dir`, as training.models.hf sets for model.pretrained) gives
    # the values; what it lacks is initialised.
    weights_dir = getattr(model, WEIGHTS_DIR, None)
    spec.pending = Pending({m: n for n, m in model.named_modules()}, init, seed, weights_dir)
    return model, spec


def module_seed(seed: int, name: str) -> int:
    """The seed of one module's initialisation: the run's seed and the module's name alone."""
    return zlib.crc32(f"{seed}/{name}".encode())


def materialize(model: nn.Module, names: dict[nn.Module, str], init: InitFn | None, dev: torch.device,
                seed: int, weights: Weights | None = None) -> None:
    """Allocate `model`'s (sharded) meta parameters on `dev` and give each its values: this rank's
    slice of the tensor of its name in `weights` (a checkpoint, read shard by shard), else the
    model's initialisation. Buffers move to `dev` as they are. `names` holds each module's name in
    the model as built. A parameter two modules share (tied embeddings) gets its values once."""
    buffers = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None]
    model.to_empty(device=dev)
    done: set[int] = set()
    with torch.no_grad():
        for module, name, buffer in buffers:
            module._buffers[name] = buffer.to(dev)
        for module in model.modules():
            prefix = names.get(module, "")
            own = {n: p for n, p in module._parameters.items() if p is not None and id(p) not in done}
            if weights is not None:
                for n, p in list(own.items()):
                    key = f"{prefix}.{n}" if prefix else n
                    if key in weights:
                        _local(p).copy_(_read_shard(weights, key, p))
                        del own[n]
            if own:
                _initialise(module, own, init, module_seed(seed, prefix))
            done.update(id(p) for p in module._parameters.values() if p is not None)


def _initialise(module: nn.Module, own: dict[str, nn.Parameter], init: InitFn | None, seed: int) -> None:
    twin = _plain_copy(module)  # the module's attributes (sizes, padding_idx, config), not its parameters
    twin._parameters = {n: None if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype))
                        for n, p in module._parameters.items()}
    twin._modules = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        reset = getattr(twin, "reset_parameters", None)
        if callable(reset):
            reset()
        if init is not None:
            init(twin)
    for n, p in own.items():
        _local(p).copy_(_shard(twin._parameters[n].detach(), p))


def _plain_copy(module: nn.Module) -> nn.Module:
    """A shallow copy of `module` as its own class: FSDP2 turns a module it shards into a subclass
    whose construction (copy.copy's) rebuilds the original class with no arguments; a module that is
    an FSDP unit and holds parameters itself (split experts) reaches here."""
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
    twin = cls.__new__(cls)
    twin.__dict__.update(module.__dict__)
    return twin


def _read_shard(weights: Weights, key: str, like: torch.Tensor) -> torch.Tensor:
    """The block of checkpoint tensor `key` that this rank's shard of `like` holds: read alone."""
    if not hasattr(like, "device_mesh"):
        return weights.read(key, (0,) * like.dim(), tuple(like.shape))
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return weights.read(key, tuple(offsets), tuple(shape))


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _shard(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full`, laid out as the sharded parameter `like` (a DTensor from TP or
    FSDP: cut locally, every rank computed the same `full`)."""
    if not hasattr(like, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
