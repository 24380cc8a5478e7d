"""profile_experts.py: its table of categories puts each kind of MoE work where it belongs (at the Qwen3-30B-A3B
shape's widths), its event-tree walk finds the product an op belongs to, and its CPU form profiles the tiny MoE
shape end to end, in-process and in a child process, writing the markdown and JSON results."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(module: str = "profile_experts"):
    """The profiling script (or its table of categories) as a module; they import the benchmark's modules from
    their folder."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(module)


GROUPED = "aten::_grouped_mm"
S, T, H, W = 65536, 8192, 2048, 768  # routed rows, tokens, hidden, expert width at the 30B-A3B shape
LORALEI_OP = [(T, H), (T, 8), (128, 16, H), (128, 2 * W, 16), (128, 16, W), (128, H, 16)]  # its inputs
# (what the unit is, kernel or op name, op, its input shapes, enclosing ops, expected category)
CASES = [
    (
        "grouped base gate_up",
        "cutlass_grouped_gemm",
        GROUPED,
        [(S, H), (128, H, 2 * W)],
        [],
        "expert GEMM (base)",
    ),
    ("grouped LoRA A", "cutlass_grouped_gemm", GROUPED, [(S, H), (128, H, 16)], [], "LoRA GEMM (experts)"),
    (
        "grouped LoRA factor grad",
        "cutlass_grouped_gemm",
        GROUPED,
        [(16, S), (S, H)],
        [],
        "LoRA GEMM (experts)",
    ),
    (
        "merged bank grad",
        "cutlass_grouped_gemm",
        GROUPED,
        [(H, S), (S, 2 * W)],
        [],
        "expert GEMM (bank gradient)",
    ),
    (
        "PEFT delta BA",
        "sm90_xmma_gemm",
        "aten::baddbmm",
        [(128, 2 * W, H), (128, 2 * W, 16), (128, 16, H)],
        [],
        "LoRA GEMM (experts)",
    ),
    (
        "eager expert, r rows",
        "sm90_xmma_gemm",
        "aten::linear",
        [(16, H), (2 * W, H)],
        [],
        "expert GEMM (base)",
    ),
    (
        "eager slice grad",
        "sm90_xmma_gemm",
        "aten::mm",
        [(2 * W, 500), (500, H)],
        [],
        "expert GEMM (bank gradient)",
    ),
    (
        "attention LoRA A",
        "sm90_xmma_gemm",
        "aten::linear",
        [(4, 2048, H), (16, H)],
        [],
        "LoRA GEMM (attention)",
    ),
    (
        "stacked q/k/v factors",
        "sm90_xmma_gemm",
        "aten::mm",
        [(T, 48), (48, H)],
        ["_LoRAGroupFunction"],
        "LoRA GEMM (attention)",
    ),
    (
        "q_proj",
        "nvjet_tst_gemm",
        "aten::linear",
        [(4, 2048, H), (4096, H)],
        [],
        "dense GEMM (q/k/v/o)",
    ),
    ("router", "nvjet_tst_gemm", "aten::linear", [(T, H), (128, H)], [], "routing / permute / combine"),
    (  # a fused loss's 128-row chunk of the output head: its 128 rows are not the 128-expert router
        "chunked lm_head",
        "nvjet_sm90_tst_128x128_64x6_2x1_v_bz_splitK_NNT",
        "aten::mm",
        [(128, 151936), (151936, H)],
        ["LigerFusedLinearCrossEntropyFunction"],
        "embedding / loss",
    ),
    (
        "router softmax",
        "cunn_SoftMaxForward",
        "aten::_softmax",
        [(T, 128)],
        [],
        "routing / permute / combine",
    ),
    ("sort", "DeviceRadixSortOnesweepKernel", "aten::sort", [], [], "routing / permute / combine"),
    ("combine", "reduce_kernel", "aten::sum", [(T, 8, H)], [], "routing / permute / combine"),
    ("gather rows", "index_elementwise_kernel", "aten::index", [(T, H)], [], "routing / permute / combine"),
    ("silu", "vectorized_elementwise_kernel", "aten::silu", [(S, W)], [], "expert activation"),
    ("gate * up", "vectorized_elementwise_kernel", "aten::mul", [(S, W), (S, W)], [], "expert activation"),
    (
        "flash backward",
        "flash_bwd_kernel",
        "aten::_flash_attention_backward",
        [],
        ["FlashAttentionBackward0"],
        "attention",
    ),
    (
        "AdamW",
        "multi_tensor_apply_kernel",
        "aten::_fused_adamw_",
        [],
        ["Optimizer.step#AdamW.step"],
        "optimizer",
    ),
    (
        "embedding grad",
        "indexing_backward_kernel",
        "aten::index_put_",
        [],
        ["EmbeddingBackward0"],
        "embedding / loss",
    ),
    (
        "W + BA",
        "vectorized_elementwise_kernel",
        "aten::add",
        [(128, 2 * W, H)] * 2,
        [],
        "expert bank elementwise",
    ),
    ("RMSNorm", "vectorized_elementwise_kernel", "aten::mul", [(4, 2048, H)], [], "other"),
    # loralei's experts kernels, launched by its autograd Function (whose inputs include 3-D factor banks)
    (
        "loralei activation",
        "_act_forward_kernel",
        "_LoRAExpertsFunction",
        LORALEI_OP,
        [],
        "expert activation",
    ),
    (
        "loralei combine",
        "_combine_kernel",
        "_LoRAExpertsFunction",
        LORALEI_OP,
        [],
        "routing / permute / combine",
    ),
    (
        "loralei gather",
        "_gather_kernel",
        "_LoRAExpertsFunction",
        LORALEI_OP,
        [],
        "routing / permute / combine",
    ),
]
# kernels that no op claimed: only their names
UNCLAIMED = [
    ("_gated_act_kernel", "expert activation"),
    ("_act_backward_kernel", "expert activation"),
    ("_combine_fwd_kernel", "routing / permute / combine"),
    ("triton_poi_fused_mul_silu_0", "expert activation"),
    ("radixSortKVInPlace", "routing / permute / combine"),
    ("sm90_xmma_gemm_bf16bf16", "dense GEMM (q/k/v/o)"),
    ("Memset (Device)", "other"),
]
# kernels of compiled regions (Inductor's Triton kernels): their op names the region, their own name the work
COMPILED = [
    ("triton_poi_fused_index_put_3", "routing / permute / combine"),
    ("triton_poi_fused_mul_silu_7", "expert activation"),
    ("triton_red_fused__to_copy_add_mean_pow_4", "other"),
]


