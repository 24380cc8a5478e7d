"""apply_fused_kernels / remove_fused_kernels: what fuses, what does not and why, and the group cache rules."""

from __future__ import annotations

import pytest
import torch

from loralei import (
    ConfigError,
    InjectionError,
    LoRAConfig,
    apply_fused_kernels,
    disable_lora,
    inject_lora,
    merge_and_unload_lora,
    merge_lora,
    remove_fused_kernels,
    unmerge_lora,
)
from loralei.fusion import mlp as mlp_fusion
from loralei.kernels.joint_buffer import joined
from loralei.ops import reference
from tiny_models import tiny_batch, tiny_model
from tolerances import FP32_REL, rel_err

ATTN = "model.layers.0.self_attn"


def _model(family: str = "llama", targets: list[str] | str = "all-linear", **overrides) -> torch.nn.Module:
    model = tiny_model(family, **overrides)
    return inject_lora(model, LoRAConfig(r=4, target_modules=targets, init_lora_weights=False))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(**tiny_batch()).logits


def test_report_counts_and_prints() -> None:
    report = apply_fused_kernels(_model())
    assert (report.count("gated MLP"), report.count("shared-input group"), report.count("projection")) == (
        2,
        2,
        2,
    )
    assert len(report.fused_projections) == 14 and not report.not_fused
    assert str(report).startswith(
        "loralei fusion: 14 LoRA projections fused (2 gated MLPs, 2 shared-input groups"
    )


def test_no_lora_is_a_clear_error() -> None:
    with pytest.raises(InjectionError, match="no LoRA modules; call inject_lora"):
        apply_fused_kernels(tiny_model())


def test_applying_twice_replaces_and_remove_restores() -> None:
    model = _model()
    plain = _logits(model)
    apply_fused_kernels(model)
    report = apply_fused_kernels(model, mlp=False)
    assert "replaced the fusion applied earlier" in str(report) and report.count("gated MLP") == 0
    assert not mlp_fusion.is_installed(model.model.layers[0].mlp)
    assert remove_fused_kernels(model) is True and remove_fused_kernels(model) is False
    attn = model.model.layers[0].self_attn
    assert (
        "forward" not in vars(model.model.layers[0].mlp)
        and attn.q_proj.group is None
        and not attn.o_proj.fused
    )
    assert torch.equal(_logits(model), plain)


def test_switches_leave_projections_plain_with_reason() -> None:
    report = apply_fused_kernels(_model(), qkv=False, o=False)
    reasons = {e.name: e.reason for e in report.not_fused}
    assert reasons[f"{ATTN}.q_proj"] == "qkv=False" and reasons[f"{ATTN}.o_proj"] == "o=False"
    assert report.count("gated MLP") == 2 and "plain: qkv=False" in str(report)


def test_unsupported_activation_falls_back_to_group_and_single() -> None:
    model = _model(hidden_act="relu")
    plain = _logits(model)
    report = apply_fused_kernels(model)
    mlp_entry = next(e for e in report.not_fused if e.kind == "gated MLP")
    assert "activation ReLU is not supported (supported: silu, gelu, gelu_tanh)" in mlp_entry.reason
    assert report.count("shared-input group") == 4 and not report.plain_projections  # q/k/v and gate/up
    assert rel_err(_logits(model), plain) <= FP32_REL


def test_hooks_keep_modules_out_of_mlp_and_group_fusion() -> None:
    model = _model()
    layer = model.model.layers[0]
    layer.mlp.up_proj.register_forward_hook(lambda *args: None)
    layer.self_attn.k_proj.register_forward_pre_hook(lambda *args: None)
    report = apply_fused_kernels(model)
    reasons = {e.name: e.reason for e in report.not_fused}
    assert reasons["model.layers.0.mlp"].startswith("hooks on up_proj")
    assert reasons[f"{ATTN}.{{q_proj,k_proj,v_proj}}"] == "k_proj: it has hooks"
    assert layer.self_attn.k_proj.group is None and layer.self_attn.k_proj.fused  # still its own fused op
    assert layer.self_attn.q_proj.group is layer.self_attn.v_proj.group is not None


def test_trainable_base_stays_plain() -> None:
    model = _model(targets=["o_proj"])
    model.model.layers[0].self_attn.o_proj.weight.requires_grad_(True)
    report = apply_fused_kernels(model)
    assert report.plain_projections == [f"{ATTN}.o_proj"] and "trainable" in report.not_fused[0].reason


def test_partial_group_when_only_q_and_v_have_lora() -> None:
    model = _model(targets=["q_proj", "v_proj"])
    plain = _logits(model)
    report = apply_fused_kernels(model)
    assert next(u.members for u in report.fused) == (f"{ATTN}.q_proj", f"{ATTN}.v_proj")
    assert rel_err(_logits(model), plain) <= FP32_REL


