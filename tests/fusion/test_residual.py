"""Pre-norm decoder layers whose residual adds run inside the RMSNorm kernels (``loralei.fusion.residual``): which
layers qualify (by their forward's output, not their class name), what the probe leaves behind, that the fused
layer hands the attention what the class forward does, and that the kernels take the adds (interpreter, fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from loralei import LoRAConfig, apply_fused_kernels, inject_lora, remove_fused_kernels
from loralei.fusion import mlp as mlp_fusion
from loralei.fusion import residual
from loralei.kernels import rms_norm as norm_kernels
from loralei.ops import lowrank_sum
from tiny_models import tiny_batch, tiny_model
from tolerances import assert_low_precision_close


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    inject_lora(model, LoRAConfig(r=4, lora_alpha=8, init_lora_weights=False))
    return model.train()


def _not_fused(report) -> dict[str, str]:
    return {entry.name: entry.reason for entry in report.not_fused if entry.kind == "residual adds"}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_pre_norm_layers_are_fused(family) -> None:
    model = _lora(tiny_model(family))
    report = apply_fused_kernels(model)
    assert report.count("residual adds") == 2 and not _not_fused(report)
    assert all(residual.is_installed(layer) for layer in model.model.layers)
    assert "residual adds: inside the RMSNorm kernels in 2 decoder layers" in str(report)


@pytest.mark.parametrize(
    ("before", "name", "follows"),
    [
        ("model.layers.3", "model.layers.4", True),
        ("model.layers.9", "model.layers.10", True),
        ("model.layers.4", "model.layers.4", False),
        ("model.layers.5", "model.layers.4", False),
        ("model.layers.3", "model.layers.5", False),
        ("vision.layers.3", "model.layers.4", False),
        ("", "model.layers.0", False),
        ("model.layers.x", "model.layers.y", False),
    ],
)
def test_a_layer_follows_the_entry_before_it_in_the_same_list(before, name, follows) -> None:
    """The layer whose down projection's output gradient a layer's first norm makes: the one just before it in
    the same list, never one of another list or stack."""
    assert residual.follows(before, name) is follows


def test_each_layer_after_the_first_knows_the_down_projection_before_it() -> None:
    model = inject_lora(tiny_model("llama"), LoRAConfig(r=4, target_modules="all-linear"))
    apply_fused_kernels(model)
    layers = model.model.layers
    upstream = [vars(layer)["forward"].args[2].upstream for layer in layers]  # (layer, names, readers, ...)
    assert upstream == [None, *(layer.mlp.down_proj for layer in layers[:-1])]


def test_layers_of_another_composition_keep_their_forward() -> None:
    """Gemma 2 also normalises the attention and MLP outputs; Phi-3 with a residual dropout drops values the
    composition would keep (the probe runs in training mode). Neither is a pre-norm layer: nothing to report."""
    for model in (tiny_model("gemma2"), tiny_model("phi3", resid_pdrop=0.1)):
        model = _lora(model)
        report = apply_fused_kernels(model)
        assert report.count("residual adds") == 0 and not report.not_fused
        assert not any(residual.is_installed(m) for m in model.modules())


class ScaledResidualLayer(LlamaDecoderLayer):
    """A Llama layer that scales its branches before adding them (as Granite does): same children, other sums."""

    def forward(self, hidden_states, **kwargs):
        h = (
            hidden_states
            + 0.5 * self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)[0]
        )
        return h + 0.5 * self.mlp(self.post_attention_layernorm(h))


def test_the_probe_reads_the_forward_not_the_children() -> None:
    model = _lora(tiny_model("llama"))
    layer = model.model.layers[0]
    layer.__class__ = ScaledResidualLayer
    report = apply_fused_kernels(model)
    assert not residual.is_pre_norm_layer(layer) and not _not_fused(report)
    assert report.count("residual adds") == 1 and not residual.is_installed(layer)


def test_hooked_norms_or_unfused_norms_keep_the_layer_apart() -> None:
    model = _lora(tiny_model("llama"))
    model.model.layers[1].post_attention_layernorm.register_forward_hook(lambda *a: None)
    report = apply_fused_kernels(model)
    assert _not_fused(report) == {
        "model.layers.1": "hooks on its norms (the fused forward does not call those modules)"
    }
    report = apply_fused_kernels(model, norms=False)
    assert report.count("residual adds") == 0 and not _not_fused(report)


def test_the_probe_leaves_modes_children_and_the_rng_as_they_were() -> None:
    model = _lora(tiny_model("phi3")).eval()
    layer = model.model.layers[0]
    children = dict(layer.named_children())
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    assert residual.matches(layer)
    assert torch.equal(torch.rand(3), expected)
    assert dict(layer.named_children()) == children
    assert not any(m.training for m in layer.modules())


def test_the_attention_gets_what_the_class_forward_hands_it(monkeypatch) -> None:
    """Arguments the caller leaves out reach the attention with the class forward's defaults, extra keyword
    arguments pass through; a positional argument after the hidden states, or the hidden states by keyword,
    take the class forward."""
    model = apply_fused_kernels_model()
    layer = model.model.layers[0]
    received = []
    attention = layer.self_attn
    forward = attention.forward

    def spy(*args, **kwargs):
        received.append(kwargs)
        return forward(*args, **kwargs)

    monkeypatch.setattr(attention, "forward", spy)
    x = torch.randn(1, 5, 32)
    cos_sin = model.model.rotary_emb(x, torch.arange(5)[None])
    fused = layer(x, position_embeddings=cos_sin, extra_argument=3)
    plain = type(layer).forward(layer, x, position_embeddings=cos_sin, extra_argument=3)
    assert received[0].keys() == received[1].keys() and received[0]["extra_argument"] == 3
    assert received[0]["use_cache"] is False and received[0]["attention_mask"] is None
    torch.testing.assert_close(fused, plain)
    class_forward = []
    monkeypatch.setattr(type(layer), "forward", lambda *a, **k: class_forward.append(a) or x)
    layer(x, None)
    layer(hidden_states=x)
    assert len(class_forward) == 2


def apply_fused_kernels_model() -> torch.nn.Module:
    model = _lora(tiny_model("llama"))
    apply_fused_kernels(model)
    return model


def test_the_kernels_take_the_adds(monkeypatch) -> None:
    """Each layer's second norm forms the sum as it loads; in the backward every layer norm adds the residual
    path's gradient in-kernel (the embeddings' output asks for a gradient here: ``inject_lora``'s input-gradient
    hooks). Loss and gradients stay those of the plain model (``test_fused_model_equivalence``)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = apply_fused_kernels_model()
    forwards, backwards = [], []
    forward, backward = norm_kernels._forward_impl, norm_kernels._backward_impl
    monkeypatch.setattr(
        norm_kernels, "_forward_impl", lambda *a: forwards.append(a[1] is not None) or forward(*a)
    )
    monkeypatch.setattr(
        norm_kernels, "_backward_impl", lambda *a: backwards.append(a[-1] is not None) or backward(*a)
    )
    model(**tiny_batch()).loss.backward()
    # per layer: the input norm, then the norm that adds the attention's output; the final norm
    assert forwards == [False, True, False, True, False]
    # the final norm (no residual path after it), then layer 1's norms and layer 0's, backwards
    assert backwards == [False, True, True, True, True]


