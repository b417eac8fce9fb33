"""The model contract: what any model declares to the trainer and the planner, and how any model is
built and called; apart from the concrete models (training/models/), so that parallel code and the
planner import the contract, not a folder of models.

- calls: a model built from its `_target_`, its loss, a batch through it (forward, batch_loss,
  batch_size, tokens_per_sample, to_device).
- blocks: the repeated blocks (found or declared), the pipeline layout (Hugging Face's
  `base_model_pp_plan` or the model's own), a skipped block's stand-in.
- spec: ModelSpec, the one object the rest reads (model_spec), and the plan strings in Hugging
  Face's style (`base_model_tp_plan`, `sp_plan`, `base_model_ep_plan`) resolved to module names,
  the experts they name and the widths TP divides. A model that breaks the contract is refused
  with common.errors.ContractError.
- experts: the routed slots grouped by expert (the built-in MoE layer's and expert parallelism's
  dispatch), and each expert's slots counted step by step (train's load imbalance).
- hf: how a Hugging Face model meets the contract beyond its declarations (a pipeline stage's
  forward, its experts counted as routed on the meta device).
- weights: a checkpoint read tensor by tensor, shard by shard (a factory's `weights_dir`).
- check: the user's model and data checked before any rank starts (ContractFacts).
"""
