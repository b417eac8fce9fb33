"""The kernel-level checks of make gpu-smoke (scripts/gpu_smoke.py): each holds a CUDA kernel path
of the trainer against what the CPU runs or against torch's plain call."""

from __future__ import annotations

from collections.abc import Callable


def float8_against_emulation() -> str:
    """fp8's CUDA path (`torch._scaled_mm`) against the product the CPU computes (training/parallel/
    float8.py): the same operands, the same numbers but for the order of the fp32 sums; then one
    Float8Linear forward and backward against bf16. An sm < 8.9 GPU has no float8: refused."""
    import torch
    from torch import nn

    from training.parallel.float8 import FORWARD, _mm, apply_float8, float8_problem, to_float8

    dev = torch.device("cuda")
    problem = float8_problem(dev)
    if problem is not None:
        return f"refused as it should be: {problem}"
    torch.manual_seed(0)
    x, w = torch.randn(4096, 4096, device=dev), torch.randn(4096, 4096, device=dev) * 0.02
    (x8, x_inv), (w8, w_inv) = to_float8(x, FORWARD), to_float8(w, FORWARD)
    gpu = _mm(x8, x_inv, w8.t(), w_inv, torch.bfloat16).float()
    cpu = _mm(x8.cpu(), x_inv.cpu(), w8.t().cpu(), w_inv.cpu(), torch.bfloat16).float()
    differ = (gpu.cpu() - cpu).abs().max().item() / cpu.abs().max().item()
    assert differ < 2.0**-7, f"CUDA float8 product differs from the emulated one by {differ:.2e} of its scale"
    ref = nn.Linear(4096, 4096, device=dev, dtype=torch.bfloat16)
    f8 = nn.Linear(4096, 4096, device=dev, dtype=torch.bfloat16)
    f8.load_state_dict(ref.state_dict())
    apply_float8([nn.Sequential(f8)])
    a = torch.randn(8, 512, 4096, device=dev, dtype=torch.bfloat16)
    out, out8 = ref(a), f8(a)
    out8.float().square().mean().backward()
    gap = ((out8 - out).float().norm() / out.float().norm()).item()
    assert gap < 2.0**-4, f"a Float8Linear's output is {gap:.2%} from bf16's"
    return f"_scaled_mm vs emulation: {differ:.1e} of scale; Float8Linear vs bf16: {gap:.2%}"


def cp_attention_kernels() -> str:
    """Context parallelism's attention on CUDA (training/parallel/cp.py), in a CP group of one rank:
    its two chunks are the whole sequence, the second one's queries the last of its keys, so its
    mask goes to the kernel as `causal_lower_right` (no tensor). Against one process's SDPA over
    the whole sequence (is_causal), in bf16: outputs and Q/K/V gradients. Then a forward and
    backward timed against one call with the additive (s x s) mask the trainer used before
    2026-12-07, which ran every pair."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from training.parallel.cp import ContextParallel

    dev = torch.device("cuda")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
    try:
        torch.manual_seed(0)
        b, h, seq, d = 1, 32, 16384, 128
        q, k, v, grad = (torch.randn(b, h, seq, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
        cp = ContextParallel(dist.group.WORLD, 0, 1)

        def step(fn: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor], float]:
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*inputs)
            out.backward(grad)
            end.record()
            torch.cuda.synchronize()
            return out, [t.grad for t in inputs], start.elapsed_time(end)

        def chunked(*t: torch.Tensor) -> torch.Tensor:
            with cp.dispatch():
                return F.scaled_dot_product_attention(*t, is_causal=True)

        allowed = torch.ones(seq, seq, device=dev, dtype=torch.bool).tril()
        mask = torch.zeros(seq, seq, device=dev, dtype=torch.bfloat16).masked_fill_(~allowed, float("-inf"))
        whole = lambda *t: F.scaled_dot_product_attention(*t, is_causal=True)  # noqa: E731
        masked = lambda *t: F.scaled_dot_product_attention(*t, attn_mask=mask)  # noqa: E731
        ref, ref_grads, _ = step(whole)
        out, grads, _ = step(chunked)
        assert not cp._masks, "the kernel's way builds no mask"
        worst = max(((a - b).float().norm() / b.float().norm()).item()
                    for a, b in zip([out, *grads], [ref, *ref_grads], strict=True))
        assert worst < 2e-2, f"chunked CP attention is {worst:.2%} from one call's (bf16)"
        ms = {name: sorted(step(fn)[2] for _ in range(5))[2] for name, fn in
              (("chunked", chunked), ("whole", whole), ("masked", masked))}
    finally:
        dist.destroy_process_group()
    return (f"chunked vs one call, bf16, s={seq}: {worst:.2%}; forward+backward {ms['chunked']:.1f} ms, one causal "
            f"call {ms['whole']:.1f} ms, one call with the s x s mask {ms['masked']:.1f} ms")
