"""Adapters on MoE expert banks (``target_parameters``): native save/load, PEFT export and import."""

import json
import warnings

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import loralei.checkpoint as ckpt
from loralei import (
    CheckpointError,
    LoRAConfig,
    inject_lora,
    load_pretrained,
    lora_modules,
    lora_state_dict,
    save_pretrained,
)
from loralei.inject import lora_expert_modules
from tiny_models import _COMMON, MOE_EXPERTS, MOE_INTERMEDIATE, tiny_batch, tiny_moe_model
from tolerances import assert_fp32_close, rel_err

HIDDEN, EXPERT_INTERMEDIATE, NUM_EXPERTS = _COMMON["hidden_size"], MOE_INTERMEDIATE, MOE_EXPERTS

BANKS = ["experts.gate_up_proj", "experts.down_proj"]
CONFIGS = {
    "both-banks": {"target_parameters": BANKS},
    "down-only-rslora": {"target_parameters": ["experts.down_proj"], "use_rslora": True, "lora_alpha": 5},
    "with-linear-layer-1": {
        "target_modules": ["q_proj"],
        "target_parameters": BANKS,
        "layers_to_transform": [1],
    },
}
R = 2


def adapted(family="qwen3_moe", **kwargs):
    model = tiny_moe_model(family)
    inject_lora(model, LoRAConfig(**{"r": R, "init_lora_weights": False, **kwargs}))
    return model


def logits(model):
    return model(**tiny_batch()).logits


def peft_load(path, model):
    """Loads ``path`` into ``model`` with the real PEFT package; returns the PEFT model and the adapter keys PEFT
    found missing / unexpected (a second load under another name reports them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.PeftModel.from_pretrained(model, path)
        result = peft_model.load_adapter(path, adapter_name="check")
    peft_model.set_adapter("default")
    missing = [k for k in result.missing_keys if ".check." in k]
    return peft_model.eval(), missing, list(result.unexpected_keys)


def peft_adapted(family="qwen3_moe", **kwargs):
    """A PEFT model with a random, non-zero adapter (lora_B drawn at random, not left at zero)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(tiny_moe_model(family), peft.LoraConfig(r=R, **kwargs))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    return model.eval()


def test_lora_state_dict_holds_expert_factors():
    model = adapted(target_parameters=BANKS)
    tensors = lora_state_dict(model)
    experts = "model.layers.0.mlp.experts"
    two_i = 2 * EXPERT_INTERMEDIATE
    assert tuple(tensors[f"{experts}.lora_A.gate_up_proj"].shape) == (NUM_EXPERTS, R, HIDDEN)
    assert tuple(tensors[f"{experts}.lora_B.gate_up_proj"].shape) == (NUM_EXPERTS, two_i, R)
    assert tuple(tensors[f"{experts}.lora_A.down_proj"].shape) == (NUM_EXPERTS, R, EXPERT_INTERMEDIATE)
    assert tuple(tensors[f"{experts}.lora_B.down_proj"].shape) == (NUM_EXPERTS, HIDDEN, R)
    assert len(tensors) == 8  # 2 layers x 2 banks x (A, B)
    assert all(p.requires_grad for p in tensors.values())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_native_roundtrip(tmp_path, name):
    model = adapted(**CONFIGS[name])
    save_pretrained(model, tmp_path / "a")
    fresh = load_pretrained(tiny_moe_model(), tmp_path / "a")
    torch.testing.assert_close(logits(fresh), logits(model), rtol=0, atol=0)
    meta = json.loads((tmp_path / "a" / ckpt.NATIVE_CONFIG).read_text())
    assert LoRAConfig(**meta["lora_config"]) == LoRAConfig(r=R, init_lora_weights=False, **CONFIGS[name])
    banks = [f"{n}.{b}" for n, m in lora_expert_modules(model) for b in m.adapted]
    assert meta["target_parameter_names"] == banks


def test_native_load_refuses_other_expert_banks(tmp_path):
    save_pretrained(adapted(target_parameters=BANKS), tmp_path / "a")
    model = tiny_moe_model()
    inject_lora(model, LoRAConfig(r=R, target_parameters=["experts.down_proj"]))
    with pytest.raises(CheckpointError, match=r"adapts other expert banks .*gate_up_proj"):
        load_pretrained(model, tmp_path / "a")


