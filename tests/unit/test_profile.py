"""The step's time split: on CUDA each kernel, memcpy and memset once, by kernel name (operator rows
and host-only work left out); on CPU operators' self time. GPU rows are injected: no GPU here."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.autograd import DeviceType

from training.profile import KERNEL_KINDS, StepProfiler, kind_of, summarize

CUDA, CPU = DeviceType.CUDA, DeviceType.CPU


@dataclass(frozen=True)
class Row:
    """The fields of torch's FunctionEventAvg that the split reads."""

    key: str
    device_type: DeviceType
    self_device_time_total: float = 0.0
    self_cpu_time_total: float = 0.0
    is_user_annotation: bool = False
    is_legacy: bool = False


def by_kind(split) -> dict[str, float]:
    return {s.kind: s.ms_per_step for s in split}


def test_an_operator_and_its_kernel_count_once_on_cuda():
    rows = [Row("aten::mm", CPU, self_device_time_total=400, self_cpu_time_total=30),  # its kernel's time
            Row("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", CUDA, 400)]
    assert by_kind(summarize(rows, steps=2, on_gpu=True)) == {"matmul": pytest.approx(0.2)}


def test_host_only_operators_are_not_gpu_time():
    rows = [Row("Optimizer.step#AdamW.step", CPU, self_cpu_time_total=5000),
            Row("aten::copy_", CPU, self_cpu_time_total=900),
            Row("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", CUDA, 300),
            Row("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", CUDA, 100)]
    split = summarize(rows, steps=1, on_gpu=True)
    assert by_kind(split) == {"communication": pytest.approx(0.3), "other": pytest.approx(0.1)}
    assert [s.percent for s in split] == pytest.approx([75.0, 25.0])


def test_a_user_annotations_gpu_span_is_not_added_to_the_kernels_inside_it():
    rows = [Row("## forward ##", CUDA, 1000, is_user_annotation=True), Row("ampere_bf16_s16816gemm_bf16_128x256_ldg8",
                                                                            CUDA, 600)]
    assert by_kind(summarize(rows, steps=1, on_gpu=True)) == {"matmul": pytest.approx(0.6)}


@pytest.mark.parametrize(("kernel", "kind"), [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "communication"),
    ("ncclKernel_AllGather_RING_LL_Sum_int8_t", "communication"),
    ("ncclDevKernel_SendRecv", "communication"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x256_ldg8_f2f_stages_64x3_tn", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "matmul"),
    ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>", "matmul"),
    ("void flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64>>", "matmul"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "matmul"),
    ("Memcpy HtoD (Pageable -> Device)", "memcpy"),
    ("Memcpy DtoD (Device -> Device)", "memcpy"),
    ("Memset (Device)", "memcpy"),
    ("void at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)", "memcpy"),
    # Operator needles would misfire on kernels' template text ("cat" in scatter).
    ("void at::native::_scatter_gather_elementwise_kernel<128, 4>", "other"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t>>", "other"),
])
def test_kernels_are_classified_by_their_own_names(kernel, kind):
    assert kind_of(kernel, KERNEL_KINDS) == kind


def test_on_cpu_operators_self_cpu_time_is_the_split():
    rows = [Row("aten::mm", CPU, self_cpu_time_total=3000), Row("aten::addmm", CPU, self_cpu_time_total=1000),
            Row("gloo:all_reduce", CPU, self_cpu_time_total=2000), Row("aten::add_", CPU, self_cpu_time_total=2000)]
    assert by_kind(summarize(rows, steps=2, on_gpu=False)) == {
        "matmul": pytest.approx(2.0), "communication": pytest.approx(1.0), "other": pytest.approx(1.0)}


def test_a_real_cpu_profile_splits_its_step_with_matmul_in_it():
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    profiler = StepProfiler(first=0, count=2, device=torch.device("cpu"))
    profiler.start()
    for _ in range(2):
        (a @ b).relu_().sum()
    profiler.stop()
    kinds = by_kind(profiler.split)
    assert kinds["matmul"] > 0 and set(kinds) <= {"matmul", "memcpy", "communication", "other"}
    assert sum(s.percent for s in profiler.split) == pytest.approx(100.0)
