"""DoRA down projections' outputs kept from a checkpointed layer's forward (loralei.train.kept_dora): each layer's
recomputation takes its DoRA down output back instead of forming down's product again, with the loss and every
gradient the same bits as recomputing it; a pass past the host budget forms it again; the run says what it kept."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loralei import LoRAConfig, apply_fused_kernels, inject_lora
from loralei.errors import LoraleiError
from loralei.ops.dora import DoRAScale
from loralei.ops.lora_mlp import lora_mlp
from loralei.ops.weights import LoRAWeights
from loralei.train import checkpointing, kept_attention, kept_dora
from loralei.train.checkpointing import enable_checkpointing, offload_summary
from loralei.train.input_checkpoint import _CHAIN
from tiny_models import perturb_magnitudes, tiny_batch, tiny_model

LAYERS = 2  # tiny_model's


@pytest.fixture(autouse=True)
def one_pass_per_test() -> Iterator[None]:
    yield
    _CHAIN.copies.clear()


class DownProducts(TorchDispatchMode):
    """Counts the products of the down projections' base weights that form an output (``h W_dᵀ``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.weights = {layer.mlp.down_proj.weight.data_ptr() for layer in model.model.layers}
        self.hidden, self.count = model.config.hidden_size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        products = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default)
        if func in products and args[-1].data_ptr() in self.weights and out.shape[1] == self.hidden:
            self.count += 1
        return out


def dora_model(down_dora: bool = True) -> torch.nn.Module:
    """The fused tiny DoRA Llama (DoRA on every projection, or on all but down)."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoRAConfig(r=4, lora_alpha=8, use_dora=True, init_lora_weights=False, target_modules=targets)
    if not down_dora:
        config = LoRAConfig(
            r=4, lora_alpha=8, use_dora=True, init_lora_weights=False, target_modules=targets[:-1]
        )
    model = perturb_magnitudes(inject_lora(tiny_model(), config))
    apply_fused_kernels(model)
    return model


def step(
    keep: bool,
    monkeypatch: pytest.MonkeyPatch,
    offload: bool = False,
    down_dora: bool = True,
    device: str = "cpu",
) -> tuple[list[torch.Tensor], int, list[str], torch.nn.Module]:
    """One forward and backward of the tiny DoRA Llama under the runner's checkpointing (``offload`` or ``true``),
    keeping DoRA down outputs (``keep``) or not: the loss and every trainable gradient, the down products formed,
    the report lines of enabling checkpointing, and the model."""
    model = dora_model(down_dora).to(device)
    with monkeypatch.context() as patch:
        if not keep:
            patch.setattr(kept_dora, "owners", lambda model: frozenset())
        notes = enable_checkpointing(model, compiled=False, offload=offload)
    model.train()
    with DownProducts(model) as products:
        out = model(**{k: v.to(device) for k, v in tiny_batch().items()})
        out.loss.backward()
    grads = [out.loss.detach(), *(p.grad for p in model.parameters() if p.requires_grad)]
    return grads, products.count, notes, model


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("offload", [False, True], ids=["checkpointing-true", "offload"])
def test_dora_down_outputs_are_kept_and_train_as_recomputed(
    monkeypatch: pytest.MonkeyPatch, offload: bool, device: str
) -> None:
    """The same loss and gradients, bit for bit (on CUDA: pinned buffers, copies on a side stream, the Triton MLP
    kernels), with one down product a layer instead of two."""
    want, recomputed, plain_notes, _ = step(False, monkeypatch, offload, device=device)
    got, kept, notes, model = step(True, monkeypatch, offload, device=device)
    assert (recomputed, kept) == (2 * LAYERS, LAYERS)  # the forward's product only
    assert len(got) == len(want) > 1 + 7 * LAYERS * 2
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert not any(note.startswith("DoRA:") for note in plain_notes)
    assert any(note.startswith("DoRA: the outputs of its 2 down projections kept") for note in notes), notes
    summary = offload_summary(model)
    assert summary is not None and summary.endswith("DoRA down outputs kept in 2 of 2 layers"), summary
    assert ("GiB of pinned host memory" in summary) is (device == "cuda")
    assert _CHAIN.copies == []  # the pass is over


def test_under_torchs_checkpoint_dora_saves_the_same_in_the_forward_and_its_recomputation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With several processes the runner checkpoints through torch's non-reentrant checkpoint, which checks that
    a layer's recomputation saves the tensors its first forward saved: the DoRA nodes save their outputs in both
    (the first forward's saves are dropped), and the loss and every gradient are those of the input-only
    checkpoint of one process, bit for bit (before, the recomputation alone saved them and the backward failed)."""
    want, _, _, _ = step(False, monkeypatch)
    monkeypatch.setattr(checkpointing.distributed, "world_size", lambda: 2)
    got, _, notes, model = step(True, monkeypatch)
    layer_checkpoint = model.model.layers[0]._gradient_checkpointing_func
    assert isinstance(layer_checkpoint, checkpointing.RecomputingCheckpoint) and notes == []
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_a_pass_past_the_host_budget_forms_the_products_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget that holds one layer's output keeps the first layer's; the second forms its product again."""
    want, _, _, _ = step(False, monkeypatch)
    batch = tiny_batch()
    one_output = batch["input_ids"].numel() * tiny_model().config.hidden_size * 4  # fp32, plain host copies
    monkeypatch.setattr(kept_dora, "host_budget", lambda: one_output)
    got, products, _, model = step(True, monkeypatch)
    assert products == LAYERS + 1
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    summary = offload_summary(model)
    assert summary.endswith("DoRA down outputs kept in 1 of 2 layers (the host budget held no more)"), summary


def test_only_dora_down_projections_take_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without DoRA on down nothing is kept and nothing is said: the products are those of not keeping."""
    _, products, notes, model = step(True, monkeypatch, down_dora=False)
    _, unkept, _, _ = step(False, monkeypatch, down_dora=False)
    assert kept_dora.owners(model) == frozenset()
    assert products == unkept
    assert notes == [] and offload_summary(model) is None


