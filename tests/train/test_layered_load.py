"""A base to be packed is read one decoder layer at a time: the layer's targets packed before the next is read,
with the same packed weights (and so outputs) as loading the whole model and packing it at injection."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch.nn.attention import SDPBackend, sdpa_kernel

from loralei.errors import InjectionError
from loralei.inject import lora_modules
from loralei.modules.principal_init import initial_factors
from loralei.modules.quantized import as_quantized, quantize_weight
from loralei.train import build, heap, layered_load
from loralei.train.schema import validate_config
from tiny_models import tiny_batch, tiny_model

CPU = torch.device("cpu")
LAYERS = 3
NF4 = {"quantize_base": True, "quantization_type": "nf4", "nf4_scaler_block_size": 8}


@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    tiny_model("llama", num_hidden_layers=LAYERS).save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def cfg_for(checkpoint: Path, lora=None, dtype="float32", **training):
    return validate_config(
        {
            "model": {"name_or_path": str(checkpoint), "dtype": dtype},
            "data": {"path": "d"},
            "lora": {"r": 2, "lora_alpha": 4, "target_modules": "all-linear", **(lora or {})},
            "training": training,
            "output_dir": "out",
        }
    )


def packed_state(model) -> dict[str, torch.Tensor]:
    """Every base weight as the model computes with it (packed ones dequantized), by name."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        quantized = as_quantized(p)
        out[name] = p.detach() if quantized is None else quantized.dequantize()
    return out


class Recording:
    """A tensor source that records the names of each read."""

    def __init__(self, source) -> None:
        self.source, self.reads = source, []

    def names(self):
        return self.source.names()

    def read(self, names):
        self.reads.append(sorted(names))
        return self.source.read(names)


def test_each_layer_is_read_and_its_targets_packed_before_the_next_is_read(checkpoint):
    cfg = cfg_for(checkpoint, NF4)
    source = Recording(layered_load.SafetensorsDirectory(checkpoint))
    model = layered_load.empty_model(_config(checkpoint), torch.float32, "sdpa", False)
    packed_when_read = []
    read = source.read

    def spy(names):  # before each layer's read: how many layers hold packed targets
        packed_when_read.append(sum(_packed(layer) for layer in model.model.layers))
        return read(names)

    source.read = spy
    layered_load.load_by_layers(model, source, cfg.lora, CPU)
    outside, *layers = source.reads
    assert not any(n.startswith("model.layers.") for n in outside)
    assert [{n.split(".")[2] for n in names} for names in layers] == [{str(i)} for i in range(LAYERS)]
    assert packed_when_read == [0, *range(LAYERS)]  # layer i is read once layers 0..i-1 are packed
    assert all(_packed(layer) for layer in model.model.layers)
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())


def _config(checkpoint: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(checkpoint)


def _packed(layer) -> bool:
    """Whether every linear of the layer holds a packed weight."""
    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    return bool(linears) and all(as_quantized(m.weight) is not None for m in linears)


def test_a_tied_head_is_read_once_and_stays_tied(tmp_path):
    """The quickstart's model ties its head to the embeddings, and its checkpoint holds the matrix once."""
    tiny_model("llama", num_hidden_layers=LAYERS, tie_word_embeddings=True).save_pretrained(tmp_path / "tied")
    cfg = cfg_for(tmp_path / "tied", NF4)
    model, how = build.load_model(cfg, CPU)
    assert how == "model: read one decoder layer at a time, each packed as it arrived"
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.weight.is_meta
    whole = tiny_model("llama", num_hidden_layers=LAYERS, tie_word_embeddings=True)
    assert torch.equal(model.lm_head.weight, whole.lm_head.weight)


@pytest.mark.parametrize("quantization", ["nf4", "fp8"])
def test_the_runner_reads_a_packed_base_layer_by_layer_with_the_weights_of_a_whole_load(
    checkpoint, quantization
):
    lora = NF4 if quantization == "nf4" else {"quantize_base": True, "quantization_type": "fp8"}
    cfg = cfg_for(checkpoint, {**lora, "fp8_kernel": "emulated"} if quantization == "fp8" else lora)
    model, how = build.load_model(cfg, CPU)
    assert how == "model: read one decoder layer at a time, each packed as it arrived"
    build.prepare_model(model, cfg, CPU)
    whole = tiny_model("llama", num_hidden_layers=LAYERS)
    build.prepare_model(whole, cfg, CPU)
    got, want = packed_state(model), packed_state(whole)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in got)
    batch = tiny_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, whole(**batch).logits, rtol=0, atol=0)


