"""LoRA on MoE expert banks, at model level: every family with Transformers' experts contract gives the model's
own expert forward with the update added, gradients equal to a dense-delta reference, fused equal to plain, and
clear errors for what cannot be adapted."""

from __future__ import annotations

import copy

import pytest
import torch

from loralei import LoRAConfig, apply_fused_kernels, inject_lora
from loralei.errors import ConfigError, InjectionError
from loralei.inject import lora_expert_modules, lora_modules
from loralei.modules.lora_experts import LoRAExperts
from tiny_models import MOE_FAMILIES, tiny_batch, tiny_model
from tolerances import assert_fp32_close

BANKS = ["experts.gate_up_proj", "experts.down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _adapted(family: str, **config) -> torch.nn.Module:
    model = tiny_model(family)
    fields = {"r": 4, "lora_alpha": 8, "target_parameters": BANKS, "init_lora_weights": False}
    return inject_lora(model, LoRAConfig(**fields | config))


def _with_deltas_folded(model: torch.nn.Module, reference: torch.nn.Module) -> torch.nn.Module:
    """``reference`` (a copy of the base model) with every adapted bank and projection updated in FP32."""
    with torch.no_grad():
        for name, experts in lora_expert_modules(model):
            for bank in experts.adapted:
                getattr(reference.get_submodule(name), bank).add_(experts.delta_weight(bank))
        for name, proj in lora_modules(model):
            reference.get_submodule(name).weight.add_(proj.delta_weight())
    return reference


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
@pytest.mark.parametrize("fused", [False, True])
def test_output_is_the_models_own_expert_forward_with_the_update(family: str, fused: bool) -> None:
    base = tiny_model(family)
    model = _adapted(family, target_modules=ATTENTION)
    reference = _with_deltas_folded(model, copy.deepcopy(base))
    if fused:
        report = apply_fused_kernels(model)
        assert report.count("experts") == 2 and not report.plain_experts
    batch = tiny_batch()
    with torch.no_grad():
        assert_fp32_close(model(**batch).logits, reference(**batch).logits, f"{family} logits")


def _delta_reference_grads(model: torch.nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    """Gradients of the factors through a materialised dense delta (``W + s·B@A`` per expert, as PEFT's
    ParamWrapper computes it): the experts module's own forward reads the summed bank."""
    reference = copy.deepcopy(model)
    hooks = []
    for _, experts in lora_expert_modules(reference):
        base = experts.base_layer
        for bank in experts.adapted:
            dense = getattr(experts, bank).detach()
            base._parameters.pop(bank)

            def fold(module, args, dense=dense, bank=bank, owner=experts):
                delta = torch.bmm(owner.lora_B[bank], owner.lora_A[bank]) * owner.scale
                setattr(module, bank, dense + (delta.transpose(-2, -1) if owner.layout.transposed else delta))

            hooks.append(base.register_forward_pre_hook(fold))
        experts.disabled = True  # forward through the base module's own code ...
        experts.forward = lambda *args, base=base: base(*args)  # ... with the folded banks
    reference(**batch).loss.backward()
    for hook in hooks:
        hook.remove()
    return {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_gradients_equal_a_dense_delta_reference_fused_and_plain(family: str) -> None:
    model = _adapted(family, target_modules=ATTENTION).train()
    batch = tiny_batch()
    expected = _delta_reference_grads(model, batch)
    for fused in (False, True):
        if fused:
            apply_fused_kernels(model)
        model.zero_grad()
        model(**batch).loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        assert grads.keys() == expected.keys() and any("lora_A.gate_up_proj" in n for n in grads)
        for name, grad in grads.items():
            assert_fp32_close(grad, expected[name], f"{family} fused={fused} {name}")


def test_router_stays_frozen_and_aux_loss_passes_through() -> None:
    model = tiny_model("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.5).train()
    batch = tiny_batch()
    expected = model(**batch)
    inject_lora(model, LoRAConfig(r=4, target_parameters=BANKS))  # B = 0: the same function until trained
    routers = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert routers and not any(p.requires_grad for p in routers)
    for fused in (False, True):
        if fused:
            apply_fused_kernels(model)
        out = model(**batch)
        assert out.aux_loss > 0
        assert_fp32_close(out.aux_loss, expected.aux_loss, f"aux loss, fused={fused}")
        assert_fp32_close(out.loss, expected.loss, f"loss with aux, fused={fused}")


def test_experts_that_receive_no_tokens_get_zero_factor_gradients() -> None:
    model = _adapted("qwen3_moe").train()
    apply_fused_kernels(model)
    routed: dict[str, set[int]] = {}

    def record(name: str):
        def hook(module, args) -> None:
            routed[name] = set(args[1].flatten().tolist())

        return hook

    for name, experts in lora_expert_modules(model):
        experts.register_forward_pre_hook(record(name))
    ids = torch.tensor([[3, 5]])  # two tokens, top-2 of 6 experts: at least 2 idle experts per layer
    model(input_ids=ids, labels=ids).loss.backward()
    for name, experts in lora_expert_modules(model):
        for grad in (experts.lora_A["gate_up_proj"].grad, experts.lora_B["down_proj"].grad):
            busy = grad.flatten(1).abs().sum(1) != 0
            # busy experts are routed ones (a routed token whose output the loss ignores leaves zeros too)
            assert set(torch.nonzero(busy).flatten().tolist()) <= routed[name] and len(routed[name]) <= 4
            assert busy.any()


def test_one_bank_alone_and_with_target_modules() -> None:
    model = _adapted("mixtral", target_parameters=["experts.down_proj"])
    (_, experts), *_ = lora_expert_modules(model)
    assert experts.adapted == ("down_proj",) and not list(lora_modules(model))
    assert set(experts.lora_A) == {"down_proj"}
    apply_fused_kernels(model)
    batch = tiny_batch()
    reference = _with_deltas_folded(model, copy.deepcopy(tiny_model("mixtral")))
    with torch.no_grad():
        assert_fp32_close(model(**batch).logits, reference(**batch).logits, "down_proj only")


def test_shared_expert_is_a_plain_linear_path() -> None:
    model = _adapted("qwen2_moe", target_modules=["gate_proj", "up_proj", "down_proj"])
    names = [n for n, _ in lora_modules(model)]
    assert names and all(".shared_expert." in n for n in names)
    report = apply_fused_kernels(model)
    assert report.count("gated MLP") == 2 and report.count("experts") == 2


def test_names_factors_and_state_dict() -> None:
    model = _adapted("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, LoRAExperts) and experts.adapted == ("gate_up_proj", "down_proj")
    keys = {k for k in model.state_dict() if "layers.0.mlp.experts" in k}
    prefix = "model.layers.0.mlp.experts."
    assert keys == {
        prefix + k
        for k in (
            "gate_up_proj",
            "down_proj",
            "lora_A.gate_up_proj",
            "lora_B.gate_up_proj",
            "lora_A.down_proj",
            "lora_B.down_proj",
        )
    }
    e, i, h = 6, 24, 32
    assert experts.lora_A["gate_up_proj"].shape == (e, 4, h) and experts.lora_B["gate_up_proj"].shape == (
        e,
        2 * i,
        4,
    )
    assert experts.lora_A["down_proj"].shape == (e, 4, i) and experts.lora_B["down_proj"].shape == (e, h, 4)
    assert not experts.gate_up_proj.requires_grad and experts.lora_B["down_proj"].requires_grad


def test_default_init_starts_at_the_base_model() -> None:
    base = tiny_model("olmoe")
    model = inject_lora(copy.deepcopy(base), LoRAConfig(target_parameters=BANKS))
    batch = tiny_batch()
    with torch.no_grad():
        assert_fp32_close(model(**batch).logits, base(**batch).logits, "B = 0 at init")


def test_under_checkpointing_the_gradients_are_unchanged() -> None:
    model = _adapted("qwen3_moe", target_modules=ATTENTION).train()
    apply_fused_kernels(model)
    batch = tiny_batch()
    model(**batch).loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(**batch).loss.backward()
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert_fp32_close(param.grad, expected[name], f"checkpointed {name}")


def test_compiled_layers_run_the_experts_eagerly() -> None:
    model = _adapted("qwen3_moe", target_modules=ATTENTION).train()
    apply_fused_kernels(model)
    batch = tiny_batch()
    expected = model(**batch).loss
    for layer in model.model.layers:
        layer.compile(backend="eager")
    assert_fp32_close(model(**batch).loss, expected, "compiled layers")


# --- errors ---


def test_target_parameters_alone_adapts_no_modules_and_default_is_all_linear() -> None:
    assert LoRAConfig(target_parameters=BANKS).target_modules is None
    assert LoRAConfig().target_modules == "all-linear"


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (
            {"target_parameters": BANKS, "lora_dropout": 0.1},
            "lora_dropout=0.1 cannot apply to target_parameters",
        ),
        ({"target_parameters": []}, "target_parameters"),
        ({"target_parameters": [".down_proj"]}, "target_parameters"),
        ({"target_modules": None}, "nothing would be adapted"),
    ],
)
def test_config_errors_name_the_field(fields: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=r"target_parameters|target_modules") as err:
        LoRAConfig(**fields)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ("experts.gate_proj", 'matches no expert bank (did you mean "experts.gate_up_proj"?)'),
        ("gate.weight", "is not a 3-D expert bank"),
        ("experts.down", "matches no expert bank"),
    ],
)
def test_injection_errors_name_the_entry(entry: str, needle: str) -> None:
    model = tiny_model("qwen3_moe")
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(InjectionError, match="target_parameters entry") as err:
        inject_lora(model, LoRAConfig(target_parameters=[entry]))
    assert needle in str(err.value)
    assert not list(lora_expert_modules(model)) and model.state_dict().keys() == before.keys()


def test_a_dense_model_has_no_expert_banks() -> None:
    with pytest.raises(InjectionError, match="this model has no MoE experts module"):
        inject_lora(tiny_model("llama"), LoRAConfig(target_parameters=BANKS))


def test_quantized_base_needs_both_banks() -> None:
    config = LoRAConfig(target_parameters=["experts.down_proj"], quantize_base=True)
    with pytest.raises(InjectionError, match="add the other bank to target_parameters"):
        inject_lora(tiny_model("qwen3_moe"), config)
