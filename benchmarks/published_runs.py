"""The published runs the advisor is held against (benchmarks/published.py): each one's source, the
model's shape, the cluster, the layout and batch that ran, and the throughput its authors report,
as the overrides that make `pipeline=plan` describe it; and the runs that are not rows, with why."""

from __future__ import annotations

from dataclasses import dataclass

from training.expert_gemms import routed_rows

GPT = "model=gpt-7b"  # the built-in GPT factory; its shape set by the row


@dataclass(frozen=True)
class Published:
    source: str
    label: str
    overrides: tuple[str, ...]
    """What makes `pipeline=plan` describe the run: model shape, cluster, world, layout, batch."""
    tokens_per_s_per_gpu: float | None
    """What its authors report; None where they report TFLOP/s instead (`tflops_per_gpu`)."""
    stack: str
    """The software and GPU that ran it: rows of one stack share its achievable fraction of peak,
    which the first of them (its anchor) measures for the others (anchored())."""
    note: str = ""
    tflops_per_gpu: float | None = None
    """Reported model TFLOP/s per GPU: turned into tokens/s with this project's count of the
    model's FLOPs per token, counted on the meta device (6 x parameters' work plus causal
    attention as the fused kernels run it, no recomputation)."""
    memory_gib: float | None = None
    """Reported peak memory per GPU, where the authors give it."""


def gpt(h: int, layers: int, heads: int, vocab: int = 51200, seq: int = 2048) -> tuple[str, ...]:
    return (GPT, f"model.d_model={h}", f"model.n_layers={layers}", f"model.n_heads={heads}",
            f"model.vocab_size={vocab}", f"model.seq_len={seq}", "model.ffn_mult=4")


def llama(h: int, ffn: int, layers: int, heads: int, kv: int, vocab: int, seq: int) -> tuple[str, ...]:
    return ("model=hf-llama3-8b", f"model.hidden_size={h}", f"model.intermediate_size={ffn}",
            f"model.num_hidden_layers={layers}", f"model.num_attention_heads={heads}",
            f"model.num_key_value_heads={kv}", f"model.vocab_size={vocab}", f"model.max_position_embeddings={seq}",
            f"data.seq_len={seq}")


def llama405b(gpus: int, tp: int, cp: int, pp: int, seq: int, global_batch: int, microbatches: int,
              schedule: str, virtual: int, precision: str = "bf16") -> tuple[str, ...]:
    """Llama 3.1 405B (the hf-llama3-405b preset) at `seq` tokens on H100s: TP with sequence
    parallelism, CP, a pipeline of `microbatches` one-sample microbatches, FSDP over the rest, in
    `precision` with full recomputation."""
    return ("model=hf-llama3-405b", f"data.seq_len={seq}", f"model.max_position_embeddings={max(seq, 8192)}",
            "cluster=h100-80g-ndr", f"nodes={gpus // 8}", "strategy=hybrid", "strategy.dp_replicate=1",
            f"strategy.dp_shard={gpus // (tp * cp * pp)}", f"strategy.tp={tp}", f"strategy.cp={cp}", f"strategy.pp={pp}",
            "strategy.sequence_parallel=true", f"train.global_batch={global_batch}", "train.grad_accum=1",
            f"strategy.microbatches={microbatches}", f"strategy.pp_schedule={schedule}",
            f"strategy.pp_virtual_stages={virtual}", f"strategy.precision={precision}", "strategy.activation_checkpointing=full")


def titan_h100_96g(overrides: tuple[str, ...]) -> tuple[str, ...]:
    """torchtitan's H100s (96 GB HBM2e at 500 W), whose peaks it used at up to 88 % of memory
    (84.5 of 96 GiB)."""
    return (*overrides, "cluster.device_memory_gib=96")


HAPPENED = "plan.memory_fraction=0.9"
"""The budget a published run is held to: it ran, so 0.9 of its devices' memory (torchtitan's
405B rows peaked at up to 88 %), not the default 0.7 a new run is planned with."""


