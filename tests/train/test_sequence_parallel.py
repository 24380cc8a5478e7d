"""Sequence parallelism (Ulysses) on the CPU: two gloo processes, each with half of every row, give the loss and
the LoRA gradients of one process with the whole rows, and the runner trains like one process; the shards'
layout; the settings it refuses."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from sequence_parallel_worker import batch, lora_grads, lora_model
from test_ddp import CUDA, RTOL, _config, _ok, assert_trains_like_one_process
from test_ddp import _launch as _launch_runner
from test_run import losses

from launching import child_env
from loralei.errors import ConfigError, LoraleiError
from loralei.train import sequence_parallel, sequence_rows
from loralei.train.data.collate import block_causal_mask
from loralei.train.losses import IGNORE_INDEX, SHIFTED, build_loss, count_trainable_tokens, trainable_labels
from loralei.train.schema import validate_config
from tolerances import FP32_MEANINGFUL_BOUND, assert_fp32_close

WORKER = Path(__file__).resolve().parent / "sequence_parallel_worker.py"
ROOT = Path(__file__).resolve().parents[2]


def _launch(out: Path, processes: int, *args: str) -> None:
    env = child_env(gpus=CUDA)  # fewer than two GPUs: every rank on the CPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    proc = subprocess.run(
        [*cmd, str(WORKER), str(out), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize(
    ("processes", "heads", "kv_heads", "head_dim", "loss", "fused", "packed"),
    [
        pytest.param(2, 4, 2, 8, "cross_entropy", False, False, id="kv-heads-split"),
        pytest.param(2, 4, 1, 8, "cross_entropy", False, False, id="kv-head-on-both-ranks"),
        pytest.param(2, 4, 2, 8, "linear_cross_entropy", True, False, id="fused-linear-cross-entropy"),
        pytest.param(2, 3, 1, 8, "cross_entropy", False, False, id="uneven-query-heads"),
        pytest.param(
            2, 3, 1, 264, "cross_entropy", False, False, id="uneven-query-heads-repeat-kv-in-transformers"
        ),
        pytest.param(2, 6, 3, 8, "cross_entropy", False, False, id="kv-heads-repeated-to-queries"),
        pytest.param(2, 4, 2, 8, "cross_entropy", False, True, id="packed-documents"),
        pytest.param(4, 6, 2, 8, "linear_cross_entropy", True, True, id="four-ranks-six-heads-fused-packed"),
    ],
)
def test_ranks_per_sequence_give_the_loss_and_gradients_of_one_process(
    tmp_path: Path,
    processes: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    loss: str,
    fused: bool,
    packed: bool,
) -> None:
    """fp32: the runs differ only in the order of sums (RTOL: 1e-5 relative on the CPU, 1e-4 where two GPUs run
    the ranks through NCCL against the CPU's one-process run; far below what a lost cross-shard target,
    a wrong position, a key/value head read by the wrong query head, a document attending to another or a missing
    exchange gradient moves). Head counts the ranks do not divide give some ranks one head more (3 over 2, 6 over
    4), and key/value heads whose query heads fall on two ranks go to both (6 heads reading 3 or 2). Heads of more
    than 256 dims make Transformers' sdpa path repeat key/value heads itself, by the ratio the rank's heads have.
    Packed rows hold documents that span ranks; the one-process run attends with their block-diagonal mask."""
    args = (str(n) for n in (heads, kv_heads, head_dim))
    _launch(tmp_path / "sp.pt", processes, *args, loss, "1" if fused else "0", "1" if packed else "0")
    got = torch.load(tmp_path / "sp.pt")
    model, whole = lora_model(heads, kv_heads, fused, head_dim), batch(packed)
    count = count_trainable_tokens(whole)
    want = build_loss(loss, liger=False)(model, whole, trainable_labels(whole), count)
    want.backward()
    torch.testing.assert_close(got["loss"], want.detach(), rtol=RTOL, atol=0)
    grads = lora_grads(model)
    assert got["grads"].keys() == grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=RTOL, atol=1e-7, msg=name)


HEAD_COUNTS = [(8, 8), (8, 2), (7, 7), (6, 2), (12, 4), (28, 4), (5, 1), (40, 8)]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size"),
    [(h, kv, size) for h, kv in HEAD_COUNTS for size in range(1, 9) if size <= h],
)
def test_each_rank_attends_with_the_key_value_head_each_of_its_query_heads_reads(
    heads: int, kv_heads: int, size: int
) -> None:
    plans = [sequence_parallel.head_plan(heads, kv_heads, size, rank) for rank in range(size)]
    queries = plans[0].queries
    assert [h for r in queries for h in r] == list(range(heads))  # every head once, in order
    assert max(map(len, queries)) - min(map(len, queries)) <= 1
    per_kv = heads // kv_heads
    for rank, plan in enumerate(plans):
        assert plan.queries == queries and plan.kv == plans[0].kv
        received = list(plan.kv[rank])
        if plan.kv_counts is None:  # grouped-query layout: local query head i reads received head i // ratio
            ratio = len(queries[rank]) // len(received)
            read = [received[i // ratio] for i in range(len(queries[rank]))]
        else:  # the received heads repeated to one per query head
            read = [j for j, c in zip(received, plan.kv_counts, strict=True) for _ in range(c)]
        assert read == [h // per_kv for h in queries[rank]]


def test_the_run_says_how_the_heads_split_and_what_an_uneven_split_costs() -> None:
    assert sequence_parallel.head_split_text(32, 4) == "32 heads, 8 a rank"
    uneven = sequence_parallel.head_split_text(28, 8)
    assert (
        uneven
        == "28 heads, 4 or 3 a rank: attention 1.14x an even split's time, which a divisor of 28 ranks avoids"
    )


def test_sequence_parallel_heads_are_refused_only_past_the_head_count() -> None:
    config = lora_model(4, 2, False).config
    assert sequence_parallel.refusal(config, 3, "sdpa") is None
    assert "5 is more ranks than this model's 4 attention heads" in sequence_parallel.refusal(
        config, 5, "sdpa"
    )
    assert "set model.attn_implementation: sdpa" in sequence_parallel.refusal(config, 2, "eager")


def test_shards_cut_each_row_after_the_shift_and_pad_it_on_the_right() -> None:
    whole = batch()
    shards = [sequence_parallel.shard_batch(whole, i, 2) for i in range(2)]
    assert all(s["input_ids"].shape == (2, 12) for s in shards)  # 23 tokens padded to 24
    ids = torch.cat([s["input_ids"] for s in shards], 1)
    assert torch.equal(ids[:, :23], whole["input_ids"]) and not ids[:, 23].any()
    assert torch.equal(torch.cat([s["position_ids"] for s in shards], 1), torch.arange(24).expand(2, 24))
    targets = torch.cat([s[SHIFTED] for s in shards], 1)
    # position 11 (rank 0's last) predicts token 12 (rank 1's first)
    assert targets[0, 11] == whole["labels"][0, 12]
    assert (targets[:, 22:] == IGNORE_INDEX).all() and (targets[1, 16:] == IGNORE_INDEX).all()
    assert sum(count_trainable_tokens(s) for s in shards) == count_trainable_tokens(whole)


def test_a_world_the_group_size_does_not_divide_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(sequence_parallel.distributed, "world_size", lambda: 3)
    with pytest.raises(ConfigError, match=r"sequence_parallel_size: 2 does not divide the 3 processes"):
        sequence_parallel.new_group(2)


@pytest.mark.parametrize(
    ("processes", "batch_size", "training"),
    [
        (2, 4, {}),
        (4, 2, {}),
        (2, 4, {"gradient_checkpointing": "offload"}),
        (4, 2, {"distributed": "fsdp2", "gradient_checkpointing": True}),
    ],
    ids=["one-group", "two-groups-ddp", "one-group-offload", "two-groups-fsdp2"],
)
def test_the_runner_with_two_ranks_per_sequence_trains_like_one_process(
    tmp_path: Path, processes: int, batch_size: int, training: dict
) -> None:
    """torchrun, ``sequence_parallel_size: 2``: 2 processes (one group, both ranks read every batch), or 4 (two
    groups, DDP between them, each reading half of every global batch): the same losses and the same final
    adapter as one process with the same global batches; also with each rank's layer inputs in host memory
    (``offload``: the exchanges run again in the backward's recomputation), and with the frozen base sharded
    over all four ranks by FSDP2 (checkpointed: the recomputation gathers each layer's weights again)."""
    sp = _config(tmp_path, "sp", batch_size=batch_size, sequence_parallel_size=2, **training)
    proc = _launch_runner(["run", str(sp)], nproc=processes)
    _ok(proc)
    # what the run says (each rank holding the whole rows would train alike, but not split anything)
    groups = processes // 2
    assert "each sequence split over 2 ranks (Ulysses" in proc.stdout + proc.stderr
    assert f"{groups} data-parallel group(s)" in proc.stdout + proc.stderr
    one = {k: v for k, v in training.items() if k != "distributed"}
    _ok(_launch_runner(["run", str(_config(tmp_path, "one", batch_size=4, **one))], nproc=None))
    assert_trains_like_one_process(tmp_path / "sp", tmp_path / "one")


def _quickstart(out: Path, processes: int | None, *overrides: str) -> subprocess.CompletedProcess:
    """loralei-finetune on the quickstart (packed rows of several conversations), on the CPU, for 6 steps logged
    one by one: in ``processes`` processes (``--nproc-per-node``), or in this one's twin (``None``)."""
    env = child_env()
    nproc = ["--nproc-per-node", str(processes)] if processes else []
    settings = ["training.max_steps=6", "training.logging_steps=1", "training.save_steps=null"]
    settings += ["optimizer.warmup_steps=1", f"output_dir={out}"]
    cmd = [sys.executable, "-m", "loralei.cli", *nproc, "examples/quickstart.yaml", *settings, *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_packed_rows_split_over_two_processes_train_like_one(tmp_path: Path) -> None:
    """The quickstart packs several conversations into each 256-token row; split over two ranks (128 positions
    each), its documents stay apart: the losses of one process with the whole rows at 1e-5 (one document
    attending to another moves them far more), and each adapter tensor norm-wise to FP32_MEANINGFUL_BOUND. At lr
    1e-2, Adam's normalised steps turn the summation order's difference in a tiny gradient into a move of its own
    size: layer 0's k projection (A) ends 1.2e-4 apart with ATen's AVX2 kernels
    (an AMD EPYC) and 1.3e-5 with its scalar ones, every other tensor within 5e-5, while the losses agree to 2e-7."""
    split = _quickstart(tmp_path / "sp", 2, "training.sequence_parallel_size=2")
    _ok(split)
    assert "packed documents kept apart" in split.stdout + split.stderr
    _ok(_quickstart(tmp_path / "one", None))
    got, want = losses(tmp_path / "sp"), losses(tmp_path / "one")
    assert len(got) == 6
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    got, want = (
        load_file(tmp_path / run / "adapter" / "loralei_adapter.safetensors") for run in ("sp", "one")
    )
    assert got.keys() == want.keys() and want
    for name in want:
        assert_fp32_close(got[name], want[name], name, tolerance=FP32_MEANINGFUL_BOUND)


def test_settings_a_sequence_parallel_run_cannot_take_are_refused_together() -> None:
    raw = {
        "model": {"name_or_path": "m", "attn_implementation": "eager"},
        "data": {"path": "d"},
        "output_dir": "o",
        "training": {
            "sequence_parallel_size": 2,
            "packing": True,
            "liger_kernel": True,
            "distributed": "none",
        },
    }
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    assert "packing" not in str(err.value)  # packed rows keep their documents apart across the ranks
    for fix in (
        "set liger_kernel: auto or false",
        "distributed: none (it runs its ranks under DDP or FSDP2); set distributed: auto, ddp or fsdp2",
        "attn_implementation: eager (it wraps sdpa, flash_attention_2 or flex_attention); set it to sdpa",
    ):
        assert fix in str(err.value)


@pytest.mark.parametrize("length", [7, 128, 300])
def test_flex_attention_document_mask_is_the_packed_rows_block_causal_mask(length: int) -> None:
    """Under flex attention the whole rows' documents are kept apart by a block mask whose dense form is the
    block-diagonal causal mask sdpa gets (rows with documents across block borders, and one unpacked row)."""
    from torch.nn.attention.flex_attention import create_mask

    g = torch.Generator().manual_seed(length)
    cuts = torch.randint(0, 2, (length,), generator=g).bool() & (torch.rand(length, generator=g) < 0.05)
    packed = torch.zeros(length, dtype=torch.long)
    for t in range(1, length):
        packed[t] = 0 if cuts[t] else packed[t - 1] + 1
    rows = torch.stack([packed, torch.arange(length)])
    mod = sequence_rows.document_mask_mod(rows)
    dense = create_mask(mod, 2, 1, length, length, device="cpu")
    assert torch.equal(dense, block_causal_mask(rows))


@pytest.mark.parametrize(("inner", "packed"), [("sdpa", True), ("flex_attention", False)])
def test_an_attention_without_position_ids_is_refused_where_the_whole_rows_mask_needs_them(
    inner: str, packed: bool
) -> None:
    """Packed rows (and flex attention's causal mask) need the whole rows' position ids: an attention module
    whose model does not pass them on is refused before any exchange, not run across documents."""
    module = torch.nn.Module()
    setattr(module, sequence_parallel.SPLIT, sequence_parallel.Split(None, inner, packed))
    q = torch.zeros(1, 4, 8, 8)
    with pytest.raises(LoraleiError, match="does not pass its position ids to the attention function"):
        sequence_parallel.ulysses_attention(module, q, q, q, None)


def test_validate_says_each_sequence_is_split(monkeypatch, capsys) -> None:
    from loralei import cli

    monkeypatch.chdir(ROOT)
    argv = ["validate", "examples/quickstart.yaml", "training.sequence_parallel_size=2"]  # packed rows
    assert cli.main(argv) == 0
    assert "sequence parallelism: each sequence split over 2 ranks under torchrun" in capsys.readouterr().out


@contextlib.contextmanager
def _one_rank_group() -> Iterator[Any]:
    """A process group of this process alone on the GPU (NCCL), for the wrapped attention's CUDA paths: its
    exchanges and gathers are copies, so the wrapped model must match the model itself."""
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _packed_twins(
    attention: str, group: Any
) -> tuple[torch.nn.Module, torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny Llama with LoRA (heads of 16 dims, as flex attention's kernels want) under ``attention``, its twin
    with the sequence-parallel wrapper over ``group``, and 2 rows of 160 tokens packed with documents."""
    import copy

    from loralei import LoRAConfig, inject_lora
    from tiny_models import tiny_model

    torch.manual_seed(0)
    model = tiny_model("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    model = inject_lora(model, LoRAConfig(r=4, lora_alpha=8, init_lora_weights=False))
    model.set_attn_implementation(attention)
    twin = copy.deepcopy(model)
    sequence_parallel.enable(twin, group, packed=True)
    ids = torch.randint(1, 128, (2, 160))
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in [(70, 90), (15, 100, 45)]])
    whole = {"input_ids": ids, "position_ids": positions, "labels": ids.masked_fill(positions == 0, -100)}
    return model, twin, whole


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "flex_attention"])
def test_packed_documents_on_the_gpu_attend_as_the_model_itself_has_them(attention: str) -> None:
    """CUDA (one rank through NCCL), fp32, 2 rows of 160 tokens packed with documents (flex attention's kernels want
    rows of 128 tokens or more): the sequence-parallel attention with the whole rows' document mask (sdpa's dense
    one, flex attention's block mask) gives the loss and LoRA gradients of the model attending with Transformers'
    own mask for those position ids."""
    with _one_rank_group() as group:
        model, twin, whole = _packed_twins(attention, group)
        results = []
        for run, rows in [(model, whole), (twin, sequence_parallel.shard_batch(whole, 0, 1))]:
            run.cuda()
            on_gpu = {k: v.cuda() for k, v in rows.items()}
            loss = build_loss("cross_entropy", liger=False)(
                run, on_gpu, trainable_labels(on_gpu), count_trainable_tokens(whole)
            )
            loss.backward()
            results.append((loss.detach(), lora_grads(run)))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
