"""Expert parallelism: each mixture-of-experts layer's experts split over `ep` ranks, tokens sent to
the rank holding their expert and back by all-to-all (Megatron-Core's and torchtitan's layout,
carved out of the ranks that hold the same weights and see different tokens: the data-parallel
ranks and the context-parallel ones, as torchtitan's ep borrows from dp_shard x cp).

Those ranks (dp_replicate x dp_shard x cp, flattened in that order: a sequence's cp parts are
neighbours), times the TP ranks beside them (which split their tokens, below), form dp·cp·tp / ep
*expert groups* of ep neighbouring ranks; rank i of a group holds experts [i·E/ep, (i+1)·E/ep) of
every layer. The ranks holding the same experts (one from each
expert group) are *expert replicas*: their experts' gradients are reduced over them alone, while
the other weights are reduced over every data- and context-parallel rank as before.

An expert's gradient on its rank already sums what every rank of its expert group sent it (the
all-to-all's backward returns each token's gradient to where it came from, and the weights'
gradients stay); the replicas' sum then covers every rank's tokens, divided by dp·cp as the other
weights' average is (a CP rank's loss is the mean over its part of each sequence, equal parts):
one process's gradient at the same global batch.

Composes with DDP, FSDP (the experts sharded over their replicas) and pipeline stages (each stage's
own expert groups). Applied to whatever experts modules the model's expert plan names
(training/contract/spec.py): the built-in MoE GPT's, Hugging Face's MoE families'
(`base_model_ep_plan`), a user model's (`model.ep_plan`).

With tensor parallelism the experts are in no TP plan (whole experts on every TP rank, as
Megatron-Core's expert tensor-parallel size 1), and the ranks of a TP group, which see the same
tokens, split them: TP rank t routes the t-th of tp parts of its tokens through its expert group,
and the parts are gathered back (Megatron-Core's alltoall dispatcher under TP). Each expert then
computes a TP rank's tokens once instead of tp times. Since every rank then routes tokens of its
own, an expert group takes neighbouring ranks whatever their TP index (expert_groups): EP 8 beside
TP 2 is one node of 8, its all-to-alls on NVLink. zero1 shares out the experts' optimizer state over their
replicas, the rest's over the data-parallel ranks (training/optim.py). Checkpoints need nothing of
their own: the split experts are DTensors, which DCP saves under the whole model's names and
reshards on load.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from training.contract.experts import capacity_factor_of, group_by_expert, local_part
from training.contract.spec import ExpertSite
from training.parallel.dims import ParallelDims


@dataclass(frozen=True)
class ExpertGroups:
    mesh: DeviceMesh
    """(pp, edp, ep) over every rank: `ep` the neighbouring ranks that split the experts between
    them, `edp` the expert groups' ranks holding the same experts (the expert replicas)."""
    ep: int
    data_parallel: int
    """Data- and context-parallel ranks whose tokens reach an expert's gradient: what it is divided by."""
    replicas: DeviceMesh
    """The ranks holding the same experts, each with tokens of its own: one in each expert group."""
    tp_mesh: DeviceMesh | None = None
    """The TP group, whose ranks split the tokens they share between them (None: tp = 1)."""

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.mesh["ep"].get_group()

    @property
    def ep_rank(self) -> int:
        return self.mesh["ep"].get_local_rank()

    @property
    def tp(self) -> int:
        """The TP ranks that split each experts module's tokens between them."""
        return self.tp_mesh.size() if self.tp_mesh is not None else 1


