"""Fast by default: ``training.liger_kernel: auto``, ``training.loss: auto`` and ``training.cuda_graphs: auto``
become the fastest exact path the run's device and model allow, each choice with its reason; explicit values are
kept (an explicit ``cuda_graphs: true`` that cannot run is an error)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from test_run import make_cfg, run

from loralei import LoRAConfig, inject_lora
from loralei.errors import ConfigError
from loralei.train import fast_path
from tiny_models import tiny_model, tiny_moe_model

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture
def liger_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "liger_kernel" else real(name, *a)
    )


@pytest.fixture
def liger_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a)
    )


def test_defaults_are_auto(tmp_path) -> None:
    t = make_cfg(tmp_path).training
    assert (t.liger_kernel, t.loss, t.fused_lora) == ("auto", "auto", True)


def test_on_cuda_loralei_kernels_and_linear_cross_entropy(tmp_path, liger_installed) -> None:
    """The fused path brings its own RMSNorm, RoPE and gated MLP, and the loss is loralei's: no Liger."""
    cfg, notes = fast_path.resolve_liger(make_cfg(tmp_path), CUDA)
    assert cfg.training.liger_kernel is False and notes == [
        "training.liger_kernel: auto -> off: loralei's own kernels run RMSNorm, RoPE and the gated MLP "
        "(training.fused_lora)"
    ]
    cfg, notes = fast_path.resolve_loss(cfg, tiny_model("llama"), CUDA)
    assert cfg.training.loss == "linear_cross_entropy" and "never the full logits" in notes[0]


def test_without_fused_lora_liger_takes_the_layers(tmp_path, liger_installed) -> None:
    cfg, notes = fast_path.resolve_liger(make_cfg(tmp_path, training={"fused_lora": False}), CUDA)
    assert cfg.training.liger_kernel is True and notes == [
        "training.liger_kernel: auto -> on (RMSNorm, RoPE, SwiGLU): CUDA, liger-kernel installed, "
        "training.fused_lora off"
    ]


def test_without_liger_installed_it_says_how_to_get_it(tmp_path, liger_missing) -> None:
    cfg, notes = fast_path.resolve_liger(make_cfg(tmp_path, training={"fused_lora": False}), CUDA)
    assert cfg.training.liger_kernel is False and "pip install 'loralei[liger]'" in notes[0]


def test_on_the_cpu_the_plain_path(tmp_path, liger_installed) -> None:
    cfg, notes = fast_path.resolve_liger(make_cfg(tmp_path), CPU)
    cfg, loss_notes = fast_path.resolve_loss(cfg, tiny_model("llama"), CPU)
    assert (cfg.training.liger_kernel, cfg.training.loss) == (False, "cross_entropy")
    assert notes == ["training.liger_kernel: auto -> off: no CUDA device"]
    assert loss_notes == ["training.loss: auto -> cross_entropy (cpu: the plain head and loss)"]


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (lambda: tiny_model("llama", output_router_logits=True), "output_router_logits: true"),
        (lambda: inject_lora(tiny_model("llama"), LoRAConfig(r=2, target_modules=["lm_head"])), "LoRALinear"),
    ],
    ids=["router-loss", "adapted-head"],
)
def test_a_model_linear_cross_entropy_cannot_train_keeps_cross_entropy(tmp_path, model, reason) -> None:
    cfg, notes = fast_path.resolve_loss(make_cfg(tmp_path), model(), CUDA)
    assert cfg.training.loss == "cross_entropy" and reason in notes[0], notes


def test_explicit_values_are_kept(tmp_path, liger_installed) -> None:
    cfg = make_cfg(tmp_path, training={"liger_kernel": False, "loss": "lce"})
    cfg, notes = fast_path.resolve_liger(cfg, CUDA)
    cfg, loss_notes = fast_path.resolve_loss(cfg, tiny_model("llama"), CUDA)
    assert (cfg.training.liger_kernel, cfg.training.loss, notes, loss_notes) == (
        False,
        "linear_cross_entropy",
        [],
        [],
    )


def test_cut_cross_entropy_keeps_liger_off(tmp_path, liger_installed) -> None:
    training = {"loss": "cce", "fused_lora": False}
    cfg, notes = fast_path.resolve_liger(make_cfg(tmp_path, training=training), CUDA)
    assert cfg.training.liger_kernel is False and "cut_cross_entropy replaces Liger's loss" in notes[0]


