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


def attention_both_ways(inputs: tuple[int, int]) -> dict:
    """Context-parallel causal attention on random Q/K/V (the same on every rank), once with each
    chunk's mask built as a tensor (a CPU's way) and once as the lower-right bias CUDA's kernels
    apply themselves (torch builds it on a CPU): the largest difference from one process's
    attention over the whole sequence, in the outputs and in the gradients of this rank's Q, K
    and V, over every rank; and the mask tensors each way built."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from training.parallel.cp import ContextParallel

    heads, kv_heads = inputs
    rank, size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    batch, seq, dim = 2, 8 * size, 8

    def rand(h: int) -> torch.Tensor:
        return torch.randn(batch, h, seq, dim, generator=gen, dtype=torch.float64)

    q, k, v, grad = rand(heads), rand(kv_heads), rand(kv_heads), rand(heads)
    gqa = {"enable_gqa": True} if kv_heads != heads else {}
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*whole, is_causal=True, **gqa)
    reference.backward(grad)
    result = {}
    for name, kernel_masks in (("tensor", False), ("kernel", True)):
        cp = ContextParallel(dist.group.WORLD, rank, size, kernel_masks=kernel_masks)
        at = cp.split.positions(seq)
        local = [t.index_select(2, at).clone().requires_grad_() for t in (q, k, v)]
        with cp.dispatch():
            out = F.scaled_dot_product_attention(*local, is_causal=True, **gqa)
        out.backward(grad.index_select(2, at))
        pairs = [(out, reference), *((mine.grad, theirs.grad) for mine, theirs in zip(local, whole, strict=True))]
        error = torch.tensor(max(float((a - b.index_select(2, at)).abs().max()) for a, b in pairs))
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
        masks = torch.tensor(len(cp._masks))
        dist.all_reduce(masks)
        result[name] = {"error": float(error), "masks": int(masks)}
    return result