def test_peft_export_layout(tmp_path):
    model = adapted(target_parameters=BANKS)
    save_pretrained(model, tmp_path / "p", format="peft")
    tensors = load_file(tmp_path / "p" / ckpt.PEFT_WEIGHTS)
    experts = model.model.layers[0].mlp.experts
    # PEFT nests one wrapper per bank; gate_up_proj (first in parameter order) is the inner one.
    inner = "base_model.model.model.layers.0.mlp.experts.base_layer"
    outer = "base_model.model.model.layers.0.mlp.experts"
    for prefix, bank, in_f, out_f in (
        (inner, "gate_up_proj", HIDDEN, 2 * EXPERT_INTERMEDIATE),
        (outer, "down_proj", EXPERT_INTERMEDIATE, HIDDEN),
    ):
        a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
        assert tuple(a.shape) == (NUM_EXPERTS * R, in_f)
        assert tuple(b.shape) == (out_f, R * NUM_EXPERTS)
        assert torch.equal(a.reshape(NUM_EXPERTS, R, in_f), experts.lora_A[bank].detach())
        assert torch.equal(b.reshape(out_f, R, NUM_EXPERTS).permute(2, 0, 1), experts.lora_B[bank].detach())
    assert len(tensors) == 8
    config = json.loads((tmp_path / "p" / ckpt.PEFT_CONFIG).read_text())
    assert config["target_parameters"] == sorted(BANKS)
    assert config["target_modules"] == []  # None would let PEFT add default modules for the architecture


def test_peft_export_names_exact_banks_and_modules_when_suffixes_select_more(tmp_path):
    save_pretrained(adapted(**CONFIGS["with-linear-layer-1"]), tmp_path / "p", format="peft")
    config = json.loads((tmp_path / "p" / ckpt.PEFT_CONFIG).read_text())
    layer = "model.layers.1"
    # PEFT ignores layers_to_transform for target_parameters, and on Qwen3-MoE widens a regex target_modules
    # to its leaf names; exact names are what it cannot widen.
    assert config["target_parameters"] == [
        f"{layer}.mlp.experts.down_proj",
        f"{layer}.mlp.experts.gate_up_proj",
    ]
    assert config["target_modules"] == [f"{layer}.self_attn.q_proj"]
    assert "layers_to_transform" not in config


EXPORT_CASES = [("qwen3_moe", n) for n in sorted(CONFIGS)] + [("mixtral", "both-banks")]


@pytest.mark.parametrize(("family", "name"), EXPORT_CASES)
def test_peft_export_loads_in_peft_with_the_same_logits(tmp_path, family, name):
    model = adapted(family, **CONFIGS[name])
    expected = logits(model)
    assert rel_err(expected, logits(tiny_moe_model(family))) > 1e-2  # the adapter changes the outputs
    save_pretrained(model, tmp_path / "p", format="peft")
    peft_model, missing, unexpected = peft_load(tmp_path / "p", tiny_moe_model(family))
    assert missing == [] and unexpected == []
    assert_fp32_close(logits(peft_model), expected, f"PEFT load of {family}/{name}")
    # and back into loralei: the same numbers exactly (the layouts are reshapes and permutes)
    reloaded = load_pretrained(tiny_moe_model(family), tmp_path / "p")
    torch.testing.assert_close(logits(reloaded), expected, rtol=0, atol=0)


PEFT_CASES = {
    "both-banks": ("qwen3_moe", {"target_modules": [], "target_parameters": BANKS}),
    "down-only-rslora": (
        "qwen3_moe",
        {
            "target_modules": [],
            "target_parameters": ["experts.down_proj"],
            "use_rslora": True,
            "lora_alpha": 5,
        },
    ),
    # PEFT applies layers_to_transform to q_proj only; the banks of every layer are adapted
    "linear-layer-1-banks-everywhere": (
        "qwen3_moe",
        {"target_modules": ["q_proj"], "layers_to_transform": [1], "target_parameters": BANKS},
    ),
    # target_modules unset: PEFT decides which linear modules (if any) to add; the weights file says which
    "mixtral-target-modules-unset": ("mixtral", {"target_parameters": BANKS}),
}


@pytest.mark.parametrize("name", sorted(PEFT_CASES))
def test_adapter_saved_by_peft_loads_with_peft_logits(tmp_path, name):
    family, options = PEFT_CASES[name]
    peft_model = peft_adapted(family, **options)
    expected = logits(peft_model)
    assert rel_err(expected, logits(tiny_moe_model(family))) > 1e-2
    peft_model.save_pretrained(tmp_path / "from-peft")
    ours = load_pretrained(tiny_moe_model(family), tmp_path / "from-peft")
    assert_fp32_close(logits(ours), expected, f"loralei load of PEFT adapter {name}")
    assert (
        len(list(lora_expert_modules(ours))) == 2
    )  # both layers' experts, whatever layers_to_transform says


def test_peft_config_without_target_modules_reads_linear_modules_from_the_weights(tmp_path):
    # PEFT, given target_parameters and no target_modules, adds the modules of its per-architecture table on
    # some model types (not on Qwen3-MoE): a file from such a run holds linear-module weights its config does
    # not name.
    peft_model = peft_adapted(target_modules=["v_proj"], target_parameters=["experts.down_proj"])
    peft_model.save_pretrained(tmp_path / "p")
    _edit_peft_config(tmp_path / "p", target_modules=None)
    ours = load_pretrained(tiny_moe_model(), tmp_path / "p")
    assert_fp32_close(logits(ours), logits(peft_model), "loralei load without target_modules")
    assert [n for n, _ in lora_modules(ours)] == [
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.v_proj",
    ]


