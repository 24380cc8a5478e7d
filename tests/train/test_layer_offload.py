"""``training.layer_offloading``: the decoder layers' frozen weights stream from host memory, a layer ahead of
use, with the same losses and LoRA gradients as resident weights and at most two layers on the device (here a
"device" copy is another CPU tensor: the mechanism is the one CUDA runs, without the side stream)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_run import losses, make_cfg, run

from loralei.errors import ConfigError, LoraleiError
from loralei.kernels.joint_buffer import joined
from loralei.train import build, layer_offload
from loralei.train.schema import validate_config
from tiny_models import tiny_batch, tiny_model

pytestmark = pytest.mark.usefixtures("optimizers", "one_thread")

CPU = torch.device("cpu")
LAYERS = 4  # enough that "two resident" is a real limit


def cfg_with(lora=None, **training):
    raw = {
        "model": {"name_or_path": "m"},
        "data": {"path": "d"},
        "lora": {"r": 2, "lora_alpha": 4, **(lora or {})},
        "training": training,
        "output_dir": "out",
    }
    return validate_config(raw)


def prepared(device=CPU, lora=None, **training):
    """The tiny model prepared as the runner would, in training mode, its LoRA B factors nonzero (so that every
    factor gets a gradient that depends on the base weights)."""
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    notes = build.prepare_model(model, cfg_with(lora, **training), device)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model.train(), notes


def train_steps(model, steps=2, device=CPU):
    """Losses and LoRA gradients of ``steps`` SGD steps on fixed batches."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.SGD(trainable.values(), lr=0.5)
    record = []
    for step in range(steps):
        batch = {k: v.to(device) for k, v in tiny_batch(seed=step).items()}
        loss = model(**batch).loss
        loss.backward()
        record.append((loss.detach(), {n: p.grad.clone() for n, p in trainable.items()}))
        optimizer.step()
        optimizer.zero_grad()
    return record


def resident_layers(model):
    """The layers whose weights are on the "device" now, read from the parameters themselves."""
    return [i for i, layer in enumerate(model.model.layers) if layer.self_attn.q_proj.weight.numel()]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("checkpointing", [True, "offload"])
def test_losses_and_lora_gradients_equal_resident_weights(monkeypatch, checkpointing, fused):
    options = {"gradient_checkpointing": checkpointing, "fused_lora": fused}
    want = train_steps(prepared(**options)[0])
    model, notes = prepared(**options, layer_offloading=True)
    assert any(
        n.startswith(f"training.layer_offloading: the frozen weights of {LAYERS} decoder") for n in notes
    )
    seen = []  # (layer about to run, layers resident then), in every forward and recomputation
    loaded = layer_offload._loaded

    def spy(load, function, *args, **kwargs):
        load()
        seen.append(resident_layers(model))
        return loaded(load, function, *args, **kwargs)

    monkeypatch.setattr(layer_offload, "_loaded", spy)
    got = train_steps(model)

    for (loss, grads), (want_loss, want_grads) in zip(got, want, strict=True):
        assert torch.equal(loss, want_loss)
        assert grads.keys() == want_grads.keys()
        assert all(torch.equal(grads[n], want_grads[n]) for n in grads)
    # each step: the forward, then the backward's recomputations in reverse, at most two layers resident
    assert len(seen) == 2 * 2 * LAYERS
    assert all(len(resident) <= 2 for resident in seen)
    assert resident_layers(model) == [
        0,
        1,
    ]  # the backward ended on layer 0, layer 1 prefetched for the next pass


def test_the_layers_frozen_weights_stay_where_they_were_loaded_when_the_model_goes_to_the_device():
    """The whole model never has to fit on the device: the rest goes there, the layers' frozen weights stay (the
    "device" here is meta, where nothing is stored)."""
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    build._inject(model, cfg_with().lora)
    frozen = {id(p): (p.data_ptr(), p.detach().clone()) for p in layer_frozen(model)}
    layer_offload.to_device_but_streamed(model, torch.device("meta"))
    assert {id(p): p.data_ptr() for p in layer_frozen(model)} == {k: ptr for k, (ptr, _) in frozen.items()}
    assert all(torch.equal(p, frozen[id(p)][1]) for p in layer_frozen(model))
    rest = [p for p in model.parameters() if id(p) not in frozen]
    assert rest and all(p.is_meta for p in rest)
    assert any(p.requires_grad for p in rest) and all(b.is_meta for b in model.buffers())


