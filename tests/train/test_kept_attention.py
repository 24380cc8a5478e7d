"""Attention computed once per step under offloaded checkpointing (loralei.train.kept_attention): each layer's
forward keeps its attention output in host memory and the recomputation takes it back, so attention's forward
runs once per layer instead of twice, and the loss and every LoRA gradient are those of recomputing it, bit for
bit on the CPU. Calls it cannot take (a mask) run sdpa as before; layers over the host budget compute attention
again in the recomputation, through the same kernel."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from test_build import cfg_with
from torch.multiprocessing.reductions import StorageWeakRef

from loralei.ops import attention
from loralei.train import build, kept_attention
from loralei.train.input_checkpoint import _CHAIN
from tiny_models import tiny_model

LAYERS, KV_HEADS = 2, 2  # tiny_model's
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_pass_per_test() -> Iterator[None]:
    """Each test's pass starts at layer 0: a test that fails inside a backward leaves its graph alive (pytest
    keeps the traceback), and with it the offload chain's copies, which would shift the next test's layers."""
    yield
    _CHAIN.copies.clear()


class Calls:
    """Counts sdpa calls and the kept kernels' forwards and backwards (those of ``device``'s type)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, device: str = "cpu") -> None:
        self.sdpa = self.forward = self.backward = 0
        sdpa = F.scaled_dot_product_attention

        def counted_sdpa(*args, **kwargs):
            self.sdpa += 1
            return sdpa(*args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted_sdpa)
        for key, kernel in list(attention.KERNELS.items()):
            if key[0] == device:
                monkeypatch.setitem(attention.KERNELS, key, self._counted(kernel))

    def _counted(self, kernel: attention.Kernel) -> attention.Kernel:
        def forward(*args):
            self.forward += 1
            return kernel.forward(*args)

        def backward(*args):
            self.backward += 1
            return kernel.backward(*args)

        return attention.Kernel(kernel.name, forward, backward)


def one_step(
    keep: bool,
    monkeypatch: pytest.MonkeyPatch,
    mask: bool = False,
    family: str = "llama",
    device: torch.device = CPU,
    length: int = 24,
    tiled: bool = False,
    **model_args,
) -> tuple[torch.nn.Module, torch.Tensor]:
    """The tiny model of ``family`` (``model_args``: tiny_model's dtype and config overrides) under offloaded
    checkpointing, keeping attention from 16-token rows (``keep``) or never, its MLPs tiled with ``tiled``, after
    one forward and backward over two rows of ``length`` tokens (the second padded with ``mask``, so that sdpa gets
    a mask); the model and the loss."""
    monkeypatch.setattr(kept_attention, "AUTO_TOKENS", 16 if keep else 10**9)
    torch.manual_seed(0)
    model = tiny_model(family, **model_args)
    tiles = {"tiled_mlp": True} if tiled else {}
    cfg = cfg_with(gradient_checkpointing="offload", max_seq_length=length, **tiles)
    notes = build.prepare_model(model, cfg, device)
    assert any(note.startswith("attention: computed once per step") for note in notes) == keep
    model.train()
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.1)  # B = 0 at init would leave A's gradient zero
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    if mask:
        batch["attention_mask"] = torch.ones_like(ids)
        batch["attention_mask"][1, 20:] = 0
    loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
    loss.backward()
    return model, loss.detach()


def loss_and_grads(keep: bool, monkeypatch: pytest.MonkeyPatch, **step):
    """:func:`one_step`'s loss and LoRA gradients (in FP32), and the model."""
    model, loss = one_step(keep, monkeypatch, **step)
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
    return loss.float(), grads, model


def assert_same(got, want) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert got[1].keys() == want[1].keys() and want[1]
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=0, atol=0, msg=name)