def test_offloaded_long_rows_keep_dora_downs_beside_the_attention_projections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With attention kept (offloaded long rows), the DoRA downs join the q/k/v/o projections in its keeper."""
    monkeypatch.setattr(kept_attention, "host_budget", lambda: 2**30)
    model = dora_model()
    enable_checkpointing(model, compiled=False, offload=True, keep_attention=True)
    layer_checkpoint = model.model.layers[0]._gradient_checkpointing_func
    hidden = torch.zeros(1, 16, model.config.hidden_size)
    keeper = layer_checkpoint.layer_attention(0, hidden)
    downs = {id(layer.mlp.down_proj) for layer in model.model.layers}
    assert downs <= keeper.owners and id(model.model.layers[0].self_attn.q_proj) in keeper.owners


def weights(out: int, inp: int, seed: int) -> LoRAWeights:
    g = torch.Generator().manual_seed(seed)
    return LoRAWeights(
        torch.randn(out, inp, generator=g), None, torch.randn(2, inp, generator=g),
        torch.randn(out, 2, generator=g), 0.5, 0.0, None,
    )  # fmt: skip


def test_a_kept_down_output_needs_a_dora_down_of_the_outputs_shape() -> None:
    x = torch.randn(5, 8)
    gate, up, down = weights(12, 8, 0), weights(12, 8, 1), weights(8, 12, 2)
    scale = DoRAScale(torch.ones(8), torch.ones(8))
    with pytest.raises(LoraleiError, match="down has no DoRA"):
        lora_mlp(x, gate, up, down, "silu", kept_down=torch.zeros(5, 8))
    with pytest.raises(
        LoraleiError, match=r"kept_down is \(5, 4\) torch.float32, but this call's output is \(5, 8\)"
    ):
        lora_mlp(x, gate, up, down, "silu", scales=(None, None, scale), kept_down=torch.zeros(5, 4))
    kept = lora_mlp(x, gate, up, down, "silu", scales=(None, None, scale))
    again = lora_mlp(x, gate, up, down, "silu", scales=(None, None, scale), kept_down=kept)
    assert torch.equal(again, kept)


@pytest.mark.parametrize("how", ["unfused", "dropout"])
def test_dora_downs_off_the_fused_mlp_keep_nothing(how: str) -> None:
    """A DoRA down that does not run in the fused MLP (not installed, or with dropout: PEFT's rule keeps it on its
    own op) never asks for a kept output: it takes no part, and the run does not say it keeps anything."""
    config = LoRAConfig(r=4, use_dora=True, lora_dropout=0.1 if how == "dropout" else 0.0)
    model = inject_lora(tiny_model(), config)
    if how == "dropout":
        apply_fused_kernels(model)
    assert kept_dora.owners(model) == frozenset()
    assert enable_checkpointing(model, compiled=False, offload=False) == []