def layer_frozen(model):
    return [p for layer in model.model.layers for p in layer.parameters() if not p.requires_grad]


QUANTIZED = {
    "nf4": {"quantization_type": "nf4", "nf4_scaler_block_size": 8},
    "fp8": {"quantization_type": "fp8", "fp8_kernel": "emulated"},
}


def inner_numel(layer) -> int:
    """Elements the layer's packed weights hold in their inner tensors (codes, scales) now."""
    packed = [p for p in layer.parameters() if type(p.data) not in (torch.Tensor, torch.nn.Parameter)]
    assert packed
    return sum(getattr(p, name).numel() for p in packed for name in p.__tensor_flatten__()[0])


@pytest.mark.parametrize("quantization", sorted(QUANTIZED))
def test_quantized_bases_stream_their_codes_and_scales(quantization):
    """NF4 and FP8 bases: the tensors inside each packed weight stream (the wrapper stays), with the same
    losses and LoRA gradients as resident weights."""
    lora = {"quantize_base": True, **QUANTIZED[quantization]}
    want = train_steps(prepared(lora=lora, gradient_checkpointing=True)[0])
    model, _ = prepared(lora=lora, gradient_checkpointing=True, layer_offloading=True)
    streamer = layer_offload.layer_streamer(model)
    assert streamer.host_bytes() > 0 and all(inner_numel(layer) == 0 for layer in model.model.layers)
    weight = model.model.layers[0].self_attn.o_proj.weight
    assert type(weight.data) is not torch.Tensor and weight.numel() == weight.shape.numel()  # the wrapper
    got = train_steps(model)
    for (loss, grads), (want_loss, want_grads) in zip(got, want, strict=True):
        assert torch.equal(loss, want_loss)
        assert grads.keys() == want_grads.keys() and all(torch.equal(grads[n], want_grads[n]) for n in grads)
    assert [i for i, layer in enumerate(model.model.layers) if inner_numel(layer)] == [0, 1]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lora",
    [{"quantization_type": "nf4", "nf4_scaler_block_size": 8}, {"quantization_type": "fp8"}],
    ids=["nf4", "fp8"],
)
def test_on_cuda_packed_weights_stream_as_dense_ones_do(lora):
    """NF4 (its kernels) and FP8 (FP8 GEMMs) bases on CUDA: the same losses and gradients streamed."""
    cuda, lora = torch.device("cuda"), {"quantize_base": True, **lora}
    want = train_steps(prepared(cuda, lora, gradient_checkpointing=True)[0], device=cuda)
    model, _ = prepared(cuda, lora, gradient_checkpointing=True, layer_offloading=True)
    assert all(inner_numel(layer) == 0 for layer in model.model.layers)
    got = train_steps(model, device=cuda)
    for (loss, grads), (want_loss, want_grads) in zip(got, want, strict=True):
        torch.testing.assert_close(loss, want_loss)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name])


@pytest.mark.gpu
def test_on_cuda_weights_stream_from_pinned_memory_on_a_side_stream():
    cuda = torch.device("cuda")
    want = train_steps(prepared(cuda, gradient_checkpointing=True)[0], device=cuda)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model, _ = prepared(cuda, gradient_checkpointing=True, layer_offloading=True)
    peak = torch.cuda.max_memory_allocated() - before
    # every weight of a layer without adapters is a base weight
    layer_bytes = sum(p.numel() * p.element_size() for p in tiny_model("llama").model.layers[0].parameters())
    staying = sum(p.numel() * p.element_size() for p in model.parameters())  # no layer is loaded yet
    # the layers' frozen weights went from where they were loaded to pinned host memory, never to the device
    assert peak < staying + layer_bytes
    streamer = layer_offload.layer_streamer(model)
    assert streamer.stream is not None
    pieces = [piece for layer in streamer.layers for span in layer.spans for piece in span.host.pieces]
    assert pieces and all(piece.is_pinned() for piece in pieces)
    got = train_steps(model, device=cuda)
    for (loss, grads), (want_loss, want_grads) in zip(got, want, strict=True):
        torch.testing.assert_close(loss, want_loss)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name])
    assert len(streamer.resident()) == 2


