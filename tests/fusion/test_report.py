"""The fusion report's text: the residual-adds line speaks of the fused MLP's down LoRA term only where an MLP was
fused in those layers (MoE layers have experts, not a gated MLP)."""

from __future__ import annotations

from loralei import LoRAConfig, apply_fused_kernels, inject_lora
from loralei.fusion import Fused, FusionReport
from tiny_models import tiny_model, tiny_moe_model

DOWN_TERM = "down LoRA term"


def _residual_line(report: FusionReport) -> str:
    return next(line for line in str(report).splitlines() if "residual adds:" in line)


def _report(layers: int, mlps: int) -> FusionReport:
    """Residual adds fused in ``layers`` decoder layers, the gated MLPs of the first ``mlps`` of them fused."""
    report = FusionReport()
    for i in range(layers):
        report.fused.append(Fused("residual adds", f"model.layers.{i}", ()))
    for i in range(mlps):
        members = tuple(f"model.layers.{i}.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
        report.fused.append(Fused("gated MLP", f"model.layers.{i}.mlp", members))
    return report


def test_the_down_term_is_named_where_every_layer_fused_its_mlp() -> None:
    assert _residual_line(_report(2, 2)) == (
        "  residual adds: inside the RMSNorm kernels in 2 decoder layers (with the fused MLP's down LoRA term in "
        "the last add, without checkpointing), 0 kept apart"
    )


def test_layers_without_a_fused_mlp_are_not_said_to_take_its_term() -> None:
    assert _residual_line(_report(2, 0)) == (
        "  residual adds: inside the RMSNorm kernels in 2 decoder layers, 0 kept apart"
    )
    assert "(1 of them with the fused MLP's down LoRA term" in _residual_line(_report(2, 1))


def test_moe_model_report_does_not_mention_an_mlp_down_term() -> None:
    model = tiny_moe_model()
    config = LoRAConfig(
        r=4,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["experts.gate_up_proj"],
    )
    inject_lora(model, config)
    report = apply_fused_kernels(model)
    assert report.count("residual adds") == 2 and report.count("gated MLP") == 0
    assert DOWN_TERM not in str(report)


def test_dense_model_report_still_mentions_it() -> None:
    model = tiny_model("llama")
    inject_lora(model, LoRAConfig(r=4))
    report = apply_fused_kernels(model)
    assert report.count("gated MLP") == 2 and DOWN_TERM in _residual_line(report)
