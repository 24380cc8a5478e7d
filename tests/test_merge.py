import pytest
import torch
from transformers import AutoModelForCausalLM

from loralei import (
    InjectionError,
    LoRAConfig,
    disable_lora,
    inject_lora,
    lora_modules,
    merge_and_unload_lora,
    merge_lora,
    unmerge_lora,
)
from tiny_models import tiny_batch, tiny_model


def adapted(dtype=torch.float32, family="llama", **kwargs):
    model = tiny_model(family, dtype=dtype)
    inject_lora(model, LoRAConfig(r=4, lora_alpha=8, init_lora_weights=False, **kwargs))
    return model


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unmerge_restores_base_weights_bit_for_bit(dtype):
    model = adapted(dtype)
    before = weights(model)
    merge_lora(model)
    changed = [n for n, w in weights(model).items() if not torch.equal(w, before[n])]
    assert len(changed) == len(list(lora_modules(model)))  # every adapted weight was changed by merging
    unmerge_lora(model)
    after = weights(model)
    assert all(torch.equal(after[n], w) for n, w in before.items())
    assert all(not m.merged for _, m in lora_modules(model))


def test_merged_forward_matches_unmerged():
    model = adapted(family="qwen2")
    batch = tiny_batch()
    expected = model(**batch).logits
    merge_lora(model)
    torch.testing.assert_close(model(**batch).logits, expected, rtol=1e-5, atol=1e-5)
    merge_lora(model)  # merging twice is a no-op
    torch.testing.assert_close(model(**batch).logits, expected, rtol=1e-5, atol=1e-5)
    unmerge_lora(model)
    torch.testing.assert_close(model(**batch).logits, expected, rtol=0, atol=0)


def test_merge_and_unload_roundtrips_through_transformers(tmp_path):
    model = adapted(family="qwen3")
    before_flags = {n: p.requires_grad for n, p in tiny_model("qwen3").named_parameters()}
    batch = tiny_batch()
    expected = model(**batch).logits
    plain = merge_and_unload_lora(model)
    assert not list(lora_modules(plain))
    assert all("lora" not in n for n, _ in plain.named_modules())
    assert {n: p.requires_grad for n, p in plain.named_parameters()} == before_flags
    plain.save_pretrained(tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="sdpa").eval()
    torch.testing.assert_close(reloaded(**batch).logits, expected, rtol=1e-5, atol=1e-5)
    # The same model can be adapted again after unloading.
    inject_lora(plain, LoRAConfig(r=2, target_modules=["q_proj"]))


def test_disable_lora_gives_base_outputs():
    base = tiny_model()
    model = adapted()
    batch = tiny_batch()
    adapted_logits = model(**batch).logits
    with disable_lora(model):
        torch.testing.assert_close(model(**batch).logits, base(**batch).logits, rtol=0, atol=0)
    torch.testing.assert_close(model(**batch).logits, adapted_logits, rtol=0, atol=0)


def test_disable_while_merged_is_an_error():
    model = adapted()
    merge_lora(model)
    with pytest.raises(InjectionError, match="unmerge_lora"), disable_lora(model):
        pass


@pytest.mark.parametrize("fn", [merge_lora, unmerge_lora, merge_and_unload_lora])
def test_merge_without_lora_is_an_error(fn):
    with pytest.raises(InjectionError, match="no LoRA modules"):
        fn(tiny_model())


def test_merging_into_tied_weights_is_refused():
    model = tiny_model("gemma3")  # ties lm_head to the input embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    inject_lora(model, LoRAConfig(r=2, target_modules=["lm_head"], init_lora_weights=False))
    embeddings = model.model.embed_tokens.weight.clone()
    with pytest.raises(InjectionError, match=r"cannot merge into 'lm_head'.*tied"):
        merge_lora(model)
    assert torch.equal(model.model.embed_tokens.weight, embeddings)