def test_the_run_reports_what_auto_chose(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    run(make_cfg(out))
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert "training.liger_kernel: auto -> off: no CUDA device" in text
    assert "training.loss: auto -> cross_entropy" in text
    assert "training.cuda_graphs: auto -> off: no CUDA device" in text


def _graphs(
    tmp_path,
    device=CUDA,
    model=None,
    *,
    distributed=False,
    own_batches=True,
    padded=None,
    top=None,
    **training,
):
    top = {"lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}, **(top or {})}
    cfg = make_cfg(tmp_path, training=training, **top)
    model = model if model is not None else tiny_model("llama")
    return fast_path.resolve_cuda_graphs(
        cfg, model, device, distributed=distributed, own_batches=own_batches, padded_tokens=padded
    )


def _layer_flops(model, tokens: int) -> float:
    """The measure ``padding_refusal`` compares with ``HOST_BOUND_LAYER_FLOPS``."""
    return 6 * sum(p.numel() for p in model.parameters()) * tokens / model.config.num_hidden_layers


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_cuda_graphs_auto_pads_the_runners_batches_where_the_host_sets_the_pace(
    tmp_path, monkeypatch, capability
) -> None:
    """The runner's own batches, of several widths without pad_to_max_length, get graphs by padding every batch to
    the data's widest row where a micro batch so padded is small enough for the model (its eager step waits on
    the host): the tiny model's is, by far."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    model = tiny_model("llama")
    assert _layer_flops(model, 4096) < fast_path.HOST_BOUND_LAYER_FLOPS
    cfg, notes = _graphs(tmp_path, model=model, own_batches=False, padded=4096)
    assert cfg.training.cuda_graphs is True
    assert fast_path.pads_batches(cfg, own_batches=False)
    assert notes == [
        "training.cuda_graphs: auto -> on: CUDA, one process, every batch padded to the data's widest row (4,096 "
        "tokens a micro batch, few enough for this model that the host, not the GPU, sets an eager step's pace); "
        "each micro batch's forward and backward replay a graph"
    ]
    # pad_to_max_length already gives one width, and a caller's own batches are its own: nothing padded
    cfg, _ = _graphs(tmp_path, model=model, own_batches=False, padded=4096, pad_to_max_length=True)
    assert cfg.training.cuda_graphs is True and not fast_path.pads_batches(cfg, own_batches=False)
    cfg, _ = _graphs(tmp_path, model=model)
    assert cfg.training.cuda_graphs is True and not fast_path.pads_batches(cfg, own_batches=True)


def test_cuda_graphs_auto_does_not_pad_where_the_gpu_sets_the_pace(tmp_path, monkeypatch) -> None:
    """Padding costs the GPU time: a micro batch past HOST_BOUND_LAYER_FLOPS a layer, a GPU older than the
    Hopper cards the bound was measured on, or batches whose widest row is not known keep their widths, and auto
    leaves graphs off saying why."""
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    model = tiny_model("llama")
    tokens = int(fast_path.HOST_BOUND_LAYER_FLOPS / _layer_flops(model, 1)) + 1
    cases = [
        (tokens, "padding them to the data's widest row"),
        (None, "batch widths vary with training.pad_to_max_length: false (set it to true for graphs)"),
    ]
    for padded, reason in cases:
        cfg, notes = _graphs(tmp_path, model=model, own_batches=False, padded=padded)
        assert cfg.training.cuda_graphs is False
        assert reason in notes[0] and "set it to true for graphs" in notes[0]
    assert (
        f"({tokens:,} tokens a micro batch) would cost this model more than graphs save"
        in _graphs(tmp_path, model=model, own_batches=False, padded=tokens)[1][0]
    )
    capability[0] = (8, 0)
    cfg, notes = _graphs(tmp_path, model=model, own_batches=False, padded=64)
    assert cfg.training.cuda_graphs is False and "pays where measured, on Hopper GPUs" in notes[0]
    # an explicit true with the runner's batches pads them too (one width for its graphs)
    cfg, _ = _graphs(tmp_path, model=model, own_batches=False, padded=64, cuda_graphs=True)
    assert fast_path.pads_batches(cfg, own_batches=False)


def test_cuda_graphs_auto_turns_on_for_one_cuda_process(tmp_path) -> None:
    cfg, notes = _graphs(tmp_path)
    assert cfg.training.cuda_graphs is True
    # offloaded rows shorter than kept_attention.AUTO_TOKENS keep nothing in host memory: graphs stay on
    cfg, _ = _graphs(tmp_path, gradient_checkpointing="offload", max_seq_length=16_384)
    assert cfg.training.cuda_graphs is True
    assert notes == [
        "training.cuda_graphs: auto -> on: CUDA, one process, batches of one shape; each micro batch's forward "
        "and backward replay a graph"
    ]
    cfg, _ = _graphs(
        tmp_path, own_batches=False, pad_to_max_length=True
    )  # the runner's batches, all one width
    assert cfg.training.cuda_graphs is True


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"device": CPU}, "no CUDA device"),
        ({"distributed": True}, "DDP and FSDP2 run gradient hooks on the host"),
        ({"torch_compile": True}, "torch_compile runs its own graphs"),
        (
            {"layer_offloading": True, "gradient_checkpointing": True},
            "training.layer_offloading moves the layers' weights to new addresses",
        ),
        ({"top": {"model": {"name_or_path": "tiny-llama", "dtype": "float16"}}}, "float16's loss scaler"),
        ({"model": tiny_model("llama", attention_dropout=0.1)}, "config sets attention_dropout=0.1"),
        ({"own_batches": False}, "batch widths vary with training.pad_to_max_length: false"),
        ({"liger_kernel": True, "loss": "cross_entropy"}, "Liger's fused linear cross entropy reads"),
        ({"top": {"lora": {"r": 4, "qat": {"weight": "nvfp4"}}}}, "lora.qat's fake quantization"),
        (
            {"gradient_checkpointing": "offload", "max_seq_length": 32_768},
            "offloaded rows of 32,768 tokens or more keep attention and projection outputs in host memory",
        ),
    ],
)
def test_cuda_graphs_auto_says_why_it_stays_off(tmp_path, kwargs, reason) -> None:
    if "top" in kwargs and "model" in kwargs["top"]:  # float16 needs FP32 LoRA gradients
        kwargs["top"]["lora"] = {"r": 4, "lora_fp32_gradients": True}
    cfg, notes = _graphs(tmp_path, **kwargs)
    assert cfg.training.cuda_graphs is False
    assert (
        len(notes) == 1 and notes[0].startswith("training.cuda_graphs: auto -> off: ") and reason in notes[0]
    )


def _tiny_moe(dtype: torch.dtype, r: int, fused: bool = True, **lora: object) -> torch.nn.Module:
    """The tiny MoE with LoRA on both expert banks (the fused op unless ``fused`` is False)."""
    from loralei import apply_fused_kernels

    model = tiny_moe_model(dtype=dtype)
    banks = ["experts.gate_up_proj", "experts.down_proj"]
    inject_lora(model, LoRAConfig(r=r, target_parameters=banks, **lora))
    if fused:
        apply_fused_kernels(model)
    return model


def test_cuda_graphs_refuse_dropout_moe_routing_and_eager_attention() -> None:
    from loralei.train.graphs import refusal

    model = tiny_model("llama")
    assert refusal(model) is None
    inject_lora(model, LoRAConfig(r=2, target_modules=["q_proj"], lora_dropout=0.05))
    assert refusal(model) == "dropout p=0.05 in LoRALinear"
    plain = tiny_model("llama")
    plain.model.layers[0].mlp = torch.nn.Sequential(torch.nn.Dropout(0.2))
    assert refusal(plain) == "dropout p=0.2 in Dropout"
    assert refusal(_tiny_moe(torch.bfloat16, r=8)) is None  # the fused op on bf16 banks: all on the device
    eager_moe = _tiny_moe(torch.bfloat16, r=8, fused=False)
    assert refusal(eager_moe) == "MoE experts off the fused op loop over the experts on the host"
    assert refusal(_tiny_moe(torch.float32, r=8)).startswith(
        "MoE experts loop over the experts on the host unless their banks are bf16 with widths and rank in "
        "multiples of 8 (here ['torch.float32']"
    )
    assert "widths [2, " in refusal(_tiny_moe(torch.bfloat16, r=2))
    quantized = _tiny_moe(torch.bfloat16, r=8, quantize_base=True, nf4_block_size=16, nf4_scaler_block_size=2)
    assert refusal(quantized) is None  # dequantized whole for a training batch: nothing read on the host
    eager = tiny_model("gemma2")  # Gemma 2 runs eager attention (its soft-capping)
    assert refusal(eager) == (
        "eager attention builds its mask with a host-to-device copy (attn_implementation sdpa replays)"
    )


def test_cuda_graphs_true_that_cannot_run_is_an_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"training.cuda_graphs: true cannot run here: no CUDA device"):
        _graphs(tmp_path, device=CPU, cuda_graphs=True)
    cfg, notes = _graphs(
        tmp_path, own_batches=False, cuda_graphs=True
    )  # widths vary: shapes that repeat get graphs
    assert cfg.training.cuda_graphs is True and notes == []
    cfg, notes = _graphs(tmp_path, cuda_graphs=False)
    assert cfg.training.cuda_graphs is False and notes == []


@pytest.mark.parametrize(
    ("device", "training", "model", "own_model", "chosen"),
    [
        (CUDA, {"packing": True, "max_seq_length": 16384}, {}, False, "flex_attention"),
        (CUDA, {"packing": True, "max_seq_length": 8192}, {}, False, None),  # short rows keep sdpa
        (CUDA, {"packing": False, "max_seq_length": 65536}, {}, False, None),  # one document a row: no mask
        (CPU, {"packing": True, "max_seq_length": 65536}, {}, False, None),  # no CPU backward for flex
        (CUDA, {"packing": True, "max_seq_length": 65536}, {"attn_implementation": "sdpa"}, False, "sdpa"),
        (CUDA, {"packing": True, "max_seq_length": 65536}, {}, True, None),  # the caller's model has its own
    ],
)
def test_long_packed_rows_on_cuda_get_flex_attention(
    tmp_path, device, training, model, own_model, chosen
) -> None:
    cfg = make_cfg(tmp_path, training=training, model={"name_or_path": "tiny-llama", **model})
    resolved, notes = fast_path.resolve_attention(cfg, device, own_model=own_model)
    assert resolved.model.attn_implementation == chosen
    if chosen == "flex_attention":
        assert resolved.attn_implementation == "flex_attention"
        assert notes == [
            "attention: flex_attention for packed rows of up to 16384 tokens (a block-sparse document mask; sdpa "
            "would hold an L×L mask per row); set model.attn_implementation to choose"
        ]
    else:
        assert resolved is cfg and notes == []


def test_the_runner_pads_its_own_batches_to_the_widest_row_where_graphs_replay_them(
    tmp_path, monkeypatch
) -> None:
    """run._graphs, as on a Hopper GPU (graphs' other refusals passed): the runner's collator pads every batch of
    its data to the widest row, and leaves a caller's collator alone."""
    import dataclasses
    import json

    from transformers import AutoTokenizer

    from loralei.train import build_data, launch, run
    from loralei.train.data import prepare_sft_dataset
    from loralei.train.setup import Parts

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fast_path, "_graphs_refusal", lambda *args: None)
    tokenizer = AutoTokenizer.from_pretrained(
        Path(__file__).resolve().parents[2] / "examples/quickstart/model"
    )
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": "ab" * n}) + "\n" for n in (2, 9, 4)))
    dataset = prepare_sft_dataset(tokenizer, path=str(path), max_seq_length=64, packing=False)
    cfg = make_cfg(tmp_path, training={"batch_size": 2})
    model = tiny_model("llama")
    collate = build_data.make_collate(cfg, tokenizer)
    parts = Parts(model, tokenizer, dataset, None, collate, [])
    one = launch.Launch("none")
    resolved, padded, notes = run._graphs(cfg, parts, CUDA, one, own_batches=False)
    assert resolved.training.cuda_graphs is True and "(38 tokens a micro batch" in notes[0]
    assert dataset.widest_row() == 19 and padded.collate_fn == dataclasses.replace(collate, pad_width=19)
    assert padded.collate_fn([dataset[0]])["input_ids"].shape == (1, 19)
    _, kept, _ = run._graphs(cfg, parts, CUDA, one, own_batches=True)
    assert kept.collate_fn is collate
