"""``training.cuda_graphs``: which micro batches run eagerly, which are captured and which replay (on the CPU,
with stand-ins for CUDA's streams and graphs), the loop keeping ``.grad`` tensors for the replays, and on the GPU
machine a graphed run against the eager run: the same losses and adapter, with and without checkpointing."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from runner_helpers import collate, token_dataset
from test_run import adapter_tensors, losses, make_cfg
from transformers import masking_utils

from loralei import load_pretrained, lora_state_dict
from loralei.train import graphs
from loralei.train.graphs import MAX_GRAPHS, GraphedSteps
from loralei.train.loop import _optimizer_step
from loralei.train.run import train
from loralei.train.state import Trainables
from saved_adapter import saved_adapter
from tiny_models import tiny_model, tiny_moe_model


class FakeStream:
    def __init__(self, device: object = None) -> None:
        pass

    def wait_stream(self, other: FakeStream) -> None:
        pass


class FakeGraph:
    """Capture runs the body once (as CUDA's records it); a replay only counts."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict:
    """CUDA's stream and graph calls replaced. A capture whose body raises ends with an error of its own, as
    CUDA's does."""
    state: dict = {"captures": 0, "capturing": False}

    @contextlib.contextmanager
    def capture(graph: FakeGraph, pool: object = None, stream: object = None):
        state["captures"] += 1
        state["capturing"] = True
        try:
            yield
        except RuntimeError:
            raise RuntimeError(
                "CUDA error: operation failed due to a previous error during capture"
            ) from None
        finally:
            state["capturing"] = False

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    return state


class Step:
    """A micro step that records what it was called with (and whether inside a capture); with ``fail``, it raises
    that when captured."""

    def __init__(self, fake_cuda: dict, fail: str | None = None) -> None:
        self.calls: list[tuple[dict, torch.Tensor, bool]] = []
        self.fake_cuda, self.fail = fake_cuda, fail

    def __call__(self, batch: dict, num_items: torch.Tensor) -> torch.Tensor:
        self.calls.append((batch, num_items, self.fake_cuda["capturing"]))
        if self.fail and self.fake_cuda["capturing"]:
            raise RuntimeError(self.fail)
        return batch["input_ids"].float().sum() / num_items


def count(n: int) -> torch.Tensor:
    """The window's token count, a device scalar (as the loop passes it)."""
    return torch.tensor(float(n))


def batch(width: int, fill: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.full((2, width), fill), "labels": torch.full((2, width), fill + 1)}


def test_a_shape_runs_eagerly_then_is_captured_then_replays(fake_cuda) -> None:
    step, notes = Step(fake_cuda), []
    steps = GraphedSteps(step, torch.device("cpu"), notes.append)
    loss = steps(batch(8, 1), count(10))  # eager: lazy initialisation and autotuning happen here
    assert fake_cuda["captures"] == 0 and len(step.calls) == 1 and step.calls[0][1].item() == 10
    assert loss.item() == pytest.approx(16 / 10) and not step.calls[0][2]

    steps(batch(8, 2), count(20))  # captured into static buffers, then replayed
    assert fake_cuda["captures"] == 1 and len(step.calls) == 2
    captured, num_items, capturing = step.calls[1]
    graph = steps.graphs[next(iter(steps.graphs))]
    assert capturing and num_items is graph.num_items and captured is graph.inputs
    assert graph.graph.replays == 1 and graph.num_items.item() == 20
    assert torch.equal(graph.inputs["labels"], batch(8, 2)["labels"])

    loss = steps(batch(8, 3), count(30))  # only copies and a replay
    assert len(step.calls) == 2 and graph.graph.replays == 2 and loss is graph.loss
    assert torch.equal(graph.inputs["input_ids"], batch(8, 3)["input_ids"]) and graph.num_items.item() == 30
    assert steps.summary() == "CUDA graphs: 2 micro batches replayed from 1 captured shape(s), 1 ran eagerly"
    assert notes == []


def test_plain_rows_are_captured_as_causal_and_packed_or_padded_ones_keep_their_mask(
    fake_cuda, monkeypatch
) -> None:
    """Inside a capture Transformers counts as tracing and cannot read the position ids. For rows the host saw
    neither packed nor padded it is told that nothing is traced and no row is packed (so it asks SDPA for its
    causal kernel, as eagerly); packed rows, and padded ones, keep its mask."""
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_cuda_stream_capturing", lambda: fake_cuda["capturing"])
    seen = []

    def step(batch: dict, num_items) -> torch.Tensor:
        positions = batch.get("position_ids", torch.arange(6).repeat(2, 1))
        seen.append((masking_utils.is_tracing(), masking_utils.find_packed_sequence_indices(positions)))
        return batch["input_ids"].float().sum()

    plain = {"input_ids": torch.ones(2, 6, dtype=torch.long), "position_ids": torch.arange(6).repeat(2, 1)}
    packed = {**plain, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])}
    padded = {"input_ids": plain["input_ids"], "attention_mask": torch.ones(2, 6, dtype=torch.long)}
    assert not graphs.packed(plain) and graphs.packed(packed) and not graphs.packed(padded)
    steps = GraphedSteps(step, torch.device("cpu"), [].append)
    for batch_ in (plain, plain, packed, packed, padded, padded):
        steps(batch_, count(1))
    assert len(steps.graphs) == 3 and fake_cuda["captures"] == 3
    tracing = [t for t, _ in seen]
    # eagerly nothing traces; captured, only the plain rows are told it does not
    assert tracing == [False, False, False, True, False, True]
    found = [f for _, f in seen]
    assert found[0] is None and found[1] is None  # the plain rows, eagerly and captured (told)
    assert torch.equal(found[2], found[3]) and torch.equal(found[3][0], torch.tensor([0, 0, 0, 1, 1, 1]))
    assert masking_utils.find_packed_sequence_indices(packed["position_ids"]) is not None  # restored after
    fake_cuda["capturing"] = True
    assert masking_utils.is_tracing()  # restored after