def test_attention_runs_once_per_layer_and_trains_as_recomputed(monkeypatch: pytest.MonkeyPatch) -> None:
    want = loss_and_grads(False, monkeypatch)
    calls = Calls(monkeypatch)
    got = loss_and_grads(True, monkeypatch)
    # one forward per layer; the backward per group of heads
    assert (calls.sdpa, calls.forward, calls.backward) == (
        0,
        LAYERS,
        LAYERS * attention.head_groups(KV_HEADS),
    )
    assert_same(got, want)
    assert _CHAIN.copies == []  # the pass is over


def test_a_pass_over_the_host_budget_recomputes_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the budget nothing is kept: the forward runs sdpa, the recomputation the kernel again, with the
    backward in groups of heads (its workspace for one group at a time, as when attention is kept)."""
    want = loss_and_grads(False, monkeypatch)
    monkeypatch.setattr(kept_attention, "host_budget", lambda: 1000)  # 2 layers x 48 tokens x 32 dims: more
    calls = Calls(monkeypatch)
    got = loss_and_grads(True, monkeypatch)
    assert (calls.sdpa, calls.forward, calls.backward) == (
        LAYERS,
        LAYERS,
        LAYERS * attention.head_groups(KV_HEADS),
    )
    assert_same(got, want)


def pass_host_bytes() -> tuple[int, int]:
    """The host bytes of :func:`one_step`'s pass as the budget counts them: every layer's input and attention
    results (output, log-sum-exp), and one layer input."""
    config = tiny_model("llama").config
    heads = config.num_attention_heads
    budget = kept_attention.AttentionBudget(LAYERS, config.hidden_size, heads, config.hidden_size // heads)
    hidden = torch.zeros(2, 24, config.hidden_size)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kept_attention, "host_budget", lambda: 0)
        return -budget.spare(hidden), hidden.numel() * 4


def one_layers_attention_budget() -> int:
    """A host budget that holds the inputs of every layer of :func:`one_step`'s pass and the attention results
    (output, log-sum-exp) of one."""
    inputs_and_results, layer_input = pass_host_bytes()
    return LAYERS * layer_input + (inputs_and_results // LAYERS - layer_input)


def keep_in(layers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes :func:`one_step`'s pass keep attention in its first ``layers`` layers (1 or all)."""
    if layers < LAYERS:
        budget = one_layers_attention_budget()
        monkeypatch.setattr(kept_attention, "host_budget", lambda: budget)