def loss_and_grads(model):
    model.train()
    loss = model(**tiny_batch()).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_with_layer_offloading_the_packed_layers_stream_from_where_they_were_read(checkpoint):
    """The packed layers are kept in host memory (here the CPU stands for both) and stream from there, with the
    loss and LoRA gradients of the same base resident."""
    resident = cfg_for(checkpoint, NF4, gradient_checkpointing=True)
    streamed = cfg_for(checkpoint, NF4, gradient_checkpointing=True, layer_offloading=True)
    want = build.load_model(resident, CPU)[0]
    torch.manual_seed(0)  # the same LoRA factors
    build.prepare_model(want, resident, CPU)
    model = build.load_model(streamed, CPU)[0]
    torch.manual_seed(0)
    notes = build.prepare_model(model, streamed, CPU)
    assert any(n.startswith("training.layer_offloading:") for n in notes)
    q = model.model.layers[1].self_attn.q_proj.weight  # streamed out: its codes hold no elements
    assert all(getattr(q, name).numel() == 0 for name in q.__tensor_flatten__()[0])
    (loss, grads), (want_loss, want_grads) = loss_and_grads(model), loss_and_grads(want)
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys() and all(torch.equal(grads[n], want_grads[n]) for n in grads)


def read_all(checkpoint: Path) -> dict[str, torch.Tensor]:
    source = layered_load.SafetensorsDirectory(checkpoint)
    return source.read(sorted(source.names()))


def test_a_checkpoint_whose_names_differ_from_the_models_loads_whole_and_says_why(checkpoint):
    tensors = read_all(checkpoint)
    tensors["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(checkpoint / layered_load.SINGLE), metadata={"format": "pt"})
    model, how = build.load_model(cfg_for(checkpoint, NF4), CPU)
    assert how == (
        "model: loaded whole first (the checkpoint's 'model.layers.0.mlp.experts.0.up_proj.weight' is "
        "not a tensor of the model (Transformers converts it))"
    )
    assert not any(p.is_meta for p in model.parameters())


def test_a_sharded_checkpoint_is_read_through_its_index(checkpoint):
    tensors = read_all(checkpoint)
    (checkpoint / layered_load.SINGLE).unlink()
    names = sorted(tensors)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(checkpoint / file), metadata={"format": "pt"})
    weight_map = {n: file for file, part in shards.items() for n in part}
    (checkpoint / layered_load.INDEX).write_text(json.dumps({"weight_map": weight_map}))
    source = layered_load.SafetensorsDirectory(checkpoint)
    assert source.names() == set(names)
    got = source.read(names)
    assert all(torch.equal(got[n], tensors[n]) for n in names)


def test_a_dense_base_loads_through_transformers(checkpoint):
    model, how = build.load_model(cfg_for(checkpoint), CPU)
    assert how is None and not any(p.is_meta for p in model.parameters())


def test_a_dense_base_whose_layers_stream_is_read_layer_by_layer_and_trains_as_one_loaded_whole(
    checkpoint, monkeypatch
):
    """Its layers are read in turn (and the heap trimmed after each), nothing packed; the losses and LoRA
    gradients equal those of the model Transformers loads whole."""
    cfg = cfg_for(checkpoint, gradient_checkpointing=True, layer_offloading=True)
    trims = []
    monkeypatch.setattr(heap, "trim", lambda: trims.append(1))
    model, how = build.load_model(cfg, CPU)
    assert how == "model: read one decoder layer at a time" and len(trims) == LAYERS
    assert not any(as_quantized(p) is not None for p in model.parameters())
    torch.manual_seed(0)
    build.prepare_model(model, cfg, CPU)
    whole = tiny_model("llama", num_hidden_layers=LAYERS)
    torch.manual_seed(0)
    build.prepare_model(whole, cfg, CPU)
    (loss, grads), (want_loss, want_grads) = loss_and_grads(model), loss_and_grads(whole)
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys() and all(torch.equal(grads[n], want_grads[n]) for n in grads)


def test_the_heap_is_trimmed_where_the_c_library_can():
    """On glibc (Linux CI) malloc_trim is found; trimming never fails."""
    heap.trim()
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        assert heap._malloc_trim() is not None


@pytest.mark.parametrize("quantization", ["nf4", "fp8"])
def test_a_packed_weight_moves_its_inner_tensors_and_stays_packed(quantization):
    lora = cfg_for(
        Path("m"), NF4 if quantization == "nf4" else {"quantize_base": True, "quantization_type": "fp8"}
    )
    packed = quantize_weight(torch.randn(16, 32), lora.lora).data
    meta = layered_load.moved(packed, torch.device("meta"))
    assert type(meta) is type(packed) and meta.shape == packed.shape
    names, _ = meta.__tensor_flatten__()
    assert all(getattr(meta, name).is_meta for name in names)
    back = layered_load.moved(packed, CPU)
    assert torch.equal(as_quantized(back).dequantize(), as_quantized(packed).dequantize())