def megatron(h: int, layers: int, heads: int, t: int, p: int, d: int, mbs: int, gbs: int) -> tuple[str, ...]:
    """Megatron-LM's layout in this project's terms: a data-parallel replica's share of the global
    batch is one micro-batch split into gbs/(mbs x d) pipeline microbatches (one accumulation step),
    or, without a pipeline, mbs-sample micro-batches accumulated."""
    per_replica = gbs // d
    layout = [f"strategy.dp_replicate={d}", "strategy.dp_shard=1", f"strategy.tp={t}", f"strategy.pp={p}"]
    if p > 1:
        batch = ["train.grad_accum=1", f"strategy.microbatches={per_replica // mbs}", "strategy.pp_schedule=1f1b"]
    else:
        batch = [f"train.grad_accum={per_replica // mbs}"]
    nodes = t * p * d // 8
    return (*gpt(h, layers, heads), "cluster=a100-80g-ib", f"nodes={nodes}", "strategy=hybrid", *layout,
            f"train.global_batch={gbs}", *batch, "strategy.precision=fp16", "strategy.activation_checkpointing=full")


def fsdp(gpus: int, mbs: int, gbs: int, ac: str, cluster: str, precision: str = "bf16") -> tuple[str, ...]:
    return (f"cluster={cluster}", f"nodes={gpus // 8}", "strategy=zero3", f"train.global_batch={gbs}",
            f"train.grad_accum={gbs // (mbs * gpus)}", f"strategy.precision={precision}",
            f"strategy.activation_checkpointing={ac}")


def qwen3_235b(layout: tuple[str, ...], gpus: int = 256) -> tuple[str, ...]:
    """Qwen3-235B-A22B (Hugging Face's Qwen3-MoE at its published config: 94 layers, 4096 wide, 64
    heads of 128 with 4 K/V heads, 128 experts of 1536 a layer, 8 a token) at 4096 tokens on `gpus`
    H100s in bf16 with sequence parallelism, global batch 2048, the rest as `layout` says."""
    return ("model=hf-qwen3-moe", "model.hidden_size=4096", "model.intermediate_size=12288",
            "model.moe_intermediate_size=1536", "model.num_hidden_layers=94", "model.num_attention_heads=64",
            "model.num_key_value_heads=4", "+model.head_dim=128", "model.num_local_experts=128",
            "model.num_experts_per_tok=8", "model.vocab_size=151936", "model.max_position_embeddings=4096",
            "data.seq_len=4096", "cluster=h100-80g-ndr", f"nodes={gpus // 8}", "strategy.sequence_parallel=true",
            "train.global_batch=2048", "strategy.precision=bf16", *layout)


def megatron_pp8(tp: int, ep: int, microbatches: int, ac: str) -> tuple[str, ...]:
    """Megatron-Core's pipelined MoE layout in this project's terms: the distributed optimizer
    (zero1) over the rest, PP 8 with 4 virtual stages a rank (interleaved 1F1B), one accumulation
    step of `microbatches` one-sample microbatches."""
    return ("strategy=zero1", f"strategy.tp={tp}", "strategy.pp=8", f"strategy.ep={ep}", "train.grad_accum=1",
            f"strategy.microbatches={microbatches}", "strategy.pp_schedule=interleaved_1f1b",
            "strategy.pp_virtual_stages=4", f"strategy.activation_checkpointing={ac}")