def test_a_pass_keeps_attention_in_as_many_layers_as_the_budget_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A budget that holds every layer's input and one layer's attention results: the first layer keeps them,
    the second runs sdpa in the forward and the kernel again in its recomputation; no projection keeps its
    output (they take only what is left once every layer's attention results fit); same loss and gradients."""
    want = loss_and_grads(False, monkeypatch)
    keep_in(1, monkeypatch)
    calls, kept = Calls(monkeypatch), KeptProjections(monkeypatch)
    got = loss_and_grads(True, monkeypatch)
    assert (calls.sdpa, calls.forward, calls.backward) == (
        LAYERS - 1,
        LAYERS,
        LAYERS * attention.head_groups(KV_HEADS),
    )
    assert (kept.groups, kept.singles) == (0, 0)
    assert_same(got, want)


def test_masked_attention_runs_sdpa_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    want = loss_and_grads(False, monkeypatch, mask=True)
    calls = Calls(monkeypatch)
    got = loss_and_grads(True, monkeypatch, mask=True)
    assert (calls.sdpa, calls.forward) == (2 * LAYERS, 0)
    assert_same(got, want)


def test_short_rows_and_other_checkpointing_keep_nothing() -> None:
    model = tiny_model("llama")
    cfg = cfg_with(gradient_checkpointing="offload", max_seq_length=1024)
    build.prepare_model(model, cfg, torch.device("cpu"))
    assert model.config._attn_implementation == "sdpa"
    model = tiny_model("llama")
    cfg = cfg_with(gradient_checkpointing=True, max_seq_length=kept_attention.AUTO_TOKENS)
    build.prepare_model(model, cfg, torch.device("cpu"))
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("layers_keeping", [LAYERS, 1])
def test_the_layer_before_comes_back_after_this_layers_attention_backward(
    monkeypatch: pytest.MonkeyPatch, layers_keeping: int
) -> None:
    """The step's peak is inside a layer's attention backward: the input of the layer before it is brought back
    only once that backward is done (with its kept attention results), not when the layer's recomputation starts,
    and once autograd has let go of that backward's operands (output gradient, q, k, v, kept output). So too
    where this layer computes its attention again (the host budget held the results of the first layer only)."""
    from loralei.train.input_checkpoint import _HostCopy

    events: list[str] = []
    prefetch, kernel = _HostCopy.prefetch, attention.KERNELS[("cpu", 1)]
    inputs: dict[int, int] = {}  # id of a layer's input holder -> layer index

    operands: list[StorageWeakRef] = []  # of the last attention backward

    def logged_prefetch(self) -> None:
        inputs.update({id(ref()): i for i, ref in enumerate(_CHAIN.copies) if ref() is not None})
        if id(self) in inputs and self.back is None:
            held = any(not ref.expired() for ref in operands)
            events.append(f"input {inputs[id(self)]}" + (" (operands held)" if held else ""))
        prefetch(self)

    def logged_backward(*args):
        events.append("attention backward")
        operands[:] = [StorageWeakRef(t.untyped_storage()) for t in args[:5]]
        return kernel.backward(*args)

    monkeypatch.setattr(_HostCopy, "prefetch", logged_prefetch)
    monkeypatch.setitem(
        attention.KERNELS, ("cpu", 1), attention.Kernel(kernel.name, kernel.forward, logged_backward)
    )
    keep_in(layers_keeping, monkeypatch)
    loss_and_grads(True, monkeypatch)
    groups = attention.head_groups(KV_HEADS)
    assert events == [
        "input 1",
        *["attention backward"] * groups,
        "input 0",
        *["attention backward"] * groups,
    ]


@pytest.mark.parametrize("layers_keeping", [LAYERS, 1])
def test_the_layer_befores_kept_results_come_back_after_this_layers_projections_backward(
    monkeypatch: pytest.MonkeyPatch, layers_keeping: int
) -> None:
    """What the layer before kept besides its input (attention results, projection outputs) comes back only once
    this layer's q/k/v projections' backward is done: the gradients this layer's attention backward returned
    are freed by then (they were alive when the input came back), so the copies never meet them. So too where
    this layer computes its attention again (the host budget held the results of the first layer only)."""
    from loralei.train.input_checkpoint import _HostCopy

    events: list[str] = []
    prefetch, kept_prefetch = _HostCopy.prefetch, kept_attention.LayerAttention.prefetch
    kernel, grouped_backward = attention.KERNELS[("cpu", 1)], attention._grouped_backward
    layers: dict[int, int] = {}  # id of a layer's LayerAttention -> layer index
    inputs: dict[int, int] = {}  # id of a layer's input holder -> layer index
    returned: list[StorageWeakRef] = []  # the gradients the last attention backward returned

    def freed() -> str:
        return "freed" if all(ref.expired() for ref in returned) else "held"

    def logged_prefetch(self) -> None:
        note_layers()
        if id(self) in inputs and self.back is None:
            events.append(f"input {inputs[id(self)]}, gradients {freed()}")
        prefetch(self)

    def logged_kept_prefetch(self) -> None:
        events.append(f"kept {layers[id(self)]}, gradients {freed()}")
        kept_prefetch(self)

    def note_layers() -> None:
        for i, holder in enumerate(ref() for ref in _CHAIN.copies):
            if holder is not None:
                inputs[id(holder)], layers[id(holder.attention)] = i, i

    def logged_forward(*args):
        note_layers()
        return kernel.forward(*args)

    def logged_backward(*args):
        grads = grouped_backward(*args)
        events.append("attention backward")
        returned[:] = [StorageWeakRef(g.untyped_storage()) for g in grads]
        return grads

    monkeypatch.setattr(_HostCopy, "prefetch", logged_prefetch)
    monkeypatch.setattr(kept_attention.LayerAttention, "prefetch", logged_kept_prefetch)
    monkeypatch.setattr(attention, "_grouped_backward", logged_backward)
    monkeypatch.setitem(
        attention.KERNELS, ("cpu", 1), attention.Kernel(kernel.name, logged_forward, kernel.backward)
    )
    keep_in(layers_keeping, monkeypatch)
    loss_and_grads(True, monkeypatch)
    assert events == [
        "input 1, gradients freed",  # none yet
        "attention backward",
        "input 0, gradients held",
        "kept 0, gradients freed",
        "attention backward",
    ]


def long_step_peak(monkeypatch: pytest.MonkeyPatch, keep_outputs: bool) -> int:
    """The storage peak (counted as CUDA's allocator would: tests/live_memory.py) of one offloaded step of a
    Llama-shaped model at 1/16 of Llama-3-8B's hidden and MLP widths over 2,048 tokens, attention kept, its MLPs tiled, the
    attention projections' outputs kept with ``keep_outputs``."""
    from live_memory import LiveStorage, offload_as_on_cuda
    from loralei.train import tiled_mlp

    monkeypatch.setattr(kept_attention, "AUTO_TOKENS", 16)
    monkeypatch.setattr(tiled_mlp, "AUTO_TOKENS", 16)
    if not keep_outputs:
        monkeypatch.setattr(kept_attention.LayerAttention, "_takes_part", lambda self, owners: False)
    widths = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64}
    model = tiny_model("llama", intermediate_size=896, num_hidden_layers=4, vocab_size=256, **widths)
    build.prepare_model(model, cfg_with(gradient_checkpointing="offload", max_seq_length=2048), CPU)
    model.train()
    ids = torch.randint(0, 256, (1, 2048), generator=torch.Generator().manual_seed(1))
    live = LiveStorage()
    offload_as_on_cuda(monkeypatch, live)
    with live:
        model(input_ids=ids, labels=ids).loss.backward()
    return live.peak


