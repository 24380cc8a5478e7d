"""benchmarks/profile_summary.py: the kernel summary that profile_step.py and bench_runner.py's --profile share,
from a stand-in profile (a CPU run has no CUDA kernels): its categories, LoRA-rank GEMMs and top kernels, and
the lines it prints (profile_step.py's output)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import profile_summary

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


@dataclass
class Event:
    """What the summary reads of a ``key_averages`` entry."""

    key: str
    ms: float
    count: int = 1
    device_type: torch.autograd.DeviceType = CUDA
    input_shapes: list[list[int]] = field(default_factory=list)
    is_user_annotation: bool = False

    @property
    def self_device_time_total(self) -> float:  # microseconds
        return self.ms * 1e3


class Profile:
    def __init__(self, kernels: list[Event], ops: list[Event]) -> None:
        self.kernels, self.ops = kernels, ops

    def key_averages(self, group_by_input_shape: bool = False) -> list[Event]:
        return self.ops if group_by_input_shape else self.kernels


LONG = "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<float>>" + "x" * 100
KERNELS = [
    Event("nvjet_sm90_tst_256x128_64x4_1x2_h_badd_coopA_NNT", 120.0, 192),
    Event("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", 30.0, 32),
    Event("_gated_mlp_backward_kernel", 16.0, 32),
    Event(LONG, 6.0, 128),  # 185 characters: 120 in the JSON, 100 printed
    Event("multi_tensor_apply_kernel", 2.0, 3),
    Event("_rms_norm_forward_kernel", 4.0, 65),
    Event("mystery_kernel", 2.0),
    Event("aten::mm", 0.0, 10, device_type=CPU),  # a CPU op: no kernel time
    # the optimizer's record_function range on the GPU timeline: its kernels' time again, not counted
    Event("Optimizer.step#AdamW.step", 2.5, is_user_annotation=True),
]
OPS = [  # grouped by input shape: the rank-16 matmuls count as LoRA GEMMs
    Event("aten::mm", 3.0, 5, CPU, [[4096, 16], [16, 4096]]),
    Event("aten::mm", 9.0, 5, CPU, [[4096, 4096], [4096, 4096]]),
    Event("aten::addmm", 1.5, 2, CPU, [[16], [8, 32], [32, 16]]),
    Event("aten::add", 1.0, 2, CPU, [[16], [16]]),
]


def test_kernel_time_is_summed_by_category_with_the_lora_gemms_and_the_top_kernels() -> None:
    """Each kernel counts once: the device's user annotations (ranges over kernels) are left out."""
    result = profile_summary.summarize(Profile(KERNELS, OPS), top=4)
    assert result["categories_ms"] == {
        "GEMM": 120.0,
        "attention": 30.0,
        "loralei triton (gated act, MLP backward)": 16.0,
        "elementwise / reduce / copy": 6.0,
        "optimizer": 2.0,
        "liger (norm/rope/loss)": 4.0,
        "other": 2.0,
    }
    assert result["total_ms"] == 180.0
    assert result["lora_gemm_ms"] == 4.5
    assert result["top_kernels"] == [
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_badd_coopA_NNT", 120.0, 192),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", 30.0, 32),
        ("_gated_mlp_backward_kernel", 16.0, 32),
        (LONG[:120], 6.0, 128),
    ]


def test_the_summary_prints_profile_steps_lines(capsys) -> None:
    result = {"shape": "llama3-8b", "row": "loralei-fused", "liger": True, "checkpointing": False}
    profile_summary.print_summary(result | profile_summary.summarize(Profile(KERNELS, OPS), top=4))
    assert capsys.readouterr().out.splitlines() == [
        "llama3-8b loralei-fused +liger ckpt=False: 180.0 ms",
        "  GEMM                              120.0 ms   66.7 %",
        "  attention                          30.0 ms   16.7 %",
        "  loralei triton (gated act, MLP backward)     16.0 ms    8.9 %",
        "  elementwise / reduce / copy         6.0 ms    3.3 %",
        "  liger (norm/rope/loss)              4.0 ms    2.2 %",
        "  optimizer                           2.0 ms    1.1 %",
        "  other                               2.0 ms    1.1 %",
        "  (of GEMM: LoRA-rank matmuls 4.5 ms)",
        "      120.00 ms  x192   nvjet_sm90_tst_256x128_64x4_1x2_h_badd_coopA_NNT",
        "       30.00 ms  x32    cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16",
        "       16.00 ms  x32    _gated_mlp_backward_kernel",
        f"        6.00 ms  x128   {LONG[:100]}",
    ]