def test_a_checkpoint_quantized_already_loads_through_transformers(checkpoint, monkeypatch):
    """Its layout is Transformers' to read (e.g. FP8 codes with block scales): no layered read is tried."""
    import transformers

    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (checkpoint / "config.json").write_text(json.dumps(config))
    whole = tiny_model("llama", num_hidden_layers=LAYERS)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: whole)
    model, how = build.load_model(cfg_for(checkpoint, NF4), CPU)
    assert model is whole
    assert how == (
        "model: loaded whole first (the checkpoint is quantized already: Transformers reads its layout)"
    )


def test_a_model_with_modules_kept_in_float32_loads_through_transformers(checkpoint):
    """Transformers' loader upcasts them whatever the dtype; a model built from its config does not."""
    model = layered_load.empty_model(_config(checkpoint), torch.bfloat16, "sdpa", False)
    source = layered_load.SafetensorsDirectory(checkpoint)
    assert layered_load.mismatch(model, source) is None
    model._keep_in_fp32_modules_strict = {"lm_head"}
    assert (
        layered_load.mismatch(model, source)
        == "the model keeps some modules in float32, as Transformers' loader does"
    )


def test_bad_targets_are_refused_by_name_before_any_layer_is_read(checkpoint, monkeypatch):
    """A target that matches nothing, or a weight NF4's default blocks cannot hold (the tiny model's), is the
    error injection gives, raised before the first read."""
    reads = []
    read = layered_load.SafetensorsDirectory.read
    monkeypatch.setattr(
        layered_load.SafetensorsDirectory, "read", lambda self, n: reads.append(n) or read(self, n)
    )
    typo = cfg_for(checkpoint, {**NF4, "target_modules": ["q_proj", "v_porj"]})
    with pytest.raises(InjectionError, match=r"^lora\.target_modules: .*'v_porj'"):
        build.load_model(typo, CPU)
    blocks = cfg_for(checkpoint, {"quantize_base": True, "quantization_type": "nf4"})
    with pytest.raises(
        InjectionError, match=r"module 'model\.layers\.0\.self_attn\.q_proj': weight .* not a multiple"
    ):
        build.load_model(blocks, CPU)
    assert reads == []


GPU_BASES = {
    "nf4": ("float32", NF4),
    "fp8": ("float32", {"quantize_base": True, "quantization_type": "fp8"}),
    # the tiny model's down projections take 48 inputs, which int4's groups of 32 do not divide
    "int4": (
        "bfloat16",
        {
            "quantize_base": True,
            "quantization_type": "int4",
            "int4_group_size": 32,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"],
        },
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(GPU_BASES))
def test_on_cuda_layers_packed_on_the_gpu_stream_from_host_memory(checkpoint, kind):
    """Each layer packed on the GPU as it is read, then kept in host memory and streamed: the loss and LoRA
    gradients of the same layered load kept on the device."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    dtype, lora = GPU_BASES[kind]

    def loaded(**training):
        cfg = cfg_for(checkpoint, lora, dtype, gradient_checkpointing=True, **training)
        model, how = build.load_model(cfg, cuda)
        assert how == "model: read one decoder layer at a time, each packed as it arrived"
        torch.manual_seed(0)
        build.prepare_model(model, cfg, cuda)
        return model

    want = loaded()
    model = loaded(layer_offloading=True)
    # the same adapter in both, B not zero (else the loss would not see A): streamed, the factors are made
    # beside the host-resident bases and drawn from another generator
    g = torch.Generator().manual_seed(1)
    for p, w in zip(model.parameters(), want.parameters(), strict=True):
        if p.requires_grad:
            w.data.copy_(torch.randn(w.shape, generator=g) * 0.1)
            p.data.copy_(w.data)
    q = model.model.layers[1].self_attn.q_proj.weight
    assert all(getattr(q, name).numel() == 0 for name in q.__tensor_flatten__()[0])
    batch = {k: v.to(cuda) for k, v in tiny_batch().items()}
    # the math kernel's attention backward: the fused kernels' query gradients vary from run to run (atomics)
    with sdpa_kernel(SDPBackend.MATH):
        got_loss, want_loss = model.train()(**batch).loss, want.train()(**batch).loss
        got_loss.backward()
        want_loss.backward()
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    for (name, p), w in zip(model.named_parameters(), want.parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(
                p.grad, w.grad, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}"
            )


def test_a_pissa_base_to_pack_loads_whole_and_packs_the_residual(checkpoint):
    """Layers packed as they arrive would leave no dense weight to take the principal part from."""
    cfg = cfg_for(checkpoint, {**NF4, "init_lora_weights": "pissa"})
    model, how = build.load_model(cfg, CPU)
    assert (
        how
        == "model: loaded whole first (lora.init_lora_weights: pissa: the residual is packed, not the weights read)"
    )
    build.prepare_model(model, cfg, CPU)
    modules = [m for _, m in lora_modules(model)]
    assert modules and all(m.quant is not None and initial_factors(m) is not None for m in modules)
