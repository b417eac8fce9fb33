"""MFU's peak: per exact device model and form factor, per precision, TF32 for fp32 when enabled;
an unknown GPU gets none and one warning, a CPU none (device names injected: no GPU here)."""

from __future__ import annotations

import warnings

import pytest
import torch

from training import flops
from training.flops import PEAK_TABLE, peak_column, peak_flops, peak_for_name, set_tf32

T = 1e12


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test starts as a fresh process would: no unknown device warned about yet."""
    monkeypatch.setattr(flops, "_warned", set())


@pytest.mark.parametrize(("name", "bf16", "fp8"), [
    ("NVIDIA H100 80GB HBM3", 989.4, 1978.9),  # SXM
    ("NVIDIA H100 PCIe", 756, 1513),
    ("NVIDIA H100 NVL", 835.5, 1670.5),
    ("NVIDIA H200", 989.4, 1978.9),  # SXM
    ("NVIDIA H200 NVL", 835.5, 1670.5),
    ("NVIDIA GH200 480GB", 989.4, 1978.9),
    ("NVIDIA A100-SXM4-80GB", 312, None),
    ("NVIDIA A100-SXM4-40GB", 312, None),
    ("NVIDIA A100 80GB PCIe", 312, None),
    ("NVIDIA A100-PCIE-40GB", 312, None),
    ("NVIDIA L40S", 362, 733),
    ("NVIDIA L4", 121, 242.5),
])
def test_each_device_name_gets_its_own_form_factors_dense_peaks(name, bf16, fp8):
    assert peak_for_name(name, "bf16", tf32=True) == pytest.approx(bf16 * T)
    assert peak_for_name(name, "fp16", tf32=True) == pytest.approx(bf16 * T)
    row = flops.device_peaks(name)
    assert row is not None and (row.fp8 is None if fp8 is None else row.fp8 == pytest.approx(fp8 * T))


def test_h100_pcie_sxm_and_h200_nvl_differ_in_every_precision():
    for precision, tf32, sxm, pcie, nvl in [("bf16", True, 989.4, 756, 835.5), ("fp16", True, 989.4, 756, 835.5),
                                            ("fp32", True, 494.7, 378, 417.5), ("fp32", False, 67, 51.2, 60)]:
        got = [peak_for_name(n, precision, tf32) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
                                                            "NVIDIA H200 NVL")]
        assert got == pytest.approx([sxm * T, pcie * T, nvl * T]), precision


def test_a_substring_of_a_known_name_is_not_that_device():
    """The old substring match gave every "H100" the SXM figure and "H200 NVL" the H200 SXM's."""
    assert peak_for_name("NVIDIA H200 NVL", "bf16", True) != peak_for_name("NVIDIA H200", "bf16", True)
    assert peak_for_name("NVIDIA L40S", "bf16", True) != peak_for_name("NVIDIA L4", "bf16", True)
    with pytest.warns(UserWarning):
        assert peak_for_name("NVIDIA H100 80GB HBM3 (some future variant)", "bf16", True) is None


def test_fp32_takes_the_tf32_peak_only_when_tf32_matmuls_are_enabled():
    assert peak_column("fp32", tf32=True) == "tf32" and peak_column("fp32", tf32=False) == "fp32"
    assert peak_column("bf16", tf32=False) == "bf16" and peak_column("fp16", tf32=True) == "fp16"
    assert peak_for_name("NVIDIA H100 80GB HBM3", "fp32", tf32=True) == pytest.approx(494.7 * T)
    assert peak_for_name("NVIDIA H100 80GB HBM3", "fp32", tf32=False) == pytest.approx(67 * T)
    assert peak_for_name("NVIDIA A100-SXM4-80GB", "fp32", tf32=True) == pytest.approx(156 * T)
    assert peak_for_name("NVIDIA A100-SXM4-80GB", "fp32", tf32=False) == pytest.approx(19.5 * T)


def test_an_unknown_gpu_gets_no_peak_and_exactly_one_warning_per_process():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # count our own de-duplication, not Python's
        assert peak_for_name("NVIDIA RTX PRO 6000 Blackwell", "bf16", True) is None
        assert peak_for_name("NVIDIA RTX PRO 6000 Blackwell", "fp32", False) is None
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "NVIDIA RTX PRO 6000 Blackwell" in message and "MFU is not reported" in message
    assert "train.peak_flops" in message


def test_a_cpu_has_no_peak_and_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert peak_flops(torch.device("cpu"), "fp32", None, True) is None


def test_the_override_wins_everywhere():
    assert peak_flops(torch.device("cpu"), "bf16", 1e11, True) == 1e11
    assert peak_flops(torch.device("cuda", 0), "fp32", 2e14, False) == 2e14  # no device queried


def test_the_table_is_ordered_most_specific_first_and_every_pattern_is_whole():
    names = [r.pattern for r in PEAK_TABLE]
    assert names.index("NVIDIA H100 NVL") < names.index("NVIDIA H100 80GB HBM3")
    assert names.index("NVIDIA H200 NVL") < names.index("NVIDIA H200")
    assert names.index("NVIDIA L40S") < names.index("NVIDIA L4")
    for row in PEAK_TABLE:
        assert row.bf16 == row.fp16 and row.tf32 == pytest.approx(row.bf16 / 2, rel=0.02) and row.source


def test_set_tf32_sets_both_flags_both_ways_on_cuda_only():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        set_tf32(torch.device("cuda", 0), False)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
        set_tf32(torch.device("cpu"), True)  # a CPU run leaves the flags alone
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
        set_tf32(torch.device("cuda", 0), True)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_train_tf32_is_a_config_key_defaulting_on(compose_cfg):
    assert compose_cfg().train.tf32 is True
    assert compose_cfg("train.tf32=false").train.tf32 is False