def test_user_groups_replace_auto_groups_and_are_validated() -> None:
    model = _model()
    report = apply_fused_kernels(
        model, shared_input_groups=[{"parent_name": ATTN, "projection_names": ["q_proj", "k_proj"]}]
    )
    assert [u.name for u in report.fused if u.kind == "shared-input group"] == [f"{ATTN}.{{q_proj,k_proj}}"]
    bad = [
        {"parent_name": "model.nope", "projection_names": ["q_proj", "k_proj"]},
        {"parent_name": ATTN, "projection_names": ["q_proj"]},
        {"parent_name": ATTN, "projection_names": ["q_proj", "x_proj"]},
        {"parent": ATTN},
    ]
    with pytest.raises(ConfigError) as err:
        apply_fused_kernels(model, shared_input_groups=bad)
    for needle in (
        "[0].parent_name: no module 'model.nope'",
        "[1].projection_names: need a list",
        "'x_proj'",
        "[3]:",
    ):
        assert needle in str(err.value)
    with pytest.raises(ConfigError, match="shared_input_groups"):
        apply_fused_kernels(model, shared_input_groups="all")
    with pytest.raises(ConfigError, match="mlp: must be True or False"):
        apply_fused_kernels(model, mlp="yes")


def test_disable_and_merge_at_run_time_compute_the_base_and_the_merged_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fused MLP that cannot run its op (adapters off, merged) calls its projections and joins them with the
    gated-activation kernel, never the class forward's activation module."""
    model = _model()
    with disable_lora(model):
        base = _logits(model)
    plain = _logits(model)
    apply_fused_kernels(model)
    for layer in model.model.layers:
        monkeypatch.setattr(layer.mlp, "act_fn", None)  # the class forward would fail here
    with disable_lora(model):
        assert rel_err(_logits(model), base) <= FP32_REL
    merge_lora(model)
    assert rel_err(_logits(model), plain) <= FP32_REL
    unmerge_lora(model)
    assert rel_err(_logits(model), plain) <= FP32_REL


def test_phi3_runs_single_projections() -> None:
    report = apply_fused_kernels(_model("phi3"))
    assert report.count("projection") == 8 and not report.not_fused


def test_group_cache_is_never_stale() -> None:
    model = _model()
    attn = model.model.layers[0].self_attn
    names = ("q_proj", "k_proj", "v_proj")
    x = torch.randn(2, 5, 32)

    def plain(name: str) -> torch.Tensor:
        return reference.lora_linear(x, getattr(attn, name).lora_weights())

    with torch.no_grad():
        apply_fused_kernels(model)
        group = attn.q_proj.group
        attn.q_proj(x)
        assert group._input is x and set(group._held) == {1, 2}  # k and v held for this very tensor
        x.mul_(2)  # in-place change: the held k must not be handed out
        assert rel_err(attn.k_proj(x), plain("k_proj")) <= FP32_REL
        x.div_(3)
        outs = {n: getattr(attn, n)(x) for n in names}  # q recomputes the group; v and k take held outputs
        assert all(rel_err(outs[n], plain(n)) <= FP32_REL for n in names)
        assert group._input is None and not group._held  # all handed out: nothing kept alive
        attn.v_proj.lora_B.weight.add_(1.0)  # weights changed after the group ran: recompute
        attn.q_proj(x)
        assert rel_err(attn.v_proj(x), plain("v_proj")) <= FP32_REL
        assert rel_err(attn.v_proj(x.clone()), plain("v_proj")) <= FP32_REL  # another tensor: computed afresh


def test_a_groups_dense_base_weights_lie_stacked_in_one_buffer() -> None:
    """q, k, v's base weights become row blocks of one buffer (same Parameters, same values), so the group's
    input gradient can take them as one matrix."""
    model = _model()
    attn = model.model.layers[0].self_attn
    members = [attn.q_proj, attn.k_proj, attn.v_proj]
    params = [m.weight for m in members]
    before = [p.detach().clone() for p in params]
    apply_fused_kernels(model)
    assert [m.weight for m in members] == params
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    stacked = joined(joined(params[0].detach(), params[1].detach(), 0), params[2].detach(), 0)
    assert stacked is not None and torch.equal(stacked, torch.cat(before))
    apply_fused_kernels(model)  # again: the weights stay where they are
    assert params[1].data_ptr() == stacked[before[0].shape[0] :].data_ptr()


def test_a_merged_model_with_stacked_weights_saves_and_loads_back(tmp_path) -> None:
    """Transformers' save_pretrained takes the stacked q/k/v weights (views of one buffer, disjoint) as the
    separate tensors they are, and the saved model loads back with the merged values."""
    from transformers import AutoModelForCausalLM

    model = _model()
    apply_fused_kernels(model)
    merged = merge_and_unload_lora(model)
    merged.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    saved = merged.state_dict()
    assert back.keys() == saved.keys()
    assert all(torch.equal(back[k], saved[k]) for k in back)