def test_at_most_max_graphs_shapes_are_captured(fake_cuda) -> None:
    steps = GraphedSteps(Step(fake_cuda), torch.device("cpu"), [].append)
    widths = range(4, 4 + MAX_GRAPHS + 2)
    for _ in range(3):
        for width in widths:
            steps(batch(width, 1), count(1))
    assert len(steps.graphs) == MAX_GRAPHS == fake_cuda["captures"]
    assert (steps.replays, steps.eager_steps) == (2 * MAX_GRAPHS, MAX_GRAPHS + 3 * 2)


def test_a_capture_that_fails_says_why_and_leaves_the_run_eager(fake_cuda) -> None:
    """The note names the error that broke the capture, not the one ending it."""
    step, notes = Step(fake_cuda, fail="operation not permitted when stream is capturing\nmore detail"), []
    steps = GraphedSteps(step, torch.device("cpu"), notes.append)
    for fill in range(4):
        steps(batch(8, fill), count(5))
    assert fake_cuda["captures"] == 1 and steps.graphs == {} and steps.eager_steps == 4
    calls = [
        "captured" if capturing else batch_["input_ids"][0, 0].item() for batch_, _, capturing in step.calls
    ]
    assert calls == [0, "captured", 1, 2, 3]  # the batch whose capture failed runs eagerly too
    assert notes == [
        "training.cuda_graphs: capturing the step failed (operation not permitted when stream is capturing); "
        "the run goes on eagerly"
    ]


def test_after_each_run_runs_now_eagerly_and_after_every_replay_of_a_captured_step(fake_cuda) -> None:
    """What a step hands to after_each_run runs at once in an eager step; in a capture it is kept with that
    shape's graph and runs after each of its replays (the capture's first included), and not for other shapes."""
    ran: list[tuple[int, bool]] = []

    def step(batch_: dict, num_items: torch.Tensor) -> torch.Tensor:
        width = batch_["input_ids"].shape[1]
        graphs.after_each_run(lambda: ran.append((width, fake_cuda["capturing"])))
        return batch_["input_ids"].float().sum()

    steps = GraphedSteps(step, torch.device("cpu"), [].append)
    steps(batch(8, 1), count(1))  # eager
    assert ran == [(8, False)]
    steps(batch(8, 2), count(1))  # captured (the callback waits), then replayed (it runs)
    assert ran == [(8, False)] * 2 and len(steps.graphs[next(iter(steps.graphs))].after) == 1
    steps(batch(4, 1), count(1))  # another shape, eager
    steps(batch(8, 3), count(1))  # a replay
    assert ran == [(8, False), (8, False), (4, False), (8, False)]
    assert not graphs._capturing  # nothing left collecting after the capture