def test_no_grad_forward_streams_through_the_module_hooks():
    model, _ = prepared(gradient_checkpointing=True)
    batch = tiny_batch()
    with torch.no_grad():
        want = model(**batch).loss
    model, _ = prepared(gradient_checkpointing=True, layer_offloading=True)
    streamer = layer_offload.layer_streamer(model)
    visits = []
    ensure = streamer.ensure
    streamer.ensure = lambda i: (ensure(i), visits.append(sorted(streamer.resident())))
    with torch.no_grad():
        assert torch.equal(model(**batch).loss, want)
    assert visits == [[0, 1], [1, 2], [2, 3], [2, 3]]


def test_a_forward_with_gradients_that_is_not_checkpointed_is_refused():
    model, _ = prepared(gradient_checkpointing=True, layer_offloading=True)
    model.eval()  # Transformers checkpoints in training mode only
    with pytest.raises(LoraleiError, match=r"without gradient checkpointing .*call model\.train"):
        model(**tiny_batch())


def storage_pairs(layer):
    """The pairs of the layer's frozen weights that share one storage."""
    frozen = [(n, p) for n, p in layer.named_parameters() if not p.requires_grad]
    ptr = {n: p.untyped_storage().data_ptr() for n, p in frozen}
    return {(a, b) for a, _ in frozen for b, _ in frozen if a < b and ptr[a] == ptr[b]}


def test_fused_stacked_views_stay_one_storage_after_a_load():
    reference, _ = prepared(gradient_checkpointing=True)
    model, _ = prepared(gradient_checkpointing=True, layer_offloading=True)
    streamer = layer_offload.layer_streamer(model)
    assert resident_layers(model) == []  # everything in host memory until a layer runs
    for turn in range(2):  # a load, and a load again after the layer was released
        streamer.ensure(0)
        layer, want = model.model.layers[0], reference.model.layers[0]
        attention = layer.self_attn
        q, k, v = (attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight)
        assert joined(joined(q, k, 0), v, 0) is not None  # one GEMM still serves q/k/v
        assert storage_pairs(layer) == storage_pairs(want) != set()
        want = dict(want.named_parameters())
        assert all(torch.equal(p, want[n]) for n, p in layer.named_parameters())
        streamer.ensure(2)
        streamer.ensure(3)
        assert resident_layers(model) == [2, 3] and q.numel() == 0, turn


def _problems(**fields):
    lora = fields.pop("lora", None)
    with pytest.raises(ConfigError) as info:
        cfg_with(lora, layer_offloading=True, **fields)
    return str(info.value)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "training.layer_offloading: true does not run without gradient_checkpointing"),
        ({"torch_compile": True}, "with torch_compile: true yet (compiled layers"),
        ({"cuda_graphs": True}, "with cuda_graphs: true (a graph replays the addresses"),
        ({"distributed": "fsdp2"}, "with distributed: fsdp2 (it shards"),
        ({"save_merged": True}, "with training.save_merged: true yet (merging needs"),
    ],
)
def test_settings_it_cannot_run_with_are_refused(fields, message):
    if fields:
        fields["gradient_checkpointing"] = True
    text = _problems(**fields)
    assert message in text
    assert text.count("training.layer_offloading") == 1  # one line, naming the fix
    assert "; set " in text or "; use " in text or "; turn " in text


class _Opaque(torch.Tensor):
    """A tensor subclass that does not say which tensors hold it (no ``__tensor_flatten__``)."""


def test_models_it_cannot_stream_are_refused():
    model = tiny_model("llama")
    model.gradient_checkpointing_enable()
    mlp = model.model.layers[1].mlp
    mlp.up_proj.weight = torch.nn.Parameter(mlp.up_proj.weight.detach().as_subclass(_Opaque), False)
    with pytest.raises(ConfigError, match=r"decoder layer 1's frozen mlp\.up_proj\.weight \(_Opaque\) keeps"):
        layer_offload.offload_layers(model, CPU)
    with pytest.raises(ConfigError, match=r"not checkpointed.*gradient_checkpointing: true or offload"):
        layer_offload.offload_layers(tiny_model("llama"), CPU)