def test_kept_projection_outputs_do_not_raise_the_steps_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """The projections' kept outputs come back to the device without raising the step's peak: the same step
    recomputing those projections holds as much at its peak. Brought back at the end of the attention backward,
    with the layer before's input, they raised it by 5 % here (and the 8B shape's device memory per token on the
    GPU from 85 KiB to 99)."""
    with monkeypatch.context() as patch:
        without = long_step_peak(patch, keep_outputs=False)
    with monkeypatch.context() as patch:
        kept = long_step_peak(patch, keep_outputs=True)
    assert kept <= 1.01 * without, (kept, without)


def test_a_pass_over_the_host_budget_holds_no_more_at_its_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers that recompute attention (over the host budget) bring the layer before's input back after their
    attention backward, as layers that kept it do: the step's peak is the same. Brought back when the layer's
    backward began, it was 7.6 % over here (and on an H100 at the 8B shape, the 256K step, where a 128 GiB host's
    budget holds nothing but the inputs, peaked 121 KiB a token over the 64K step, where all fits, against 85
    KiB a token from 32K to 64K; brought back after it, 86 KiB a token, on the shorter lengths' line)."""
    with monkeypatch.context() as patch:
        kept = long_step_peak(patch, keep_outputs=False)
    with monkeypatch.context() as patch:
        patch.setattr(kept_attention, "host_budget", lambda: 0)
        recomputed = long_step_peak(patch, keep_outputs=False)
    assert recomputed <= 1.01 * kept, (recomputed, kept)


def test_the_embeddings_output_is_not_held_at_the_attention_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's peak is inside a layer's attention backward: the embeddings' output (the first layer's input,
    offloaded) is freed by then. Transformers' checkpointing switch made it a leaf needing a gradient, which the
    backward held to its end: a layer input more on the device at the peak."""
    outputs: list[StorageWeakRef] = []
    embed, kernel = torch.nn.Embedding.forward, attention.KERNELS[("cpu", 1)]

    def recorded_embed(self, ids):
        out = embed(self, ids)
        outputs.append(StorageWeakRef(out.untyped_storage()))
        return out

    alive: list[bool] = []

    def checked_backward(*args):
        alive.extend(not ref.expired() for ref in outputs)
        return kernel.backward(*args)

    monkeypatch.setattr(torch.nn.Embedding, "forward", recorded_embed)
    monkeypatch.setitem(
        attention.KERNELS, ("cpu", 1), attention.Kernel(kernel.name, kernel.forward, checked_backward)
    )
    loss_and_grads(True, monkeypatch)
    assert len(outputs) == 1 and alive and not any(alive)


class KeptProjections:
    """Counts the recomputation's projection calls that took kept outputs (q/k/v groups, single projections)
    and notes the storages it handed out."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from loralei.ops import lora_w, shared_input

        self.groups = self.singles = 0
        self.handed: list[list[StorageWeakRef]] = []
        take = kept_attention.LayerAttention.take_outputs

        def noted(layer, owners):
            kept = take(layer, owners)
            if kept is not None:
                self.handed.append([StorageWeakRef(t.untyped_storage()) for t in kept])
            return kept

        group, single = shared_input._KeptGroupFunction.apply, lora_w._KeptWFunction.apply
        monkeypatch.setattr(kept_attention.LayerAttention, "take_outputs", noted)
        monkeypatch.setattr(shared_input._KeptGroupFunction, "apply", self._count("groups", group))
        monkeypatch.setattr(lora_w._KeptWFunction, "apply", self._count("singles", single))

    def _count(self, name: str, apply):
        def counted(*args):
            setattr(self, name, getattr(self, name) + 1)
            return apply(*args)

        return counted