def test_peft_bank_with_wrong_shape(tmp_path):
    save_pretrained(adapted(target_parameters=BANKS), tmp_path / "p", format="peft")
    file = tmp_path / "p" / ckpt.PEFT_WEIGHTS
    tensors = load_file(file)
    key = "base_model.model.model.layers.1.mlp.experts.lora_B.weight"  # down_proj: (32, r·E)
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, file)
    with pytest.raises(
        CheckpointError,
        match=rf"layers\.1\.mlp\.experts\.lora_B\.weight' \(down_proj of .*\) has shape \(32, {R * NUM_EXPERTS - 1}\) "
        rf"in the file but PEFT lays this bank out as \(32, {R * NUM_EXPERTS}\)",
    ):
        load_pretrained(tiny_moe_model(), tmp_path / "p")


def test_peft_export_refuses_linear_modules_peft_reads_as_expert_banks(tmp_path):
    model = tiny_moe_model(mlp_only_layers=[0])  # layer 0 has a dense MLP with a down_proj Linear
    inject_lora(model, LoRAConfig(r=R, target_modules=["down_proj"], target_parameters=BANKS))
    with pytest.raises(
        CheckpointError,
        match=r"format='peft' cannot express LoRA on 'model\.layers\.0\.mlp\.down_proj'.*qwen3_moe.*"
        r"save with format='native'",
    ):
        save_pretrained(model, tmp_path / "p", format="peft")
    assert not (tmp_path / "p").exists()
    save_pretrained(model, tmp_path / "n")  # the native format holds it


def _edit_peft_config(directory, **changes):
    file = directory / ckpt.PEFT_CONFIG
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def test_peft_config_with_nothing_targeted(tmp_path):
    save_pretrained(adapted(target_parameters=BANKS), tmp_path / "p", format="peft")
    _edit_peft_config(tmp_path / "p", target_parameters=None)
    with pytest.raises(
        CheckpointError, match=r"cannot use:\n(.*\n)*.*target_modules and target_parameters are both empty"
    ):
        load_pretrained(tiny_moe_model(), tmp_path / "p")


def test_peft_target_parameter_that_is_not_an_expert_bank(tmp_path):
    save_pretrained(adapted(target_parameters=BANKS), tmp_path / "p", format="peft")
    _edit_peft_config(tmp_path / "p", target_parameters=["self_attn.q_proj.weight"])
    with pytest.raises(
        CheckpointError, match=r"does not fit this model: .*q_proj\.weight.*not a 3-D expert bank"
    ):
        load_pretrained(tiny_moe_model(), tmp_path / "p")


# ---- a bank stored transposed, (E, in, out), as Transformers' ``is_transposed`` experts (GPT-OSS) keep them


class TransposedExperts(nn.Module):
    is_transposed = True

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN, 2 * EXPERT_INTERMEDIATE) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(NUM_EXPERTS, EXPERT_INTERMEDIATE, HIDDEN) * 0.2)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(NUM_EXPERTS):
            token, slot = torch.where(top_k_index == e)
            gate, up = (hidden_states[token] @ self.gate_up_proj[e]).chunk(2, dim=-1)
            expert_out = (self.act_fn(gate) * up) @ self.down_proj[e]
            out.index_add_(0, token, expert_out * top_k_weights[token, slot, None])
        return out


class ToyMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(HIDDEN, NUM_EXPERTS, bias=False)
        self.experts = TransposedExperts()

    def forward(self, x):
        weights, index = self.router(x).softmax(-1).topk(2, dim=-1)
        return self.experts(x, index, weights)


def test_transposed_banks_match_peft_both_ways(tmp_path):
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(1))
    ours = inject_lora(ToyMoE(), LoRAConfig(r=R, target_parameters=BANKS, init_lora_weights=False))
    assert rel_err(ours(x), ToyMoE()(x)) > 1e-2
    save_pretrained(ours, tmp_path / "p", format="peft")
    tensors = load_file(tmp_path / "p" / ckpt.PEFT_WEIGHTS)
    assert tuple(tensors["base_model.model.experts.base_layer.lora_A.weight"].shape) == (
        NUM_EXPERTS * R,
        HIDDEN,
    )
    _edit_peft_config(tmp_path / "p", task_type=None)  # the toy is no causal LM
    peft_model, missing, unexpected = peft_load(tmp_path / "p", ToyMoE())
    assert missing == [] and unexpected == []
    assert_fp32_close(peft_model(x), ours(x), "PEFT load of transposed banks")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.get_peft_model(
            ToyMoE(), peft.LoraConfig(r=R, target_modules=[], target_parameters=BANKS)
        )
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    theirs.save_pretrained(tmp_path / "from-peft")
    loaded = load_pretrained(ToyMoE(), tmp_path / "from-peft")
    assert_fp32_close(loaded(x), theirs(x), "loralei load of PEFT transposed banks")