@pytest.mark.parametrize("quantization", [None, "nf4"])
def test_the_runner_trains_the_same_with_layer_offloading(tmp_path, quantization):
    plain = {"gradient_checkpointing": True}
    lora = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1}
    if quantization:
        lora |= {"quantize_base": True, **QUANTIZED[quantization]}
    run(make_cfg(tmp_path / "resident", training=plain, lora=lora), num_hidden_layers=LAYERS)
    streamed = make_cfg(tmp_path / "streamed", training={**plain, "layer_offloading": True}, lora=lora)
    result = run(streamed, num_hidden_layers=LAYERS)
    assert result.steps == 6
    assert losses(tmp_path / "streamed") == losses(tmp_path / "resident")
    assert any("training.layer_offloading: the frozen weights of" in note for note in result.setup_notes)


def test_validate_counts_the_streamed_weights(monkeypatch, capsys) -> None:
    """validate's parameter count is the model's, whether its layers' weights are on the device or streamed."""
    from loralei import cli

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    lines = []
    for streamed in ("false", "true"):
        argv = ["validate", "examples/quickstart.yaml", "training.gradient_checkpointing=true"]
        assert cli.main([*argv, f"training.layer_offloading={streamed}"]) == 0
        lines.append(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("LoRA:")))
    assert lines[0] == lines[1]


def test_expert_banks_stream_with_the_same_losses_and_gradients():
    """An MoE model with LoRA on both expert banks: the frozen banks stream with the attention weights."""
    from tiny_models import tiny_moe_model

    banks = {
        "target_modules": ["q_proj", "v_proj"],
        "target_parameters": ["experts.gate_up_proj", "experts.down_proj"],
    }

    def moe(**training):
        model = tiny_moe_model("qwen3_moe", num_hidden_layers=LAYERS)
        torch.manual_seed(0)
        notes = build.prepare_model(model, cfg_with(banks, gradient_checkpointing=True, **training), CPU)
        generator = torch.Generator().manual_seed(3)  # B nonzero: every factor's gradient reads the bases
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        return model.train(), notes

    want = train_steps(moe()[0])
    model = moe(layer_offloading=True)[0]
    experts = model.model.layers[2].mlp.experts
    assert not experts.gate_up_proj.numel() and not experts.down_proj.numel()  # streamed out
    got = train_steps(model)
    for (loss, grads), (want_loss, want_grads) in zip(got, want, strict=True):
        assert torch.equal(loss, want_loss)
        assert grads.keys() == want_grads.keys() and any("experts" in n for n in grads)
        assert all(torch.equal(grads[n], want_grads[n]) for n in grads)


def test_a_bitsandbytes_4bit_base_streams_its_codes(tmp_path):
    """A model Transformers loaded as bitsandbytes 4-bit: each Params4bit's codes stream (its quant_state stays),
    with the losses and LoRA gradients of the resident base."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS).save_pretrained(
        tmp_path
    )
    bnb = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )

    def loaded(**training):
        model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=bnb)
        torch.manual_seed(0)
        build.prepare_model(model, cfg_with(None, gradient_checkpointing=True, **training), CPU)
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        return model.train()

    want = train_steps(loaded())
    model = loaded(layer_offloading=True)
    q = model.model.layers[1].self_attn.q_proj.weight
    assert type(q).__name__ == "Params4bit" and q.numel() == 0 and q.quant_state is not None
    got = train_steps(model)
    for (loss, grads), (want_loss, want_grads) in zip(got, want, strict=True):
        assert torch.equal(loss, want_loss)
        assert grads.keys() == want_grads.keys() and all(torch.equal(grads[n], want_grads[n]) for n in grads)


def test_other_transformers_quantizations_are_refused_by_name():
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    model.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    assert "loaded quantized by Transformers" in layer_offload.refusal(model)
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    assert "bitsandbytes 4-bit excepted" in layer_offload.refusal(model)
