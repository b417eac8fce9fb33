"""Worker functions for the context-parallel tests (importable by the ranks run_world starts)."""

from __future__ import annotations

import torch
from torch import nn

from training.config import ModelConfig, StrategyConfig


def _block_saved_bytes(model: nn.Module, blocks: list[nn.Module], run) -> int:
    """Bytes autograd saves for backward while a block's forward runs (each storage once,
    parameters excluded), over one forward and backward of `run`."""
    from training.memory import packed, storage_id

    params = {storage_id(p) for p in model.parameters()}
    depth = [0]
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_id(t)
        if depth[0] > 0 and key not in params:
            seen[key] = t.untyped_storage().nbytes()
        return packed(t)

    handles = []
    for block in blocks:
        handles.append(block.register_forward_pre_hook(lambda m, a: depth.__setitem__(0, depth[0] + 1)))
        handles.append(block.register_forward_hook(lambda m, a, o: depth.__setitem__(0, depth[0] - 1)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for handle in handles:
            handle.remove()
    return sum(seen.values())


def block_activations(inputs: tuple[ModelConfig, StrategyConfig, int, int]) -> dict:
    """One training step's forward and backward of the model under `strategy` on a seeded token
    batch (the same on every rank): the bytes saved inside the blocks on this rank, and the K/V
    all-gather traffic context parallelism measured (none without it)."""
    from training.contract.calls import build_model, model_loss
    from training.contract.spec import model_spec
    from training.parallel.compose import parallelize

    model_cfg, strategy, batch, seq_len = inputs
    model = build_model(model_cfg, seed=0)
    spec = model_spec(model, model_cfg)
    blocks = [b.module for b in spec.blocks]
    parallel = parallelize(model, spec, strategy, torch.device("cpu"), model_loss(model_cfg))
    tokens = torch.randint(model_cfg.kwargs["vocab_size"], (batch, seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    step = (tokens[:, :-1], tokens[:, 1:])
    saved = _block_saved_bytes(model, blocks, lambda: parallel.forward_backward(step, 1.0))
    stats = parallel.cp.stats if parallel.cp is not None else None
    return {
        "block_saved_bytes": saved,
        "layers": stats.layers if stats else 0,
        "gathered_per_layer": list(stats.per_layer) if stats else [],
        "scattered_bytes": stats.scattered_bytes if stats else 0,
    }