QWEN3_ROWS = {"tp2": routed_rows(1 * 4096 // 2, 8, 128, 32), "tp4": routed_rows(1 * 4096 // 4, 8, 128, 8)}
"""Rows each expert's GEMMs run a micro-batch in the TP 2 EP 32 row (as in the FSDP 128 x TP 2 EP 8
row's 4 x 4096 tokens over TP 2 at EP 8) and the TP 4 EP 8 row: a rank's routed tokens (micro-batch x
sequence / tp) x top-k x ep over the experts."""

SC21 = "Narayanan et al. 2021 (SC'21, arXiv 2104.04473), Table 1; MBS from examples/sc21/run_table_1.sh"
MPT = "mosaicml/llm-foundry scripts/train/benchmarking/README.md (2024-04), H100 80GB, bf16, FSDP"
MPT_A100 = "mosaicml/llm-foundry scripts/train/benchmarking/README.md (2024-04), A100 80GB, bf16, FSDP"
IBM = "PyTorch blog 'Maximizing training throughput using PyTorch FSDP' (IBM/Meta, 2024-03), A100 80GB"
TITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (2024-12), H100, FSDP bf16"
TITAN_TP = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, vanilla TP, bf16, compile"

MOE_ZOO = ("NVIDIA Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md (Megatron-Core main 1e057005), 256 H100, "
           "bf16, seq 4096, GBS 2048, DeepEP dispatcher")
MOE_ZOO_NOTE = ("tokens/s from the published step time; DeepEP's fused dispatch there (NVLink-tuned kernels), torch's "
                "all_to_all_single here; Megatron's fused MoE kernels (grouped GEMM, permute) there")

LLAMA3 = ("Grattafiori et al. 2024 (The Llama 3 Herd of Models, arXiv 2407.21783), Table 4; H100 80GB at 700 W, "
          "bf16; 16M tokens per step")
LLAMA3_NOTE = ("tokens/s from the published TFLOP/s with this project's FLOP count; Meta's interleaved schedule "
               "as torch's with 2 stages per rank; recomputation not stated, full here (HF Llama's activations need "
               "it at this layout)")
TITAN_405 = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (2024-12), H100 96GB at 500 W, Float8 "
             "linears, torch.compile, AsyncTP, full recomputation")

ROWS = [
    Published(SC21, "GPT 1.7B, 32 A100, t1 p1 d32", megatron(2304, 24, 24, 1, 1, 32, 16, 512), 9290, "Megatron-LM 2021, A100",
              "tokens/s derived from the published 137 TFLOP/s with the paper's Eq. 3 (includes recomputation)"),
    Published(SC21, "GPT 3.6B, 64 A100, t2 p1 d32", megatron(3072, 30, 32, 2, 1, 32, 16, 512), 4430, "Megatron-LM 2021, A100", "as above"),
    Published(SC21, "GPT 7.5B, 128 A100, t4 p1 d32", megatron(4096, 36, 32, 4, 1, 32, 16, 512), 2220, "Megatron-LM 2021, A100", "as above"),
    Published(SC21, "GPT 18.4B, 256 A100, t8 p1 d32", megatron(6144, 40, 48, 8, 1, 32, 8, 1024), 872, "Megatron-LM 2021, A100", "as above"),
    Published(SC21, "GPT 39.1B, 512 A100, t8 p2 d32", megatron(8192, 48, 64, 8, 2, 32, 4, 1536), 425, "Megatron-LM 2021, A100",
              "as above; non-interleaved in the script"),
    Published(MPT, "MPT 7B, 128 H100, FSDP, mbs 6, no AC", (*gpt(4096, 32, 32, 50368), *fsdp(128, 6, 768, "none",
              "h100-80g-ndr")), 10475, "llm-foundry, H100"),
    Published(MPT, "MPT 13B, 128 H100, FSDP, mbs 16, AC", (*gpt(5120, 40, 40, 50368), *fsdp(128, 16, 2048, "full",
              "h100-80g-ndr")), 5080, "llm-foundry, H100"),
    Published(MPT, "MPT 30B, 128 H100, FSDP, mbs 8, AC", (*gpt(7168, 48, 56, 50368), *fsdp(128, 8, 1024, "full",
              "h100-80g-ndr")), 2199, "llm-foundry, H100"),
    Published(MPT, "MPT 70B, 128 H100, FSDP, mbs 8, AC", (*gpt(8192, 80, 64, 50368), *fsdp(128, 8, 1024, "full",
              "h100-80g-ndr")), 1058, "llm-foundry, H100"),
    Published(MPT_A100, "MPT 7B, 8 A100, FSDP, mbs 6, no AC", (*gpt(4096, 32, 32, 50368), *fsdp(8, 6, 96, "none",
              "a100-80g-ib")), 4641, "llm-foundry, A100"),
    Published(IBM, "Llama 2 7B, 128 A100, FSDP, bs 2, no AC", (*llama(4096, 11008, 32, 32, 32, 32000, 4096),
              *fsdp(128, 2, 256, "none", "a100-80g-ib")), 3700, "FSDP (IBM), A100"),
    Published(IBM, "Llama 2 70B, 128 A100, FSDP, bs 2, full AC", (*llama(8192, 28672, 80, 64, 8, 32000, 4096),
              *fsdp(128, 2, 256, "full", "a100-80g-ib")), 370, "FSDP (IBM), A100"),
    Published(TITAN, "Llama 3.1 8B, 128 H100, FSDP, bs 2", (*llama(4096, 14336, 32, 32, 8, 128256, 8192),
              *fsdp(128, 2, 256, "full", "h100-80g-ndr")), 5605, "torchtitan, H100",
              "selective recomputation there, full here; H100s at 500 W"),
    Published(TITAN_TP, "Llama 3 70B, 256 H100, FSDP 32 x TP 8, bs 16", (
        *llama(8192, 28672, 80, 64, 8, 128256, 8192), "cluster=h100-80g-ndr", "nodes=32", "strategy=hybrid",
        "strategy.dp_replicate=1", "strategy.dp_shard=32", "strategy.tp=8", "strategy.pp=1", "strategy.sequence_parallel=true",
        "train.global_batch=512", "train.grad_accum=1", "strategy.precision=bf16", "strategy.activation_checkpointing=full"),
        597.3, "torchtitan, H100", "torch.compile there; a vocabulary-parallel loss there and here (the head's "
        "16 x 8192 x 128256 logits split over TP); H100s at 500 W"),
    # In the source's order (its first row, the stack's anchor, the cross-node one).
    Published(MOE_ZOO, "Qwen3-235B-A22B, 256 H100, TP 2 PP 8 (VPP 4) DP 16, EP 32 across nodes", qwen3_235b(megatron_pp8(2, 32, 128, "selective")),
              2048 * 4096 / 19.7 / 256, "Megatron-Core MoE, H100",
              f"the cross-node EP row: EDP 1, ETP 1, the distributed optimizer (zero1), MBS 1, 19.7 s a step "
              f"(245 TFLOP/s); its recomputation of the norms and the MoE activation as `selective` here; "
              f"{MOE_ZOO_NOTE}; predicted not to fit, as the TP 4 row below, for Hugging Face's activations"),
    Published(MOE_ZOO, "Qwen3-235B-A22B, 256 H100, FSDP 128 x TP 2, EP 8, mbs 4", qwen3_235b((
              "strategy=hybrid", "strategy.dp_replicate=1", "strategy.dp_shard=128", "strategy.tp=2", "strategy.pp=1",
              "strategy.ep=8", "train.grad_accum=4", "strategy.activation_checkpointing=full")),
              2048 * 4096 / 17.6 / 256, "Megatron-Core MoE, H100",
              f"the intra-node EP row: EDP 32, ETP 1, Megatron FSDP, full recomputation, 17.6 s a step (276 TFLOP/s); "
              f"{MOE_ZOO_NOTE}"),
    Published(MOE_ZOO, "Qwen3-235B-A22B, 256 H100, TP 4 PP 8 (VPP 4) DP 8, EP 8", qwen3_235b(megatron_pp8(4, 8, 256, "none")),
              2048 * 4096 / 29.0 / 256, "Megatron-Core MoE, H100",
              f"EDP 4, ETP 1, the distributed optimizer (zero1), MBS 1, no recomputation, 29.0 s a step (167 TFLOP/s); "
              f"94 layers over 32 virtual stages (uneven there as here); {MOE_ZOO_NOTE}; each expert's GEMMs run "
              f"{QWEN3_ROWS['tp4']:,} routed rows a micro-batch here against {QWEN3_ROWS['tp2']:,} in the two rows "
              f"above (1 x 4096 tokens over TP 4, 8 slots a token, EP 8 of 128 experts), the small-expert loss "
              f"the preset's one GEMM efficiency does not price (a plan on a real device measures it per ep and "
              f"notes it; a what-if has no device to time); Hugging Face's "
              f"Qwen3-MoE layer saves 1.9 GB a sample per layer without recomputation here (its experts 1.15 GB: "
              f"every routed slot's input, gate/up output, activation and product), more than Megatron's grouped "
              f"GEMM with fused permutation: predicted not to fit"),
    Published(LLAMA3, "Llama 3 405B, 8,192 H100, TP 8 PP 16 DP 64, seq 8K", llama405b(8192, 8, 1, 16, 8192, 2048, 32,
              "interleaved_1f1b", 2), None, "Llama 3 (Meta), H100", LLAMA3_NOTE, tflops_per_gpu=430),
    Published(LLAMA3, "Llama 3 405B, 16,384 H100, TP 8 PP 16 DP 128, seq 8K", llama405b(16384, 8, 1, 16, 8192, 2048, 16,
              "interleaved_1f1b", 2), None, "Llama 3 (Meta), H100", "as above", tflops_per_gpu=400),
    Published(LLAMA3, "Llama 3 405B, 16,384 H100, TP 8 CP 16 PP 16 DP 8, seq 128K", llama405b(
              16384, 8, 16, 16, 131072, 128, 16, "interleaved_1f1b", 2), None, "Llama 3 (Meta), H100",
              "as above; K/V all-gathered, as Meta's CP did", tflops_per_gpu=380),
    Published(TITAN_405, "Llama 3.1 405B, 512 H100, FSDP 8 TP 8 PP 8, interleaved 1F1B", titan_h100_96g(llama405b(
              512, 8, 1, 8, 8192, 256, 32, "interleaved_1f1b", 2, "fp8")), 128, "torchtitan Float8, H100",
              "Table 5; 2 stages per rank assumed", memory_gib=72.7),
    Published(TITAN_405, "Llama 3.1 405B, 512 H100, FSDP 8 TP 8 PP 8, 1F1B", titan_h100_96g(llama405b(
              512, 8, 1, 8, 8192, 256, 32, "1f1b", 1, "fp8")), 100, "torchtitan Float8, H100", "Table 5", memory_gib=82.5),
    *(Published(TITAN_405, f"Llama 3.1 405B, 512 H100, FSDP {8 // cp} CP {cp} TP 8 PP 8, seq {seq // 1024}K",
                titan_h100_96g(llama405b(512, 8, cp, 8, seq, 8 * (8 // cp), 8, "1f1b", 1, "fp8")), tps,
                "torchtitan Float8, H100", "Table 6", memory_gib=mem)
      for cp, seq, tps, mem in ((1, 32768, 76, 75.3), (2, 65536, 47, 75.9), (4, 131072, 31, 77.1), (8, 262144, 16, 84.9))),
    *(Published(TITAN_405, f"Llama 3.1 8B, 8 H100, FSDP {8 // cp} CP {cp}, seq {seq // 1024}K", titan_h100_96g((
                *llama(4096, 14336, 32, 32, 8, 128256, seq), "cluster=h100-80g-ndr", "nodes=1", "strategy=hybrid",
                "strategy.dp_replicate=1", f"strategy.dp_shard={8 // cp}", "strategy.tp=1", f"strategy.cp={cp}",
                "strategy.pp=1", f"train.global_batch={8 // cp}", "train.grad_accum=1", "strategy.precision=fp8",
                "strategy.activation_checkpointing=full")), tps, "torchtitan Float8, H100",
                "Table 2; local batch 1", memory_gib=mem)
      for cp, seq, tps, mem in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2), (4, 131072, 1071, 84.0),
                                (8, 262144, 548, 84.5))),
    *(Published(TITAN_405, f"Llama 3.1 8B, {gpus} H100, FSDP, bs 2, Float8", titan_h100_96g((
                *llama(4096, 14336, 32, 32, 8, 128256, 8192), *fsdp(gpus, 2, 2 * gpus, "selective", "h100-80g-ndr",
                                                                      "fp8"))), tps, "torchtitan Float8, H100",
                f"Table {table}; selective recomputation", memory_gib=mem)
      for table, gpus, tps, mem in ((1, 8, 8532, 76.8), (3, 128, 8380, 61.8))),
    Published(TITAN_405, "Llama 3.1 70B, 256 H100, FSDP 32 TP 8, bs 16, Float8", titan_h100_96g((
        *llama(8192, 28672, 80, 64, 8, 128256, 8192), "cluster=h100-80g-ndr", "nodes=32", "strategy=hybrid",
        "strategy.dp_replicate=1", "strategy.dp_shard=32", "strategy.tp=8", "strategy.pp=1", "strategy.sequence_parallel=true",
        "train.global_batch=512", "train.grad_accum=1", "strategy.precision=fp8", "strategy.activation_checkpointing=full")),
        829, "torchtitan Float8, H100", "Table 4, without AsyncTP (876 with it)", memory_gib=71.9),
]


OUT_OF_REACH = (
    ("Mixtral 8x7B, Megatron-Core v0.9: 468 TFLOP/s per H100 in bf16",
     "https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/transformer/moe/README.md",
     "the README gives the number without its layout, sequence length or batch, and a row needs all of them "
     "(the model's shape is `model=gpt-moe-8x7b`); the layouts quoted for it elsewhere are third-party summaries"),
    ("DeepSeek-V3: 2,048 H800, PP 16, EP 64 across 8 nodes, ZeRO-1 data parallelism, FP8; 180K H800 GPU-hours per "
     "trillion tokens (1,543 tokens/s per GPU)",
     "https://arxiv.org/abs/2412.19437",
     "not a row: the stack is not comparable. It trains in FP8 on H800s with DualPipe: its FP8 scales "
     "tiles of 1 x 128 and 128 x 128 where this project's scales whole tensors (and leaves a mixture's "
     "layers in bf16), dualpipev runs with pp alone, not beside data parallelism, and "
     "there is no H800 preset (its NVLink is 400 GB/s); `model=gpt-moe-v3` has its shape without multi-head "
     "latent attention, the shared expert, the 3 dense first layers or multi-token prediction. Its layout is "
     "held as a what-if on 2,048 H100s (`model=gpt-moe-v3 nodes=256 train.global_batch=16384 strategy=zero1 "
     "strategy.pp=16 strategy.ep=64 strategy.pp_schedule=1f1b strategy.microbatches=128 strategy.precision=fp8 "
     "strategy.activation_checkpointing=full`): 2.46 M tokens/s predicted (0.78 of the published 3.16 M; its "
     "experts run in bf16 here, as this trainer's fp8 leaves a mixture's layers), 26.5 GiB per device, 0.88 of "
     "the recommendation; docs/strategies.md has the what-if in bf16"),
    ("Qwen3-235B-A22B, Megatron-Core: the A2A row (TP 2 EP 8 PP 32 VPP 3 DP 4: 24.2 s, 200 TFLOP/s) and the "
     "cross-node EP row with 1F1B overlap (17.6 s, 276 TFLOP/s)",
     "https://github.com/yanring/Megatron-MoE-ModelZoo (best_practice/Qwen3/readme.md)",
     "the A2A row cuts 94 layers into 96 virtual stages (Megatron counts the embedding and the loss as pipeline "
     "layers), and a stage here holds at least one block; the overlapped row hides one microbatch's "
     "all-to-alls behind another's compute inside 1F1B, which this project's schedules do not do (its row "
     "without the overlap is in the table)"),
)
