"""DoRA outputs in host memory without checkpointing (loralei.train.dora_stash): each decoder layer's DoRA ops save
their outputs, which go to host memory and come back for the backward, so q/k/v/o form their products once and
down's output leaves the device; the loss and every gradient are the same bits as without the stash."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loralei import LoRAConfig, apply_fused_kernels, inject_lora
from loralei.ops import stash
from loralei.train import build, dora_stash
from loralei.train.checkpointing import enable_checkpointing
from loralei.train.input_checkpoint import _CHAIN
from loralei.train.kept_attention import PassKeeping
from loralei.train.schema import validate_config
from tiny_models import perturb_magnitudes, tiny_batch, tiny_model

LAYERS = 2  # tiny_model's
SHIPPED_RATE = dora_stash.FLOPS_PER_LINK_BYTE  # before the fixture sets it for the tiny model
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(autouse=True)
def no_stash_left(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every output of the tiny model's layers within the link's share (their products are a few thousand
    FLOPs a token); no stash left behind."""
    monkeypatch.setattr(dora_stash, "FLOPS_PER_LINK_BYTE", 1)
    yield
    assert stash.swap(None) is None  # every layer's forward restored the stash before it
    _CHAIN.sending.clear()


class OutputProducts(TorchDispatchMode):
    """Counts the products of the attention projections' base weights that form their outputs (``X Wᵀ``, not the
    input gradients' ``dY W``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        attention = [layer.self_attn for layer in model.model.layers]
        self.widths = {
            getattr(a, n).weight.data_ptr(): getattr(a, n).out_features for a in attention for n in ATTENTION
        }
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        products = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default)
        weight = args[-1] if func in products else None
        transposed = weight is not None and weight.stride(0) == 1 and weight.stride(1) > 1  # Wᵀ, not W
        if transposed and self.widths.get(weight.data_ptr()) == out.shape[1]:
            self.count += 1
        return out


def dora_model() -> torch.nn.Module:
    config = LoRAConfig(r=4, lora_alpha=8, use_dora=True, init_lora_weights=False)
    model = perturb_magnitudes(inject_lora(tiny_model(), config))
    apply_fused_kernels(model)
    return model


def step(
    stashed: bool, grad: bool = True, checkpointed: bool = False, device: str = "cpu"
) -> tuple[list[torch.Tensor], int, list[dora_stash.LayerStash]]:
    """One training forward and backward of the fused tiny DoRA Llama (``stashed``: with its outputs stashed;
    ``checkpointed``: under the runner's checkpointing instead): the loss and every trainable gradient, the
    attention projections' output products, and each layer's stash."""
    model = dora_model().to(device)
    if stashed:
        assert dora_stash.stash_outputs(model).startswith("DoRA: the outputs of its 14 DoRA projections kept")
    if checkpointed:
        enable_checkpointing(model, compiled=False, offload=False)
    model.train()
    with OutputProducts(model) as products, torch.set_grad_enabled(grad):
        out = model(**{k: v.to(device) for k, v in tiny_batch().items()})
        if grad:
            out.loss.backward()
    stashes = (
        [hook.__self__.stashes for hook in model.model.layers[0]._forward_pre_hooks.values()]
        if stashed
        else []
    )
    grads = [out.loss.detach(), *(p.grad for p in model.parameters() if p.requires_grad)]
    return grads, products.count, (stashes[0] if stashes else [])


def assert_same_but_attention_magnitudes(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """The loss and every gradient the same bits, but q/k/v/o's magnitudes': their dm read from the kept output
    ``Y`` (``Σ dY ⊙ (Y - bias) / m``) or from ``Z`` formed again (``Σ dY ⊙ Z · g / m``) round apart."""
    names = ["loss", *(n for n, p in dora_model().named_parameters() if p.requires_grad)]
    assert len(got) == len(want) == len(names) > 1 + 7 * LAYERS * 2
    for name, g, w in zip(names, got, want, strict=True):
        if name.endswith("lora_magnitude_vector") and name.split(".")[-2] in ATTENTION:
            assert (g - w).abs().max() <= 1e-6 * w.abs().max(), name  # fp32 rounding
        else:
            assert torch.equal(g, w), name


def test_stashed_outputs_train_as_recomputed_with_one_product_each() -> None:
    """With q/k/v/o's outputs formed once each, the gradients of a run that forms them again (up to dm's last
    bits, the same as its checkpointed twin's)."""
    want, recomputed, _ = step(False)
    got, formed, stashes = step(True)
    assert (recomputed, formed) == (2 * 4 * LAYERS, 4 * LAYERS)  # forward and backward; the forward only
    assert [len(s.holders) for s in stashes] == [5] * LAYERS  # q, k, v, o and down
    assert_same_but_attention_magnitudes(got, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_stashed_outputs_give_the_checkpointed_runs_gradients_bit_for_bit(device: str) -> None:
    """A checkpoint's recomputation keeps the outputs for dm as the stash does: every gradient is the same bits
    (on CUDA: pinned buffers, copies on a side stream, brought back a layer ahead)."""
    want, _, _ = step(False, checkpointed=True, device=device)
    got, _, stashes = step(True, device=device)
    assert [len(s.holders) for s in stashes] == [5] * LAYERS
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_past_the_host_budget_outputs_stay_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget that holds five outputs of the first layer (q's, k's, v's, o's, down's: 24 tokens, fp32 clones)
    keeps those; the second layer's q/k/v/o form their products again."""
    want, _, _ = step(False)
    config = tiny_model().config
    tokens = tiny_batch()["input_ids"].numel()
    head_dim = config.hidden_size // config.num_attention_heads
    widths = (
        config.hidden_size,
        2 * config.num_key_value_heads * head_dim,
        config.hidden_size,
        config.hidden_size,
    )
    monkeypatch.setattr(dora_stash, "host_budget", lambda: tokens * sum(widths) * 4)
    got, formed, stashes = step(True)
    assert [len(s.holders) for s in stashes] == [5, 0]
    assert formed == 4 * LAYERS + 4
    assert_same_but_attention_magnitudes(got, want)


def test_a_forward_without_gradients_stashes_nothing() -> None:
    _, formed, stashes = step(True, grad=False)
    assert formed == 4 * LAYERS and stashes == [None] * LAYERS


def test_the_runner_stashes_without_checkpointing_only() -> None:
    """Without checkpointing the run says so; with it (its recomputation keeps the outputs) nothing is stashed."""
    for checkpointing in (False, True):
        raw = {
            "model": {"name_or_path": "m"},
            "data": {"path": "d"},
            "lora": {"r": 4, "use_dora": True},
            "training": {"gradient_checkpointing": checkpointing},
            "output_dir": "out",
        }
        notes = build.prepare_model(tiny_model(), validate_config(raw), torch.device("cpu"))
        stashing = any(note.startswith("DoRA: the outputs of its 14 DoRA projections kept") for note in notes)
        assert stashing is not checkpointing, notes


def test_a_model_without_dora_gets_no_stash() -> None:
    model = inject_lora(tiny_model(), LoRAConfig(r=4))
    assert dora_stash.stash_outputs(model) is None
    assert not model.model.layers[0]._forward_pre_hooks


def test_the_row_plan_sends_down_first_then_q_k_v_o_in_forward_order_as_the_link_carries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Llama-3-8B's layer (hidden 4096, k/v 1024, intermediate 14336, bf16): its products are 436 MFLOP a token.
    At the shipped rate all 28 KB of its outputs a row go; at a rate a fifth slower (24.2 KB a row), down's 8 KB
    go first and of the 16 KB left q (8 KB), k and v (2 KB each) fit in the order the forward makes them, o's
    8 KB do not; where the row holds less than down's 8 KB, down's outputs stay on the device and of q/k/v/o each
    that fits goes (k and v, not q)."""
    h, kv, inter = 4096, 1024, 14336
    products = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]
    widths = zip("qkvo", (h, kv, kv, h), strict=True)
    rows = {name: torch.empty(0, width, dtype=torch.bfloat16) for name, width in widths}

    def taken(rate: int) -> tuple[bool, list[str]]:
        plan = dora_stash.row_plan(products, [h], 2, rate)
        assert plan.rest == (436_207_616 // rate - 8192 if plan.held else 436_207_616 // rate)
        layer = dora_stash.LayerStash(lambda t: t, PassKeeping(2**40), plan)
        held = layer.mark(torch.empty(0, h, dtype=torch.bfloat16), held=True)
        return held, [name for name, row in rows.items() if layer.mark(row, held=False)]

    assert taken(SHIPPED_RATE) == (True, ["q", "k", "v", "o"])
    assert taken(18_000) == (True, ["q", "k", "v"])
    assert taken(436_207_616 // 8191) == (False, ["k", "v"])


def test_a_slower_link_sends_less_in_proportion_and_a_faster_one_no_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The share scales with how far the measured copies fall under the reference rate: at half of it the 8B
    layer's row holds 14.5 KB, down's 8 KB and then k's and v's 2 KB each (q's and o's 8 KB no longer fit); a
    faster link keeps the shipped share. Off CUDA nothing is timed."""
    monkeypatch.setattr(dora_stash, "FLOPS_PER_LINK_BYTE", SHIPPED_RATE)
    cuda = torch.device("cuda")
    monkeypatch.setattr(dora_stash, "link_rate", lambda device: dora_stash.REFERENCE_LINK_GBPS / 2)
    assert dora_stash.link_share(cuda) == (2 * SHIPPED_RATE, dora_stash.REFERENCE_LINK_GBPS / 2)
    h, kv, inter = 4096, 1024, 14336
    products = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]
    plan = dora_stash.row_plan(products, [h], 2, 2 * SHIPPED_RATE)
    layer = dora_stash.LayerStash(lambda t: t, PassKeeping(2**40), plan)
    widths = zip("qkvo", (h, kv, kv, h), strict=True)
    taken = [n for n, w in widths if layer.mark(torch.empty(0, w, dtype=torch.bfloat16), held=False)]
    assert plan.held and taken == ["k", "v"]
    monkeypatch.setattr(dora_stash, "link_rate", lambda device: 3 * dora_stash.REFERENCE_LINK_GBPS)
    assert dora_stash.link_share(cuda) == (SHIPPED_RATE, 3 * dora_stash.REFERENCE_LINK_GBPS)
    assert dora_stash.link_share(torch.device("cpu")) == (SHIPPED_RATE, None)


def test_the_run_report_names_the_measured_link_and_what_it_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    slow, fast = dora_stash.REFERENCE_LINK_GBPS / 4, 2 * dora_stash.REFERENCE_LINK_GBPS
    monkeypatch.setattr(dora_stash, "link_share", lambda device: (1, slow))
    line = dora_stash.stash_outputs(dora_model())
    assert f"measured at {slow:.1f} GB/s, under the {dora_stash.REFERENCE_LINK_GBPS} GB/s" in line
    assert "each layer sends 25% as many bytes" in line
    monkeypatch.setattr(dora_stash, "link_share", lambda device: (1, fast))
    assert f"(copies to the host measured at {fast:.1f} GB/s) and" in dora_stash.stash_outputs(dora_model())


@pytest.mark.gpu
def test_the_link_rate_is_timed_on_the_device() -> None:
    rate = dora_stash.link_rate(torch.device("cuda"))
    assert 0.1 < rate < 10_000  # GB/s: a real copy's, whatever the link


def test_a_small_models_outputs_stay_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the tiny model's size the copies would outlast its products: nothing is sent, and it trains as without
    a stash."""
    monkeypatch.setattr(dora_stash, "FLOPS_PER_LINK_BYTE", SHIPPED_RATE)
    want, _, _ = step(False)
    got, formed, stashes = step(True)
    assert [len(s.holders) for s in stashes] == [0] * LAYERS and formed == 2 * 4 * LAYERS
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_forward_that_stops_inside_a_layer_leaves_no_stash_behind(error: type[BaseException]) -> None:
    """A layer's forward that raises ends its stash at once (its forward hook runs anyway); one stopped by Ctrl-C
    (which skips even that hook) leaves it to the next pass, which starts clean and trains as without a stash."""
    want, _, _ = step(False)
    model = dora_model()
    dora_stash.stash_outputs(model)
    model.train()
    mlp = model.model.layers[1].mlp
    fused = mlp.forward

    def stopping(*args, **kwargs):
        raise error("stop")

    mlp.forward = stopping
    with pytest.raises(error):
        model(**tiny_batch())
    left = stash.swap(None)
    stash.swap(left)
    assert (left is not None) is (error is KeyboardInterrupt)
    mlp.forward = fused
    out = model(**tiny_batch())
    out.loss.backward()
    got = [out.loss.detach(), *(p.grad for p in model.parameters() if p.requires_grad)]
    assert_same_but_attention_magnitudes(got, want)


def test_a_held_output_claims_the_host_budget_only_when_it_is_saved() -> None:
    """An op run without autograd (a tiled MLP's forward inside a stashing layer) marks down's output and never
    saves it: nothing of the pass's budget goes; saved, it claims its bytes then (and past the budget it stays)."""
    kept = PassKeeping(2 * 16 * 4)
    layer = dora_stash.LayerStash(lambda t: t.clone(), kept, dora_stash.RowPlan(True, 0))
    unsaved, saved, over = torch.zeros(2, 16), torch.ones(2, 16), torch.ones(2, 16)
    assert layer.mark(unsaved, held=True) and kept.left == 128
    assert layer.mark(saved, held=True) and layer.pack(saved) is not saved and kept.left == 0
    assert layer.mark(over, held=True) and layer.pack(over) is over and kept.short
    assert not layer.mark(torch.ones(2, 1), held=False)  # no bytes a row left for the others


def test_a_group_whose_stash_takes_some_members_forms_the_others_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layer plan with room for q's row (fp32, 128 bytes) but not k's or v's after it: the q/k/v group saves q's
    output and forms k's and v's again in its backward (and o's); the gradients are those without a stash."""
    want, _, _ = step(False)
    monkeypatch.setattr(
        dora_stash, "row_plan", lambda products, held, size, rate: dora_stash.RowPlan(True, 160)
    )
    got, formed, stashes = step(True)
    assert [len(s.holders) for s in stashes] == [2] * LAYERS  # q and down
    assert formed == 4 * LAYERS + 3 * LAYERS  # k, v and o again
    assert_same_but_attention_magnitudes(got, want)