def test_preference_metrics_add_each_replay_of_the_tensors_its_graph_writes(fake_cuda) -> None:
    """A preference objective's metric sums are added after each replay, from copies: the graph's tensors are
    written again by its next replay and must not be the sums the metrics keep."""
    from loralei.train.preference.logps import PairLogits, PairLogps
    from loralei.train.preference.losses import PairTerms
    from loralei.train.preference.objective import PairMetrics

    metrics = PairMetrics()

    def step(batch_: dict, num_items: torch.Tensor) -> torch.Tensor:
        reward = batch_["input_ids"][:, 0].float()  # (2,): two pairs
        terms = PairTerms(reward, reward, reward - 1, reward, reward, {})
        logps = PairLogps(reward, reward, torch.ones(2), torch.ones(2))
        metrics.add(terms, logps, PairLogits(reward, reward))
        return reward.sum()

    steps = GraphedSteps(step, torch.device("cpu"), [].append)
    for fill in (1, 2, 3):  # eager, captured + replayed, replayed (the fake replay writes nothing new)
        steps(batch(4, fill), count(1))
    read = metrics.read()
    assert metrics.read() == {}  # read starts over
    # rewards 1 (eager), then the captured batch's 2 twice: 6 pairs, mean (2·1 + 4·2) / 6
    assert read["rewards/chosen"] == pytest.approx(10 / 6) and read["rewards/accuracies"] == 1.0
    assert read["logits/chosen"] == pytest.approx(10 / 6)  # per token: one token a completion

    steps(
        batch(4, 4), count(1)
    )  # a replay right after a read: the first sums since, from the graph's tensors
    (callback,) = steps.graphs[next(iter(steps.graphs))].after
    cells = [cell.cell_contents for cell in callback.__closure__]
    captured = dict(zip(callback.__code__.co_freevars, cells, strict=True))
    captured["sums"].add_(100.0)  # what the graph's next replay does to its tensors
    assert metrics.read()["rewards/chosen"] == pytest.approx(2.0)  # the copy kept the replay's values