def test_removing_the_fusion_restores_the_class_forward() -> None:
    model = apply_fused_kernels_model()
    assert remove_fused_kernels(model)
    assert not any("forward" in vars(layer) for layer in model.model.layers)


def _loss_and_grads(model: torch.nn.Module, batch: dict) -> list[torch.Tensor]:
    loss = model(**batch).loss
    params = [p for p in model.parameters() if p.requires_grad]
    return [loss.detach(), *torch.autograd.grad(loss, params)]


def _same_bits_with_and_without(model: torch.nn.Module, batch: dict) -> None:
    """The model's loss and every LoRA gradient, with the layers' residual adds in the kernels and apart."""
    fused = _loss_and_grads(model, batch)
    for layer in model.model.layers:
        residual.uninstall(layer)
    apart = _loss_and_grads(model, batch)
    assert all(torch.equal(f, a) for f, a in zip(fused, apart, strict=True))


def test_the_adds_in_the_kernels_change_no_bit_of_the_model(monkeypatch) -> None:
    """Interpreter, fp32: the same loss and gradients to the bit as the same kernels with torch's adds. The down
    projection's LoRA term joins the last add here too: in fp32 that sum makes the same roundings in the same
    order as the MLP's output and torch's add."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = apply_fused_kernels_model()
    joined = _Count(lowrank_sum._LowRankSum, "apply", monkeypatch)
    _same_bits_with_and_without(model, tiny_batch())
    assert joined.calls == 2  # one per layer, in the fused run


class _Count:
    """Counts the calls of ``owner.name`` (patched for the test)."""

    def __init__(self, owner: object, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
        real, self.calls = getattr(owner, name), 0

        def counted(*args):
            self.calls += 1
            return real(*args)

        monkeypatch.setattr(owner, name, counted)


def test_an_mlp_with_hooks_keeps_its_term_and_runs_its_hooks(monkeypatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = apply_fused_kernels_model()
    seen = []
    model.model.layers[0].mlp.register_forward_hook(lambda *_: seen.append(0))
    joined = _Count(lowrank_sum._LowRankSum, "apply", monkeypatch)
    model(**tiny_batch()).loss.backward()
    assert seen == [0] and joined.calls == 1  # layer 1 only


def _gpu_model_and_batch() -> tuple[torch.nn.Module, dict]:
    """bf16 on the GPU, eager attention (its backward is deterministic)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _lora(tiny_model("llama", dtype=torch.bfloat16, hidden_size=256, intermediate_size=512).cuda())
    model.set_attn_implementation("eager")
    apply_fused_kernels(model)
    return model, {k: v.cuda() for k, v in tiny_batch(batch=4, seq=256).items()}