def test_the_attention_projections_keep_their_outputs_and_are_not_recomputed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """q/k/v (one group) and o keep their outputs beside the attention's: each layer's recomputation takes them
    back instead of forming its base products, the kept outputs live no longer there than recomputed ones (at the
    attention backward only v, which attention reads), and the loss and gradients are the same bits."""
    want = loss_and_grads(False, monkeypatch)
    kept = KeptProjections(monkeypatch)
    alive: list[list[bool]] = []
    kernel = attention.KERNELS[("cpu", 1)]

    def checked_backward(*args):
        alive.append([not ref.expired() for ref in kept.handed[-2]])  # the layer's q/k/v (o's came after)
        return kernel.backward(*args)

    monkeypatch.setitem(
        attention.KERNELS, ("cpu", 1), attention.Kernel(kernel.name, kernel.forward, checked_backward)
    )
    got = loss_and_grads(True, monkeypatch)
    assert (kept.groups, kept.singles) == (LAYERS, LAYERS)
    assert len(alive) == LAYERS * attention.head_groups(KV_HEADS)
    assert all(layer == [False, False, True] for layer in alive)  # q, k freed after RoPE; attention reads v
    assert_same(got, want)


def test_phi3s_fused_qkv_and_o_keep_their_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Phi-3's one qkv_proj (its family spec's data) keeps its output like q/k/v: same loss and gradients."""
    want = loss_and_grads(False, monkeypatch, family="phi3")
    kept = KeptProjections(monkeypatch)
    got = loss_and_grads(True, monkeypatch, family="phi3")
    assert (kept.groups, kept.singles) == (0, 2 * LAYERS)
    assert_same(got, want)


def test_projection_outputs_take_only_what_the_host_budget_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget that holds the inputs and attention outputs of every layer and the projection outputs of one:
    the first layer keeps them, the second recomputes its projections; same loss and gradients. (The budget
    counts the decoder layers, not the model, which carries Transformers' checkpoint function too.)"""
    want = loss_and_grads(False, monkeypatch)
    attention_bytes = pass_host_bytes()[0]
    config = tiny_model("llama").config
    heads, head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    one_layer = (
        2 * 24 * (heads * head_dim + 2 * kv + config.hidden_size) * 4
    )  # one_step's 2 rows of 24 tokens
    monkeypatch.setattr(kept_attention, "host_budget", lambda: attention_bytes + one_layer)
    kept = KeptProjections(monkeypatch)
    got = loss_and_grads(True, monkeypatch)
    assert (kept.groups, kept.singles) == (1, 1)
    assert_same(got, want)