@pytest.mark.parametrize("graphs", [None, "adding", "writing"])
def test_after_a_step_the_gradients_are_freed_zeroed_or_left_to_be_written(graphs) -> None:
    """Eager: freed. Replays that add into the .grad tensors their capture saw: zeroed in place. Graphs whose
    micro batches write the gradients: left as they are (the next micro batch replaces them)."""
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.ones(3)
    grad = param.grad
    opt = torch.optim.SGD([param], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    steps = None if graphs is None else types.SimpleNamespace(writes_grads=graphs == "writing")
    objs = Trainables(torch.nn.Linear(1, 1), opt, sched, graphs=steps)
    _optimizer_step(objs, [param], torch.tensor(1.0), None).read()
    if graphs is None:
        assert param.grad is None
    else:
        assert param.grad is grad
        assert torch.equal(grad, torch.zeros(3) if graphs == "adding" else torch.ones(3))


class BackwardStep(Step):
    """A micro step with a backward: ``param`` gets the batch's mean id (over the token count) as gradient."""

    def __init__(self, fake_cuda: dict, param: torch.nn.Parameter) -> None:
        super().__init__(fake_cuda)
        self.param = param

    def __call__(self, batch: dict, num_items: torch.Tensor) -> torch.Tensor:
        self.calls.append((batch, num_items, self.fake_cuda["capturing"]))
        loss = (self.param * batch["input_ids"].float().sum() / num_items).sum()
        loss.backward()
        return loss


def test_with_one_micro_batch_per_step_each_writes_the_gradients(fake_cuda) -> None:
    """Given the parameters, an eager micro batch drops the stale .grad before its backward, a capture runs with
    none (so its backward hands over the gradient it formed), and every replay points .grad at its graph's."""
    param = torch.nn.Parameter(torch.zeros(2))
    steps = GraphedSteps(BackwardStep(fake_cuda, param), torch.device("cpu"), lambda note: None, [param])
    assert steps.writes_grads
    param.grad = torch.full((2,), 100.0)  # the step before's
    steps(batch(2, 1), count(1))  # eager
    assert torch.equal(param.grad, torch.full((2,), 4.0))
    steps(batch(2, 2), count(1))  # captured
    graph = steps.graphs[next(iter(steps.graphs))]
    assert graph.grads is not None and graph.grads[0] is param.grad
    assert torch.equal(param.grad, torch.full((2,), 8.0))
    param.grad = torch.full((2,), 100.0)  # e.g. another shape's eager batch in between
    steps(batch(2, 3), count(1))  # a replay (the fake one computes nothing): .grad is the graph's again
    assert param.grad is graph.grads[0]


def test_without_the_parameters_micro_batches_add_into_the_gradients(fake_cuda) -> None:
    """Several micro batches per step: the graphs keep the .grad tensors and add into them, as eager steps do."""
    param = torch.nn.Parameter(torch.zeros(2))
    steps = GraphedSteps(BackwardStep(fake_cuda, param), torch.device("cpu"), lambda note: None)
    assert not steps.writes_grads
    param.grad = torch.full((2,), 100.0)
    grad = param.grad
    steps(batch(2, 1), count(1))
    steps(batch(2, 2), count(1))  # captured: adds, as CUDA's capture of the backward records it
    assert param.grad is grad and torch.equal(grad, torch.full((2,), 112.0))
    assert steps.graphs[next(iter(steps.graphs))].grads is None


def _fixed_rows(n: int = 24, width: int = 16, vocab: int = 128) -> list[dict[str, list[int]]]:
    """Rows of one length (no padding, so no attention mask): every batch has one shape."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab - 1, (n, width), generator=g)
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in ids]


def _graphed_and_eager(
    tmp_path, rows, dtype: torch.dtype, moe: bool = False, dora: bool = False, **training
) -> dict:
    """The run eager and graphed: losses, adapter and notes of each. ``moe``: the tiny Qwen3-MoE with LoRA on
    q_proj and both expert banks (the fused grouped op; bf16 banks replay), else the tiny Llama (with ``dora``,
    DoRA on its projections)."""
    runs = {}
    lora = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "use_dora": dora}
    if moe:
        banks = ["experts.gate_up_proj", "experts.down_proj"]
        lora = lora | {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "target_parameters": banks}
    for graphed in (False, True):
        out = tmp_path / f"graphs-{graphed}"
        cfg = make_cfg(out, training={"cuda_graphs": graphed, **training}, lora=lora)
        model = tiny_moe_model(dtype=dtype) if moe else tiny_model("llama", dtype=dtype)
        result = train(cfg, model=model, dataset=rows, collate_fn=collate)
        if moe:
            loaded = load_pretrained(tiny_moe_model(dtype=dtype), result.adapter_dir)
            adapter = {k: v.detach().clone() for k, v in lora_state_dict(loaded).items()}
        else:
            adapter = adapter_tensors(result.adapter_dir)
        runs[graphed] = (losses(out), adapter, result.notes)
    return runs


def _assert_replayed_as_eager(runs: dict, loss_rtol: float, **tol: float) -> dict[str, torch.Tensor]:
    """12 micro batches of one shape: the first eager, the second captured, every one after replayed; the graphed
    run's losses (within ``loss_rtol``) and adapter tensors (within ``tol``) are the eager run's. Returns the
    eager adapter."""
    (want_losses, want, _), (got_losses, got, notes) = runs[False], runs[True]
    assert "CUDA graphs: 11 micro batches replayed from 1 captured shape(s), 1 ran eagerly" in notes, notes
    torch.testing.assert_close(got_losses, want_losses, rtol=loss_rtol, atol=0.0)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m, n=name: f"{n}: {m}")
    return want


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [False, True, "offload"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulation", [2, 1])
def test_a_graphed_run_trains_as_the_eager_run(tmp_path, checkpointing, dtype, accumulation) -> None:
    """One shape: every micro batch after the first two replays; the same kernels run, so the same losses and
    adapter. fp32 is held to its last bits, as AdamW carries them: on the H200 two eager fp32 runs agree exactly,
    while a graphed one differs by 5e-7 in a loss and up to 1e-5 in a LoRA factor after 6 steps (SDPA's fp32
    kernels run differently inside a capture; with eager attention the step cannot be captured at all). The
    factors move by more than 1e-2 over those steps, so a replay bug (a stale input, a lost or doubled micro
    batch, a wrong token count) shows a hundred times above the 1e-4 allowed. With one micro batch per step the
    graphs write the gradients instead of adding into them (a stale or lost gradient shows the same way)."""
    runs = _graphed_and_eager(
        tmp_path, _fixed_rows(), dtype, gradient_checkpointing=checkpointing,
        gradient_accumulation_steps=accumulation, max_steps=12 // accumulation,
    )  # fmt: skip
    fp32 = dtype == torch.float32
    tol = {"rtol": 0.0, "atol": 1e-4} if fp32 else {"rtol": 2e-2, "atol": 1e-3}
    want = _assert_replayed_as_eager(runs, 1e-5 if fp32 else 2e-2, **tol)
    assert max(want[name].abs().max().item() for name in want if "lora_B" in name) > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [False, True, "offload"])
def test_a_graphed_moe_run_trains_as_the_eager_run(tmp_path, checkpointing) -> None:
    """MoE experts on the fused op with bf16 banks sort, gather and multiply on the device alone (grouped GEMMs
    over device offsets), so their step replays: the same losses and adapter (expert factors included) as
    the eager run, at the bf16 tolerance of the dense run above."""
    runs = _graphed_and_eager(
        tmp_path, _fixed_rows(), torch.bfloat16, moe=True, gradient_checkpointing=checkpointing,
        gradient_accumulation_steps=1, max_steps=12,
    )  # fmt: skip
    want = _assert_replayed_as_eager(runs, 2e-2, rtol=2e-2, atol=1e-3)
    assert any("experts" in name for name in want)


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [False, True, "offload"])
@pytest.mark.parametrize("base", ["nf4", "nvfp4"])
def test_a_graphed_quantized_moe_run_trains_as_the_eager_run(tmp_path, base, checkpointing) -> None:
    """Quantized banks are dequantized whole for a training batch, reading nothing on the host, so their step
    replays too: NF4 banks (quantize_base) and an NVFP4 checkpoint's banks (ModelOpt's layout, read by the
    runner) train as the eager run, at the bf16 tolerance of the MoE run above, in every checkpointing mode (a
    recomputation dequantizes the banks again inside the capture)."""
    from test_quantized_experts import write_moe_checkpoint

    banks = ["experts.gate_up_proj", "experts.down_proj"]
    lora = {
        "r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj"],
        "target_parameters": banks,
    }
    top: dict = {}
    if base == "nf4":
        lora |= {"quantize_base": True, "nf4_block_size": 16, "nf4_scaler_block_size": 2}
    else:
        write_moe_checkpoint(tmp_path / "nvfp4")
        top["model"] = {"name_or_path": str(tmp_path / "nvfp4"), "dtype": "bfloat16"}
    runs = {}
    for graphed in (False, True):
        out = tmp_path / f"graphs-{graphed}"
        training = {
            "cuda_graphs": graphed,
            "gradient_checkpointing": checkpointing,
            "gradient_accumulation_steps": 1,
            "max_steps": 12,
        }
        cfg = make_cfg(out, training=training, lora=lora, **top)
        model = tiny_moe_model(dtype=torch.bfloat16) if base == "nf4" else None
        result = train(cfg, model=model, dataset=_fixed_rows(), collate_fn=collate)
        adapter = saved_adapter(result.adapter_dir)
        runs[graphed] = (losses(out), adapter, result.notes)
    want = _assert_replayed_as_eager(runs, 2e-2, rtol=2e-2, atol=1e-3)
    assert any("gate_up_proj" in name for name in want)


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [False, True, "offload"])
def test_a_graphed_dora_run_trains_as_the_eager_run(tmp_path, checkpointing, monkeypatch) -> None:
    """DoRA outputs go to pinned host memory and back inside the capture (loralei.train.dora_stash without
    checkpointing, every output of the tiny model's layers; loralei.train.kept_dora's down outputs with it: the
    capturing stream holds the tensors its copies read until they are done, and the copies back write memory it
    allocated): the graphed run trains as the eager one."""
    from loralei.train import dora_stash

    monkeypatch.setattr(dora_stash, "FLOPS_PER_LINK_BYTE", 1)
    runs = _graphed_and_eager(
        tmp_path, _fixed_rows(), torch.float32, dora=True, gradient_checkpointing=checkpointing,
        gradient_accumulation_steps=1, max_steps=12,
    )  # fmt: skip
    _assert_replayed_as_eager(runs, 1e-5, rtol=0.0, atol=1e-4)
    kept = any("DoRA down outputs kept in 2 of 2 layers" in note for note in runs[True][2])
    assert kept is bool(checkpointing)


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [False, "offload"])
def test_a_graphed_run_with_tiled_mlps_trains_as_the_eager_run(tmp_path, checkpointing, monkeypatch) -> None:
    """The tiled MLP's backward runs each tile again with autograd inside the captured backward: it replays, and
    trains as the eager run does."""
    from loralei.train import tiled_mlp

    monkeypatch.setattr(tiled_mlp, "tile_tokens", lambda model: 4)
    runs = _graphed_and_eager(
        tmp_path, _fixed_rows(), torch.float32, tiled_mlp=True, gradient_checkpointing=checkpointing,
        gradient_accumulation_steps=1, max_steps=12,
    )  # fmt: skip
    _assert_replayed_as_eager(runs, 1e-5, rtol=0.0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [False, "offload"])
@pytest.mark.parametrize("accumulation", [2, 1])
def test_batches_of_several_widths_replay_one_graph_per_shape(tmp_path, checkpointing, accumulation) -> None:
    """Padded batches of varying width (an attention mask, built inside the graph): each width seen twice gets a
    graph, and the run trains as the eager one. With offload, a longer batch grows the pinned buffers after
    shorter ones were captured; the graphs' buffers stay theirs. With one micro batch per step, each graph writes
    its own gradient tensors, eager batches of new widths come between replays."""
    runs = _graphed_and_eager(
        tmp_path, token_dataset(48), torch.float32, max_steps=24 // accumulation,
        gradient_checkpointing=checkpointing, gradient_accumulation_steps=accumulation,
    )  # fmt: skip
    (want_losses, want, _), (got_losses, got, notes) = runs[False], runs[True]
    summary = next(note for note in notes if note.startswith("CUDA graphs:"))
    assert not summary.startswith("CUDA graphs: 0 ")
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.gpu
def test_after_a_failed_capture_the_run_and_its_random_draws_go_on() -> None:
    """A step that reads a device value on the host cannot be captured: it says so, runs eagerly, and CUDA's
    generator draws the same numbers as it would have without the attempt."""
    device = torch.device("cuda")
    weight = torch.nn.Parameter(torch.ones(4, device=device))

    def syncing_step(batch: dict, num_items) -> torch.Tensor:
        loss = (weight * batch["input_ids"].float()).sum() / num_items
        if loss.item() > 1e9:  # a host read: fine eagerly, illegal inside a capture
            raise AssertionError
        loss.backward()
        return loss

    notes: list[str] = []
    steps = GraphedSteps(syncing_step, device, notes.append)
    torch.manual_seed(5)
    for _ in range(3):
        steps({"input_ids": torch.ones(1, 4, dtype=torch.long)}, torch.tensor(2.0, device=device))
    drawn = torch.randn(3, device=device)
    assert steps.graphs == {} and steps.eager_steps == 3
    assert len(notes) == 1 and "operation not permitted when stream is capturing" in notes[0]
    torch.testing.assert_close(weight.grad, torch.full((4,), 1.5, device=device))  # 3 eager steps of 1/2
    torch.manual_seed(5)
    torch.testing.assert_close(drawn, torch.randn(3, device=device))


def test_the_loop_divides_by_the_token_count_as_a_device_scalar_eager_or_graphed() -> None:
    """Eager steps get the count as the graphs do: a 0-dim float32 tensor, not a Python number (CUDA multiplies
    by a Python number's reciprocal, a last-bit difference from the division a graph records)."""
    from loralei.train.loop import LoopSettings, _forward_backward

    seen = []

    def loss_fn(model, batch, labels, num_items):
        seen.append(num_items)
        return model(batch["input_ids"].float()).sum() / num_items

    model = torch.nn.Linear(4, 1)
    objs = Trainables(model, optimizer=None, scheduler=None)
    settings = LoopSettings(1, 1, None, 1, None, None, 3, torch.device("cpu"))
    micro = {"input_ids": torch.ones(2, 4, dtype=torch.long), "labels": torch.ones(2, 4, dtype=torch.long)}
    _forward_backward(objs, [micro], loss_fn, settings)
    assert len(seen) == 1 and isinstance(seen[0], torch.Tensor)
    assert seen[0].dim() == 0 and seen[0].dtype == torch.float32 and seen[0].item() == 6  # 2 rows x 3 targets