@pytest.mark.parametrize(
    ("what", "kernel", "op", "shapes", "enclosing", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_classifier_puts_each_kind_of_work_in_its_category(
    what, kernel, op, shapes, enclosing, expected
) -> None:
    pe = _load()
    shapes = tuple(tuple(s) for s in shapes)
    gemm = op if pe.GEMM_OPS.match(op) else ""
    unit = pe.Unit(kernel, 1.0, op, shapes, gemm, shapes if gemm else (), (op, *enclosing))
    assert pe.classify(unit, pe.Dims.of("qwen3-30b-a3b-8l")) == expected


@pytest.mark.parametrize(("kernel", "expected"), UNCLAIMED)
def test_unclaimed_kernels_are_classified_by_name(kernel: str, expected: str) -> None:
    pe = _load("expert_categories")
    assert pe.classify(pe.Unit(kernel, 1.0), pe.Dims.of("qwen3-30b-a3b-8l")) == expected


@pytest.mark.parametrize(("kernel", "expected"), COMPILED)
def test_compiled_region_kernels_are_classified_by_their_own_name(kernel: str, expected: str) -> None:
    pe = _load("expert_categories")
    unit = pe.Unit(kernel, 1.0, "CompiledFunction", (), "", (), ("CompiledFunction",))
    assert pe.classify(unit, pe.Dims.of("qwen3-30b-a3b-8l")) == expected


def test_categories_are_a_table_ending_in_a_catch_all() -> None:
    pe = _load("expert_categories")
    labels = [label for label, _ in pe.CATEGORIES]
    assert len(set(labels)) == len(labels) and labels[-1] == "other"
    assert all(callable(test) for _, test in pe.CATEGORIES)


def test_event_tree_walk_finds_the_outermost_product_and_its_shapes() -> None:
    """A linear's mm is judged by the linear (its shapes name the weight), and units carry their ancestry."""
    pe = _load()
    x, w = torch.randn(6, 32), torch.randn(16, 32)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.nn.functional.linear(x, w)
    mm = next(u for u in pe.units(prof.events(), cuda=False) if u.op == "aten::mm")
    assert mm.gemm == "aten::linear" and mm.gemm_shapes == ((6, 32), (16, 32))
    assert mm.ancestors[0] == "aten::mm" and "aten::linear" in mm.ancestors


def _check_results(out: Path, row: str) -> dict:
    stem = out / f"experts-tiny-moe-{row}"
    result = json.loads(stem.with_suffix(".json").read_text())
    cats = {c["category"]: c for c in result["categories"]}
    assert list(cats) == [label for label, _ in _load().CATEGORIES]
    assert sum(c["ms_per_step"] for c in cats.values()) == pytest.approx(result["total_ms_per_step"])
    assert result["moe_layers"] == 2 and result["unit"] == "CPU self time of aten ops"
    for c in cats.values():
        assert c["ms_per_moe_layer"] == pytest.approx(c["ms_per_step"] / 2)
    md = stem.with_suffix(".md").read_text()
    assert "| category | ms / step | ms / step / MoE layer | share |" in md
    return cats


def test_cpu_profile_of_the_peft_moe_row_splits_expert_time(tmp_path: Path) -> None:
    pe = _load()
    argv = ["--shape", "tiny-moe", "--row", "peft-bf16-adapters", "--cpu", "--steps", "1", "--warmup", "1"]
    pe.main([*argv, "--out", str(tmp_path)])
    cats = _check_results(tmp_path, "peft-bf16-adapters")
    # PEFT merges BA into the banks: the LoRA product is the delta, and the merged banks get a gradient
    expected = [
        "LoRA GEMM (experts)",
        "LoRA GEMM (attention)",
        "expert GEMM (base)",
        "expert GEMM (bank gradient)",
        "expert activation",
        "routing / permute / combine",
        "attention",
        "optimizer",
    ]
    assert all(cats[label]["ms_per_step"] > 0 for label in expected)


def test_isolated_row_is_profiled_in_a_child_that_imports_its_library_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for the Unsloth rows: the script re-runs itself through the benchmark's child boot (here importing a
    standard module first), and the child writes the results."""
    pe = _load()
    monkeypatch.setattr(pe, "ISOLATED", {"peft-eager-experts": "colorsys"})
    argv = ["--shape", "tiny-moe", "--row", "peft-eager-experts", "--cpu", "--steps", "1", "--warmup", "1"]
    assert pe.main([*argv, "--out", str(tmp_path)]) is None  # the child's results are on disk only
    cats = _check_results(tmp_path, "peft-eager-experts")
    assert cats["expert GEMM (base)"]["ms_per_step"] > 0