def test_projections_whose_fp8_bases_take_codes_from_the_norms_keep_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """q/k/v and o of every layer take part (Phi-3's fused qkv_proj and o_proj); with FP8 GEMM bases (their
    norms make their input codes, the recomputation's too) none does."""
    from loralei import LoRAConfig, inject_lora
    from loralei.modules.quantized import fp8

    dense = inject_lora(tiny_model("llama"), LoRAConfig(r=4))
    owners = kept_attention.projection_owners(dense)
    names = {name.rpartition(".")[2] for name, m in dense.named_modules() if id(m) in owners}
    assert len(owners) == 4 * LAYERS and names == {"q_proj", "k_proj", "v_proj", "o_proj"}
    phi3 = inject_lora(tiny_model("phi3"), LoRAConfig(r=4))  # its fused qkv_proj and o_proj
    owners = kept_attention.projection_owners(phi3)
    names = {name.rpartition(".")[2] for name, m in phi3.named_modules() if id(m) in owners}
    assert len(owners) == 2 * LAYERS and names == {"qkv_proj", "o_proj"}
    monkeypatch.setattr(fp8, "_fp8_kernel_problem", lambda device, kernel: None)
    quantized = inject_lora(tiny_model("llama"), LoRAConfig(r=4, quantize_base=True, quantization_type="fp8"))
    assert kept_attention.projection_owners(quantized) == frozenset()