def expert_groups(dims: ParallelDims, ep: int, device_type: str, tp_mesh: DeviceMesh | None = None) -> ExpertGroups:
    """The expert mesh. A rank is (pp_index x dp·cp + g) x tp + tp_index, g = dp_index x cp +
    cp_index its index among the ranks that hold the same weights; within a stage, its index
    g x tp + tp_index among the dp·cp·tp ranks that route tokens of their own (TP rank t of a TP
    group routes the t-th part of the tokens the group shares: ExpertParallel) is edp_index x ep +
    ep_index: the (pp, dp·cp·tp / ep, ep) mesh in rank order. An expert group is ep neighbouring
    ranks, TP ranks among them (Megatron-Core's folding of the experts' layout apart from the
    attention's, expert tensor-parallel size 1; torchtitan's ep borrows tp the same way): on nodes
    of 8, EP 8 beside TP 2 is one node's ranks, not two nodes' same TP rank. `tp_mesh`: the TP group
    (tp > 1)."""
    from torch.distributed.device_mesh import DeviceMesh

    routing = dims.dp_size * dims.cp * dims.tp
    # Its dimensions ordered (pp, edp, ep): FSDP shards the experts over their replicas (edp) beside
    # ep, and torch composes the two only when the replicas' dimension comes before ep's.
    ranks = torch.arange(dims.pp * routing).reshape(dims.pp, routing // ep, ep)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "edp", "ep"))
    return ExpertGroups(mesh, ep, dims.dp_size * dims.cp, mesh["edp"], tp_mesh if dims.tp > 1 else None)


class AllToAllExperts:
    """Under expert parallelism, the grouped tokens of an experts module: each rank's tokens,
    grouped by expert, go to the rank holding their expert (all-to-all), are regrouped there by
    local expert, run by `run_local(tokens, counts per local expert)`, and come back."""

    def __init__(self, run_local: Callable[[torch.Tensor, list[int]], torch.Tensor], groups: ExpertGroups, local: int):
        self.run_local, self.groups = run_local, groups
        self.local = local
        """Experts a rank holds (read before FSDP gathers them: the shards would say fewer)."""

    def __call__(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ep, local, group = self.groups.ep, self.local, self.groups.ep_group
        send = torch.tensor(counts, dtype=torch.long, device=x.device).view(ep, local)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv.view(-1), send.view(-1), group=group)  # how many of each are coming
        send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        received = _all_to_all(x.new_empty(sum(recv_splits), x.shape[-1]), x, recv_splits, send_splits, group)
        # `received` is by source rank, then by local expert: regroup it by local expert.
        sizes = recv.tolist()
        starts = torch.tensor([0, *sizes_flat(sizes)], device=x.device).cumsum(0)
        perm = torch.cat([torch.arange(int(starts[src * local + e]), int(starts[src * local + e]) + sizes[src][e],
                                       device=x.device) for e in range(local) for src in range(ep)])
        out = self.run_local(received[perm], recv.sum(0).tolist())
        back = out.new_zeros(out.shape).index_copy(0, perm, out)
        return _all_to_all(x.new_empty(sum(send_splits), x.shape[-1]), back, send_splits, recv_splits, group)


class ExpertParallel:
    """An experts module's forward under expert parallelism, for any module the expert plan names
    (training/contract/spec.py's contract: `(tokens, top_k_index, top_k_weights)`, its parameters
    stacked along the experts): the slots grouped by expert, sent to their experts' ranks and back
    (AllToAllExperts), and combined with their weights here. On the rank holding them, the module's
    own forward runs the received tokens, each through its local expert with weight 1, over this
    rank's part of its parameters."""

    def __init__(self, site: ExpertSite, groups: ExpertGroups):
        self.site, self.module = site, site.module
        self.forward = type(site.module).forward
        """The class's forward, called directly: the module's hooks (FSDP's) run once, around this."""
        self.grouped = getattr(type(site.module), "forward_grouped", None)
        """A module that also takes tokens already grouped by expert (`forward_grouped(tokens,
        counts)`, the built-in GroupedExperts) is called so: its own forward would group them again,
        holding copies of them for backward (tests/dist/test_memory_budget.py, predicted over
        measured peak at ep=2: ddp 0.98 and zero3 0.93 called so, 0.95 and 0.89 through forward)."""
        self.local = site.n_experts // groups.ep
        self.exchange = AllToAllExperts(self._run_local, groups, self.local)

    def __call__(self, tokens: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tp = self.exchange.groups.tp
        if tp > 1:  # this TP rank's part of the tokens the TP group shares
            tp_mesh = self.exchange.groups.tp_mesh
            group, rank = tp_mesh.get_group(), tp_mesh.get_local_rank()
            sizes = [len(part) for part in torch.arange(tokens.shape[0]).tensor_split(tp)]
            tokens, top_k_weights = (_TokenPart.apply(t, sizes, rank, group) for t in (tokens, top_k_weights))
            top_k_index = top_k_index.split(sizes)[rank]
        slots = group_by_expert(top_k_index, self.site.n_experts, tokens, capacity_factor_of(self.module))
        routed = self.exchange(tokens[slots.token], slots.counts)
        out = slots.combine(routed, top_k_weights, tokens)
        return _TokenWhole.apply(out, sizes, rank, group) if tp > 1 else out

    def _run_local(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        with _local_parameters(self.module, self.site.weights):
            if self.grouped is not None:
                out = self.grouped(self.module, x, counts)
            else:
                index = torch.repeat_interleave(torch.arange(self.local, device=x.device),
                                                torch.tensor(counts, device=x.device)).unsqueeze(-1)
                out = self.forward(self.module, x, index, torch.ones(index.shape, dtype=x.dtype, device=x.device))
            # The output made to depend on `x` and on every local expert, even one that got no
            # token: a rank whose experts got none still runs the all-to-all's backward its peers
            # wait in, and every expert has a gradient (zeros) for its replicas to reduce.
            anchor = x.sum() + sum(getattr(self.module, n).sum() for n in self.site.weights)
        return out + 0.0 * anchor.to(out.dtype)


def _gather_parts(part: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Every TP rank's part (sizes[t] rows on rank t) concatenated in rank order, on every rank;
    padded to the largest for the collective (gloo gathers equal sizes)."""
    most = max(sizes)
    padded = part.new_zeros(most, *part.shape[1:])
    padded[:part.shape[0]] = part
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])


class _TokenPart(torch.autograd.Function):
    """A TP rank's part of tokens every TP rank holds alike; backward gathers the parts' gradients,
    so every rank's gradient of the whole is the whole's (Megatron's scatter-to-TP-region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], rank: int, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.sizes, ctx.group = sizes, group
        return x.split(sizes)[rank].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return _gather_parts(grad, ctx.sizes, ctx.group), None, None, None


class _TokenWhole(torch.autograd.Function):
    """The TP ranks' parts gathered into the whole on every rank; backward keeps this rank's part
    of the gradient, alike on every rank as the whole's consumers are (Megatron's
    gather-from-TP-region)."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, sizes: list[int], rank: int, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.sizes, ctx.rank = sizes, rank
        return _gather_parts(part, sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return grad.split(ctx.sizes)[ctx.rank].contiguous(), None, None, None


@contextlib.contextmanager
def _local_parameters(module: nn.Module, names: tuple[str, ...]) -> Iterator[None]:
    """`module`'s DTensor parameters `names` seen by its forward as this rank's part (differentiable
    to_local: their gradients reach the DTensors), as torch.func.functional_call swaps them."""
    saved = {n: module._parameters[n] for n in names}
    try:
        for n, p in saved.items():
            module._parameters[n] = local_part(p)
        yield
    finally:
        module._parameters.update(saved)


def _all_to_all(output: torch.Tensor, x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    """torch's differentiable all_to_all_single (its backward sends the gradients back). torch marks
    it deprecated in favour of its functional collectives (not tried on gloo here); the warning is
    silenced here rather than logged at every call in every rank's log."""
    import warnings

    from torch.distributed.nn.functional import all_to_all_single

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return all_to_all_single(output, x, output_splits, input_splits, group)


def sizes_flat(sizes: list[list[int]]) -> list[int]:
    return [n for row in sizes for n in row]


def apply_ep(sites: list[ExpertSite], groups: ExpertGroups) -> None:
    """Every experts module's parameters as DTensors sharded along the experts over the `ep` ranks
    (each rank computes with its own E/ep), tokens sent to them by all-to-all (ExpertParallel). As
    DTensors, a model built on the meta device is initialised whole and cut
    (training/parallel/materialize.py), FSDP shards them further over their replicas, DCP saves them
    under the whole model's names, and the gradient norm sums the ranks' shares."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep_mesh = groups.mesh["ep"]
    for site in sites:
        if site.n_experts % groups.ep:
            raise ValueError(f"strategy.ep={groups.ep} must divide the {site.n_experts} experts of {site.name}")
        module = site.module
        for attr in site.weights:
            whole = getattr(module, attr)
            split = distribute_tensor(whole.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(module, attr, nn.Parameter(split, requires_grad=whole.requires_grad))
        if hasattr(module, "num_experts"):  # Hugging Face's experts count their own (E/ep here)
            module.num_experts = site.n_experts // groups.ep
        module.forward = ExpertParallel(site, groups)


def expert_params(sites: list[ExpertSite]) -> list[nn.Parameter]:
    """The experts' parameters (each rank's own share under expert parallelism)."""
    return [getattr(site.module, n) for site in sites for n in site.weights]
def reduce_expert_grads(params: list[nn.Parameter], groups: ExpertGroups) -> Callable[[], None]:
    """After the step's last backward, under DDP (which leaves them out): each expert gradient
    summed over its replicas and divided by the data-parallel ranks, as DDP averages the rest."""

    def reduce() -> None:
        for p in params:
            if p.grad is None:
                continue
            grad = local_part(p.grad)
            if groups.replicas.size() > 1:
                dist.all_reduce(grad, group=groups.replicas.get_group())
            grad.div_(groups.data_parallel)

    return reduce


def rescale_expert_grads(params: list[nn.Parameter], groups: ExpertGroups) -> Callable[[], None]:
    """After the step's last backward, under FSDP: it averaged each expert gradient over the
    replicas (dp·cp·tp / ep ranks: the TP ranks split the tokens); the average over every
    data-parallel rank is tp/ep of that. (Setting FSDP's divide factor instead needs a
    pre-multiplied sum, which gloo lacks.)"""
    factor = groups.tp / groups.ep

    def rescale() -> None:
        for p in params:
            if p.grad is not None:
                local_part(p.grad).mul_(factor)

    return rescale

