"""benchmarks/profile_summary.py: the kernel summary that profile_step.py and bench_runner.py's --profile
share, from a stand-in profile (a CPU run has no CUDA kernels): its categories, LoRA-rank GEMMs and top
kernels, and the lines it prints (profile_step.py's output); the host's side of a CPU profile (its ops, its
syncs); and the script that prints saved summaries."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

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


@dataclass
class Span:
    start: float
    end: float


@dataclass
class TimedEvent:
    """What device_gaps reads of a ``prof.events()`` entry (times in microseconds)."""

    name: str
    start: float
    end: float
    device_type: torch.autograd.DeviceType = CUDA
    is_user_annotation: bool = False

    @property
    def time_range(self) -> Span:
        return Span(self.start, self.end)


class Timeline:
    def __init__(self, events: list[TimedEvent]) -> None:
        self._events = events

    def events(self) -> list[TimedEvent]:
        return self._events


def test_device_gaps_are_the_idle_spans_between_the_union_of_device_events() -> None:
    """Overlapping events on two streams leave no gap; a host op and a user annotation (which spans its kernels
    and the gaps between them) are not device work."""
    timeline = Timeline(
        [
            TimedEvent("gemm", 0, 100),
            TimedEvent("Memcpy DtoH", 50, 300),  # a side stream: covers gemm's end and the next gap
            TimedEvent("norm", 305, 310),  # 5 us after the copy
            TimedEvent("Optimizer.step#AdamW.step", 310, 2000, is_user_annotation=True),
            TimedEvent("aten::mm", 310, 900, device_type=CPU),
            TimedEvent("add", 360, 370),  # 50 us
            TimedEvent("adam", 1870, 1900),  # 1.5 ms
            TimedEvent("tiny", 1880, 1890),  # inside adam
            TimedEvent("loss", 2100, 2110),  # 200 us after adam (tiny ended first)
        ]
    )
    gaps = profile_summary.device_gaps(timeline, top=2)
    assert gaps["gaps_by_length"] == {
        "0-10 us": {"count": 1, "ms": 0.005},
        "10-100 us": {"count": 1, "ms": 0.05},
        "100-1000 us": {"count": 1, "ms": 0.2},
        ">=1000 us": {"count": 1, "ms": 1.5},
    }
    assert gaps["idle_ms"] == pytest.approx(1.755)
    assert gaps["longest_gaps"] == [(1500, "add", "adam"), (200, "adam", "loss")]
    assert profile_summary.device_gaps(Timeline([]))["idle_ms"] == 0.0


def test_compute_gaps_leave_out_host_copies_and_place_each_gap_in_the_span() -> None:
    """A copy on a side stream does not hide a kernel's wait; each gap's time falls in the tenths it covers."""
    timeline = Timeline(
        [
            TimedEvent("gemm", 0, 100),
            TimedEvent("Memcpy DtoH (Device -> Pinned)", 100, 400),  # the next kernel waited for it
            TimedEvent("norm", 400, 500),
            TimedEvent("Memcpy HtoD (Pinned -> Device)", 500, 700),
            TimedEvent("loss", 750, 1000),
            TimedEvent("Optimizer.step", 0, 1000, is_user_annotation=True),
        ]
    )
    gaps = profile_summary.compute_gaps(timeline, top=1)
    assert gaps["compute_idle_ms"] == pytest.approx(0.55)
    assert gaps["compute_idle_by_part"] == pytest.approx([0, 0.1, 0.1, 0.1, 0, 0.1, 0.1, 0.05, 0, 0])
    assert gaps["compute_longest_gaps"] == [(300, 0.1, "gemm", "norm")]
    assert profile_summary.device_gaps(timeline)["idle_ms"] == pytest.approx(0.05)  # the copies count there
    empty = profile_summary.compute_gaps(Timeline([]))
    assert empty["compute_idle_ms"] == 0 and empty["compute_idle_by_part"] == [0.0] * 10


def test_host_to_device_copies_split_into_hidden_and_exposed_time() -> None:
    """A copy is hidden where any other device event (another stream's kernel, another copy kind) runs."""
    timeline = Timeline(
        [
            TimedEvent("Memcpy HtoD (Pinned -> Device)", 0, 100),
            TimedEvent("gemm", 20, 60),  # hides 40 us of the first copy
            TimedEvent("Memcpy HtoD (Pinned -> Device)", 80, 150),  # overlaps the first: union 0-150
            TimedEvent("Memcpy DtoH (Device -> Pinned)", 140, 200),  # hides 10 us
            TimedEvent("aten::mm", 0, 150, device_type=CPU),  # host work hides nothing
            TimedEvent("Optimizer.step", 0, 150, is_user_annotation=True),
        ]
    )
    got = profile_summary.copy_overlap(timeline)
    assert got == pytest.approx({"h2d_copy_ms": 0.15, "h2d_hidden_ms": 0.05, "h2d_exposed_ms": 0.1})
    assert profile_summary.copy_overlap(Timeline([])) == {
        "h2d_copy_ms": 0,
        "h2d_hidden_ms": 0,
        "h2d_exposed_ms": 0,
    }


def test_the_host_side_lists_the_cpu_ops_and_syncs_leaving_out_the_closing_range() -> None:
    """aten::item (a device read on a GPU) is counted where the step made it, not in the closing range."""
    x = torch.ones(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            torch.mm(x, x).sum().item()
        with record_function(profile_summary.CLOSING):
            x.sum().item()
            x.sum().item()
    host = profile_summary.host_summary(prof, top=100)
    syncs = host["host_syncs"]
    assert list(syncs) == list(profile_summary.SYNCS)
    assert syncs["aten::item"]["count"] == syncs["aten::_local_scalar_dense"]["count"] == 3
    assert syncs["aten::item"]["total_ms"] >= syncs["aten::item"]["self_ms"] > 0
    assert syncs["cudaStreamSynchronize"] == {"count": 0, "self_ms": 0.0, "total_ms": 0.0}
    ops = {op["name"]: op for op in host["cpu_ops"]}
    assert ops["aten::mm"]["count"] == ops["aten::sum"]["count"] == 3
    assert profile_summary.CLOSING not in ops
    top = profile_summary.host_summary(prof, top=2)["cpu_ops"]
    assert top == sorted(host["cpu_ops"], key=lambda op: -op["self_ms"])[:2]


def test_the_host_side_is_printed_after_the_kernels(capsys) -> None:
    result = {"shape": "tiny", "row": "loralei-runner (defaults)", "checkpointing": "off"}
    result |= profile_summary.summarize(Profile(KERNELS[:1], OPS), top=1)
    op = {"name": "cudaLaunchKernel", "count": 900, "self_ms": 12.5, "total_ms": 12.5}
    syncs = {name: {"count": 0, "self_ms": 0.0, "total_ms": 0.0} for name in profile_summary.SYNCS}
    syncs["aten::item"] = {"count": 2, "self_ms": 0.01, "total_ms": 3.25}
    result |= {"wall_ms": 150.0, "gpu_busy_ms": 120.0, "cpu_ops": [op], "host_syncs": syncs}
    result |= profile_summary.device_gaps(Timeline([TimedEvent("gemm", 0, 10), TimedEvent("adam", 250, 260)]))
    profile_summary.print_summary(result)
    assert capsys.readouterr().out.splitlines()[-15:] == [
        "  profiled step: wall 150.0 ms, GPU busy 120.0 ms (80.0 % of wall)",
        "  device idle between its first and last event: 0.2 ms, by gap length:",
        "        0.00 ms  x0     0-10 us",
        "        0.00 ms  x0     10-100 us",
        "        0.24 ms  x1     100-1000 us",
        "        0.00 ms  x0     >=1000 us",
        "         240 us  after gemm  before adam",
        "  host syncs (total ms, count):",
        "        0.00 ms  x0     cudaStreamSynchronize",
        "        0.00 ms  x0     cudaDeviceSynchronize",
        "        0.00 ms  x0     cudaEventSynchronize",
        "        3.25 ms  x2     aten::item",
        "        0.00 ms  x0     aten::_local_scalar_dense",
        "  CPU ops by self time (self ms, total ms, count):",
        "       12.50 ms    12.50 ms  x900   cudaLaunchKernel",
    ]


def test_a_saved_summary_prints_as_when_it_was_made(tmp_path: Path, capsys) -> None:
    """As a script it prints the summaries in JSON files (run_gpu.sh: runner-default with RUNNER_PROFILE)."""
    result = {"shape": "llama3-8b", "row": "loralei-fused", "liger": False, "checkpointing": True}
    result |= profile_summary.summarize(Profile(KERNELS, OPS))
    profile_summary.print_summary(result)
    printed = capsys.readouterr().out
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(result, indent=2))
    profile_summary.main([str(path), str(path)])
    assert capsys.readouterr().out == printed * 2


@dataclass
class Kernel:
    duration: float  # microseconds


@dataclass
class OpEvent:
    """What op_attribution reads of a ``prof.events()`` entry."""

    name: str
    input_shapes: list = field(default_factory=list)
    kernels: list[Kernel] = field(default_factory=list)
    cpu_parent: OpEvent | None = None
    device_type: torch.autograd.DeviceType = CPU


def test_kernels_are_charged_to_their_launching_op_by_shapes_and_node() -> None:
    """Two launches of one op with the same shapes in the same autograd node make one row; other shapes or
    another node, another row; aten ops and runtime calls between the op and its node are skipped; a device
    event or an op without kernels adds nothing."""
    node = OpEvent("_LoRAGroupFunctionBackward")
    mm = OpEvent("aten::mm", cpu_parent=node)
    addmm = OpEvent("aten::addmm", cpu_parent=OpEvent("cudaLaunchKernel", cpu_parent=node))
    events = [
        OpEvent("aten::mm", [[8, 4], [4, 2]], [Kernel(1500.0), Kernel(500.0)], cpu_parent=mm),
        OpEvent("aten::mm", [[8, 4], [4, 2]], [Kernel(1000.0)], cpu_parent=mm),
        OpEvent("aten::mm", [[8, 4], [4, 3]], [Kernel(250.0)], cpu_parent=mm),
        OpEvent("aten::addmm", [[8]], [Kernel(4000.0)], cpu_parent=addmm),
        OpEvent("aten::add", [[8], [8]], [Kernel(100.0)]),
        OpEvent("aten::empty", [[8]], cpu_parent=node),
        OpEvent("kernel_itself", [], [Kernel(9.0)], device_type=CUDA),
    ]
    assert profile_summary.op_attribution(Timeline(events), top=3)["by_op"] == [
        (4.0, 1, "aten::addmm [[8]] in _LoRAGroupFunctionBackward"),
        (3.0, 2, "aten::mm [[8, 4], [4, 2]] in _LoRAGroupFunctionBackward"),
        (0.25, 1, "aten::mm [[8, 4], [4, 3]] in _LoRAGroupFunctionBackward"),
    ]