def _mlp_term_kept(mlp: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return residual + mlp(x)


@pytest.mark.gpu
def test_the_adds_in_the_kernels_change_no_bit_of_the_model_on_the_gpu(monkeypatch) -> None:
    """bf16, the down term kept in the MLP (in bf16 its join rounds once where the MLP and the add round twice:
    the next test)."""
    monkeypatch.setattr(mlp_fusion, "forward_with_residual", _mlp_term_kept)
    _same_bits_with_and_without(*_gpu_model_and_batch())


@pytest.mark.gpu
def test_the_down_term_in_the_last_add_on_the_gpu(monkeypatch) -> None:
    """bf16: loss and gradients with the down term in the last add, judged against the fp64 model like every
    fused path against its twin (the term kept in the MLP)."""
    model, batch = _gpu_model_and_batch()
    joined = _Count(lowrank_sum._LowRankSum, "apply", monkeypatch)
    fused = _loss_and_grads(model, batch)
    assert joined.calls == 2
    with monkeypatch.context() as patch:
        patch.setattr(mlp_fusion, "forward_with_residual", _mlp_term_kept)
        kept = _loss_and_grads(model, batch)
    exact = _loss_and_grads(model.double(), batch)
    for i, (f, k, e) in enumerate(zip(fused, kept, exact, strict=True)):
        assert_low_precision_close(f, k, e, torch.bfloat16, "loss" if i == 0 else f"gradient {i}")


def test_checkpointed_layers_recompute_the_fused_composition(monkeypatch) -> None:
    """Under Transformers' gradient checkpointing each layer's composition runs twice (forward, recomputation),
    whichever way this Transformers release checkpoints (around ``__call__`` or inside the class forward), and
    the gradients keep their bits."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = apply_fused_kernels_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    runs = []
    composition = residual._composition
    monkeypatch.setattr(residual, "_composition", lambda *a: runs.append(1) or composition(*a))
    _same_bits_with_and_without(model, tiny_batch())
    assert len(runs) == 2 * 2


def test_a_checkpointed_call_with_a_cache_takes_the_class_forward(monkeypatch) -> None:
    """Where Transformers checkpoints inside the class forward, its wrapper drops a KV cache before checkpointing:
    such a call goes there; without the cache the fused layer checkpoints itself."""
    if not residual.CHECKPOINTS_IN_FORWARD:
        pytest.skip("this Transformers checkpoints around __call__, which drops the cache itself")
    model = apply_fused_kernels_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layer, runs = model.model.layers[0], []
    composition = residual._composition
    monkeypatch.setattr(residual, "_composition", lambda *a: runs.append(1) or composition(*a))
    x = torch.randn(1, 5, 32, requires_grad=True)
    cos_sin = model.model.rotary_emb(x, torch.arange(5)[None])
    layer(x, position_embeddings=cos_sin, use_cache=True)
    assert runs == []
    layer(x, position_embeddings=cos_sin)
    assert runs == [1]
