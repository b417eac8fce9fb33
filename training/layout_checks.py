"""A layout held against the model before anything starts: the strategy's degrees, schedule and
microbatches against what the model declared (training/contract/check.py's ContractFacts). Each problem is
one ConfigError naming the key, the value and what is allowed. The engine (pipelines/validate.py)
calls these with the pieces of the config they read, never the whole config."""

from __future__ import annotations

from common.errors import ConfigError
from training.config import StrategyConfig
from training.contract.check import ContractFacts
from training.parallel.dims import ParallelDims, expert_parallel_problem
from training.parallel.schedules import checkpointing_problem, data_parallel_problem, microbatches_problem


def check_layout(s: StrategyConfig, dims: ParallelDims, facts: ContractFacts, model: str, data: str) -> None:
    """The degrees of strategy `s` against what `model` (trained on `data`) declares it can be split
    into; a ConfigError naming the key otherwise."""
    if dims.tp > 1:
        if facts.tp_plan is None:
            raise ConfigError("strategy.tp", dims.tp, f"model={model} has no tensor-parallel plan: give model.tp_plan "
                              "(module-name pattern -> colwise/rowwise), or use ddp, zero1/2/3 or pp")
        if facts.tp_problem is not None:
            raise ConfigError("strategy.tp", dims.tp, facts.tp_problem)
        for what, size in facts.tp_sizes.items():
            if size % dims.tp:
                raise ConfigError("strategy.tp", dims.tp, f"must divide {what}={size} of model={model}")
    if dims.pp > 1:
        if facts.pipeline_problem is not None:
            raise ConfigError("strategy.pp", dims.pp, facts.pipeline_problem)
        if facts.item == "dict":
            raise ConfigError("strategy.pp", dims.pp, f"pipeline stages pass (input, target) batches; data={data} "
                              "gives dicts: use ddp, zero1/2/3 or tp")
        if dims.pp > facts.blocks:
            raise ConfigError("strategy.pp", dims.pp, f"more pipeline stages than the {facts.blocks} blocks of "
                              f"model={model}")
        problem = (data_parallel_problem(s.pp_schedule, dims.world_size // (dims.pp * dims.tp))
                   or checkpointing_problem(s.pp_schedule, s.activation_checkpointing))
        if problem is not None:
            raise ConfigError("strategy.pp_schedule", s.pp_schedule, problem)
        if dims.pp * s.pp_virtual_stages > facts.blocks:
            raise ConfigError("strategy.pp_virtual_stages", s.pp_virtual_stages, f"pp x pp_virtual_stages = "
                              f"{dims.pp * s.pp_virtual_stages} stages, more than the {facts.blocks} blocks of "
                              f"model={model}")
    if s.activation_checkpointing != "none" and facts.blocks == 0:
        raise ConfigError("strategy.activation_checkpointing", s.activation_checkpointing, f"model={model} has no "
                          "repeated blocks to checkpoint: name them with model.blocks=<dotted path of the list>")
    if s.sequence_parallel and dims.tp > 1 and facts.sp_problem is not None:
        raise ConfigError("strategy.sequence_parallel", True, facts.sp_problem)
    if dims.cp > 1:
        _check_cp(dims.cp, facts, model, data)
    problem = facts.ep_problem if s.ep > 1 else None
    problem = problem or expert_parallel_problem(dims, facts.experts)
    if problem is not None:
        raise ConfigError("strategy.ep", s.ep, problem)


def _check_cp(cp: int, facts: ContractFacts, model: str, data: str) -> None:
    """Context parallelism splits token sequences and the attention that goes through
    torch.nn.functional.scaled_dot_product_attention (training/parallel/cp.py)."""
    if facts.item == "dict":
        raise ConfigError("strategy.cp", cp, f"splits (input, target) token batches; data={data} gives dicts "
                          "(labels shifted inside the model, across the split): use cp=1")
    if facts.tokens_per_sample <= 1:
        raise ConfigError("strategy.cp", cp, f"splits sequences, and the inputs of data={data} have no sequence "
                          "dimension (not integer token ids): use cp=1")
    if facts.attention_calls == 0:
        raise ConfigError("strategy.cp", cp, f"model={model} never calls torch.nn.functional."
                          "scaled_dot_product_attention, the attention context parallelism splits: use cp=1")
    if not facts.takes_position_ids:
        raise ConfigError("strategy.cp", cp, f"model={model}'s forward takes no position_ids, and each rank holds "
                          "tokens of other positions than 0..t-1: add position_ids= (Hugging Face's convention)")
    if facts.tokens_per_sample % (2 * cp):
        raise ConfigError("strategy.cp", cp, f"model={model} trains on sequences of {facts.tokens_per_sample} "
                          f"tokens (seq_len), which must be a multiple of 2 x cp = {2 * cp}: each rank takes "
                          f"chunks i and {2 * cp}-1-i of {2 * cp} equal chunks")


def check_microbatches(s: StrategyConfig, dims: ParallelDims, micro: int) -> None:
    """A pipeline's microbatches against the micro-batch and the schedule's rules (torch 2.13's)."""
    if dims.pp > 1 and micro % s.microbatches:
        raise ConfigError("strategy.microbatches", s.microbatches, f"must divide the micro-batch of {micro} samples")
    problem = microbatches_problem(s.pp_schedule, dims.pp, s.pp_virtual_stages, s.microbatches)
    if problem is not None:
        raise ConfigError("strategy.microbatches", s.microbatches, problem)