def test_the_host_budget_counts_the_decoder_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Transformers gives the model its checkpoint function too: the budget counts the decoder layers only."""
    monkeypatch.setattr(kept_attention, "AUTO_TOKENS", 16)
    model = tiny_model("llama")
    build.prepare_model(
        model, cfg_with(gradient_checkpointing="offload", max_seq_length=24), torch.device("cpu")
    )
    assert model.model.layers[0]._gradient_checkpointing_func.attention.layers == LAYERS


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [None, 0])
def test_kept_attention_and_projections_train_as_recomputed_on_cuda(
    monkeypatch: pytest.MonkeyPatch, budget: int | None
) -> None:
    """On CUDA (cuDNN or flash attention, the Triton MLP kernels in tiles whose backward runs skip the down
    projection), keeping attention and projection outputs, or (a budget of 0) computing attention again through
    the same kernel, gives the recomputed run's loss and gradients, up to the last bits cuDNN's query gradient
    varies by from run to run."""
    from loralei.train import tiled_mlp
    from loralei.train.checkpointing import offload_summary

    # bf16, heads of 64 (the fused attention kernels' sizes), MLPs in tiles of 64 tokens
    monkeypatch.setattr(tiled_mlp, "tile_tokens", lambda model: 64)
    step = {"device": torch.device("cuda"), "length": 256, "tiled": True, "dtype": torch.bfloat16}
    step |= {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64}
    want_loss, want, _ = loss_and_grads(False, monkeypatch, **step)
    if budget is not None:
        monkeypatch.setattr(kept_attention, "host_budget", lambda: budget)
    kept, calls = KeptProjections(monkeypatch), Calls(monkeypatch, "cuda")
    got_loss, got, model = loss_and_grads(True, monkeypatch, **step)
    every = LAYERS if budget is None else 0
    assert (kept.groups, kept.singles, calls.forward) == (every, every, LAYERS)
    line = offload_summary(model)
    said = "attention kept in" if budget is None else "attention recomputed"
    assert line.startswith("offloaded checkpointing: ") and f"GiB of pinned host memory; {said}" in line
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-3, atol=0)
    assert got.keys() == want.keys() and want
    for name, grad in want.items():
        assert (got[name] - grad).norm() <= 1e-2 * grad.norm(), name


class _PinnedInput:
    """A CUDA bf16 layer input of ``tokens`` x 4096, as the budget reads it (no CUDA here)."""

    is_cuda = True

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def numel(self) -> int:
        return self.tokens * 4096

    def element_size(self) -> int:
        return 2


def test_the_budget_counts_pinned_buffers_as_they_are_allocated(monkeypatch) -> None:
    """Pinned buffers are made of power-of-two pieces of 2 MiB or more (PyTorch's caching host allocator rounds
    each allocation up to a power of two): at 100K tokens of the 8B shape a 781.25 MiB layer input takes 782 MiB
    and the 12.2 MiB log-sum-exp 14 MiB, and the budget counts that; at 64K tokens nothing is rounded; on the CPU
    the copies are plain tensors of their own size."""
    monkeypatch.setattr(kept_attention, "host_budget", lambda: 2**40)
    budget = kept_attention.AttentionBudget(32, 4096, 32, 128)
    input_bytes = 100_000 * 4096 * 2
    lse_bytes = 100_000 * 32 * 4
    assert budget.spare(_PinnedInput(100_000)) == 2**40 - 32 * (2 * 782 + 14) * 2**20
    assert budget.spare(_PinnedInput(65_536)) == 2**40 - 32 * (2 * 2**29 + 65_536 * 32 * 4)
    cpu = torch.empty(100_000, 4096, dtype=torch.bfloat16, device="meta")
    assert not cpu.is_cuda and budget.spare(cpu) == 2**40 - 32 * (2 * input_bytes + lse_bytes)


def test_host_memory_is_lowered_to_a_containers_limit(tmp_path, monkeypatch) -> None:
    """The budget's host memory: physical, or a container's memory limit where one is set (cgroup v2's
    ``memory.max``, v1's ``memory.limit_in_bytes``; "max" or a number above the physical memory is no limit)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    physical = kept_attention.host_memory(())
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text("max\n")
    v1.write_text(f"{2**63 - 4096}\n")
    assert kept_attention.host_memory((v2, v1)) == physical
    v2.write_text(f"{2**30}\n")
    assert kept_attention.host_memory((v2, v1)) == 2**30
    v1.write_text(f"{2**29}\n")
    assert kept_attention.host_memory((tmp_path / "absent", v1)) == 2**29


def test_processes_on_one_machine_share_its_host_memory(tmp_path, monkeypatch) -> None:
    """torchrun's processes on this machine (``LOCAL_WORLD_SIZE``) each offload alike: each budgets an equal share
    of the host's memory (or of its container's limit)."""
    limit = tmp_path / "memory.max"
    limit.write_text(f"{2**32}\n")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert kept_attention.host_memory((limit,)) == 2**32
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert kept_attention.host_memory((limit,)) == 2**30


def test_attention_is_kept_for_long_offloaded_rows_on_one_rank_per_sequence() -> None:
    """Sequence-parallel ranks exchange heads around their attention (sequence_parallel.py), so they keep only
    their layer inputs."""
    long = kept_attention.AUTO_TOKENS
    assert kept_attention.keeps("offload", long) and kept_attention.keeps("offload", long, 1)
    assert not kept_attention.keeps("offload", long, 2)
    assert not kept_attention.keeps("offload", long - 1) and not kept_attention.keeps(True, long)


@pytest.mark.parametrize(
    ("budget", "kept"),
    [
        (None, "attention kept in 2 of 2 layers, q/k/v/o outputs in 2 of 2"),
        (26112 + 18432, "attention kept in 2 of 2 layers, q/k/v/o outputs in 1 of 2"),
        (
            12288 + 6912,
            "attention kept in 1 of 2 layers, q/k/v/o outputs in 0 of 2 (the host budget held no more)",
        ),
        (1000, "attention recomputed (the layer inputs left no room in the host budget)"),
    ],
)
def test_the_run_ends_saying_what_offloaded_checkpointing_kept(monkeypatch, budget, kept: str) -> None:
    """The end-of-run line: pinned host memory, and in how many layers the last pass kept attention and the
    projections' outputs (the tiny Llama's pass: 12,288 bytes of inputs, 6,912 of one layer's attention results,
    18,432 of one layer's projection outputs)."""
    from loralei.train.checkpointing import offload_summary

    if budget is not None:
        monkeypatch.setattr(kept_attention, "host_budget", lambda: budget)
    line = offload_summary(one_step(True, monkeypatch)[0])
    assert line == f"offloaded checkpointing: {kept}"  # no pinned memory on the CPU (the GPU test: some)
    assert offload_summary(tiny_model("llama")) is None  # no checkpointing, no line


def test_a_run_with_offloaded_checkpointing_ends_with_that_line(tmp_path, monkeypatch) -> None:
    """The runner's end-of-run notes carry the line where attention may be kept; a run with nothing to say (no
    pinned memory on the CPU, rows too short to keep attention) has none."""
    from runner_helpers import collate, token_dataset
    from test_run import make_cfg

    from loralei.train.run import train

    cfg = make_cfg(tmp_path / "short", training={"gradient_checkpointing": "offload", "max_steps": 2})
    result = train(cfg, model=tiny_model("llama"), dataset=token_dataset(), collate_fn=collate)
    assert not any(note.startswith("offloaded checkpointing") for note in result.notes), result.notes
    monkeypatch.setattr(kept_attention, "AUTO_TOKENS", 16)
    training = {"gradient_checkpointing": "offload", "max_steps": 2, "max_seq_length": 24}
    cfg = make_cfg(tmp_path / "kept", training=training)
    result = train(cfg, model=tiny_model("llama"), dataset=token_dataset(), collate_fn=collate)
    lines = [note for note in result.notes if note.startswith("offloaded checkpointing: attention kept in ")]
    assert len(lines) == 1 and lines[0].endswith(" of 2 layers, q/k/v/o outputs in 2 of 2"), result.notes


def test_a_layer_brings_back_what_it_kept_in_the_order_its_recomputation_takes_it() -> None:
    """The copies back queue on one side stream, and each fetch waits for its own copy only: they are started in
    the order the forward kept them (q/k/v's outputs, the attention's output and log-sum-exp, o's output), the
    order in which the recomputation needs them."""
    prefetched: list[str] = []

    class Holder:
        def __init__(self, name: str) -> None:
            self.name = name

        def prefetch(self) -> None:
            prefetched.append(self.name)

    names = iter(["q", "k", "v", "out", "lse", "o"])
    qkv, o = [torch.nn.Linear(2, 2) for _ in range(3)], torch.nn.Linear(2, 2)
    owners = frozenset(id(m) for m in [*qkv, o])
    layer = kept_attention.LayerAttention(
        True, lambda tensor: Holder(next(names)), owners, kept_attention.PassKeeping(10**6)
    )
    layer.keep_outputs(qkv, [torch.zeros(2, 4)] * 3)
    kernel = attention.KERNELS[("cpu", 1)]
    layer.keep(attention.Kept(kernel, torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4), ()))
    layer.keep_outputs([o], [torch.zeros(2, 4)])
    layer.prefetch()
    assert prefetched == ["q", "k", "v", "out", "lse", "o"]
