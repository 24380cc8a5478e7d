"""The runner's own speed: ``loralei.train.run.train`` with its default settings (what ``loralei-finetune`` does
without flags: fused LoRA, ``liger_kernel: auto``, ``loss: auto``) on a benchmark shape.

The shape's random-weight model is loaded from a checkpoint directory on disk, as ``loralei-finetune`` loads a
user's model (``model.name_or_path``; a quantized base is read one decoder layer at a time and packed on the
device as it arrives):
``--model-dir`` names it, and it is written there first (bench_rows.save_checkpoint) when it holds no checkpoint
yet, so the runs of one device call write it once. Full-length rows of random token ids (every token trained) go
through the whole runner: its data loader, loss, optimizer, schedule, logging. The warm-up steps are untimed; the
timed steps run between two callbacks, after a device sync. Two peaks of allocated memory are reported: the
setup's (loading, quantizing, injecting: ``setup_peak_gib``, from the runner) and the training steps'
(``peak_gib``, and the reserved ``peak_reserved_gib``, over every step, warm-up included: a CUDA graph's
activations are allocated while it is captured, in the warm-up, and its replays allocate nothing). The JSON names
what ``auto`` chose and the run's notes (how many micro batches replayed graphs).

With ``--profile FILE.json`` one more step (``--profile-steps N``: N more, back to back) runs after the timed
ones (their clock is unchanged) under ``torch.profiler`` (CPU, and CUDA on a GPU, with input shapes), from a
device sync to a device sync. FILE.json gets profile_step.py's kernel summary of it (profile_summary.py: GPU ms by category, the LoRA-rank GEMMs, the
top 25 kernels), the step's wall-clock ms, the GPU's busy ms (its kernels' and copies' summed self time), where
the device sat idle (profile_summary.device_gaps: by gap length, the longest gaps) and where no kernel ran
(compute_gaps: host copies left out, by tenth of the step, the longest gaps and when), how much of the host-to-device
copies other device work hid (copy_overlap), the device time by launching
op, input shapes and autograd node (op_attribution; with --no-cuda-graphs, since replayed kernels have no
launching op), the top 15 CPU-side ops by
self time, and the host syncs it made (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize,
aten::item, aten::_local_scalar_dense: count and ms; the closing sync left out). Being
the run's last step, the profiled step reads its own verdict (loss, grad norm) and logs once, as the last
timed step does; a step inside a run reads the step before's instead.

    python benchmarks/bench_runner.py --shape llama3-8b --model-dir /tmp/models/llama3-8b --out OUT/runner-8b-off.json
    python benchmarks/bench_runner.py --shape llama3-8b --checkpointing on --out OUT/runner-8b-on.json
    python benchmarks/bench_runner.py --shape llama3-8b --checkpointing offload --out OUT/runner-8b-offload.json
    python benchmarks/bench_runner.py --shape qwen3-0.6b --compile --out OUT/runner-qwen-off-compiled.json
    python benchmarks/bench_runner.py --shape llama3-8b --quantize nf4 --checkpointing offload --out OUT/nf4.json
    python benchmarks/bench_runner.py --shape llama3-8b --gptq --checkpointing offload --out OUT/gptq.json
    python benchmarks/bench_runner.py --shape qwen3-30b-a3b-8l --nvfp4-checkpoint --out OUT/runner-moe-nvfp4.json
    python benchmarks/bench_runner.py --shape llama3-8b --quantize fp8 --profile OUT/profile-runner-8b-fp8.json \
        --out OUT/runner-8b-fp8.json
    python benchmarks/bench_runner.py --shape llama3-8b --checkpointing offload --layer-offloading \
        --memory-cap-gib 10 --out OUT/runner-8b-streamed-10gib.json
    python benchmarks/bench_runner.py --shape llama3-70b --quantize nf4 --checkpointing offload --random-layers \
        --layer-offloading --memory-cap-gib 24 --out OUT/runner-70b-nf4-streamed-24gib.json
    torchrun --nproc_per_node 2 benchmarks/bench_runner.py --shape llama3-8b-128k --checkpointing on \
        --model-dir /tmp/models/llama3-8b-long --sequence-parallel 2 --out OUT/sp-2gpu-128k.json

``--sequence-parallel N`` (under torchrun, a multiple of N processes) splits each sequence over N processes
(``training.sequence_parallel_size``); each group of N draws its own rows. The main process writes the result:
tokens/s of all the groups, the largest rank's peak (``peak_gib``) and every rank's step times and peaks
(``ranks``). The processes read the checkpoint a one-process run wrote (they would each write it).

``--nvfp4-checkpoint`` writes (and loads) the shape's checkpoint in ModelOpt's NVFP4 layout instead
(nvfp4_checkpoint.py): the runner reads it as stored, its expert banks 4-bit, the row to set beside ``--quantize
nf4``'s. ``--layer-offloading`` streams the layers' frozen weights from host memory (training.layer_offloading);
``--memory-cap-gib`` caps the device memory for the whole run (``torch.cuda.set_per_process_memory_fraction``):
loading, setup, warm-up and the timed steps. ``--random-layers`` makes a shape too large for the disk (the
70B one: 141 GB in bf16) without a checkpoint: its random weights are made one decoder layer at a time on the
device and packed as the runner packs a checkpoint it reads layer by layer, before the runner starts (under the
cap, if any): ``setup_peak_gib`` is then the runner's own setup, and ``host_peak_gib`` the whole process's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gptq_checkpoint
from bench_ops import gc_collections, sync
from bench_rows import (
    ALPHA,
    GPTQ_GROUP,
    MOE_TARGETS,
    RANK,
    SHAPES,
    build_model,
    is_moe,
    loralei_config,
    save_checkpoint,
)
from nvfp4_checkpoint import save_nvfp4_checkpoint
from profile_summary import (
    CLOSING,
    compute_gaps,
    copy_overlap,
    device_gaps,
    host_summary,
    op_attribution,
    print_summary,
    summarize,
)

from loralei import apply_fused_kernels, inject_lora
from loralei.kernels import gated_mlp_launch
from loralei.train import distributed, dora_stash, kept_attention, layered_load
from loralei.train.build import default_device
from loralei.train.fast_path import resolve_cuda_graphs, resolve_liger, resolve_loss
from loralei.train.input_checkpoint import offload_host_bytes
from loralei.train.losses import IGNORE_INDEX
from loralei.train.run import train
from loralei.train.schema import validate_config

# --checkpointing -> training.gradient_checkpointing
CHECKPOINTING = {"off": False, "on": True, "offload": "offload"}


def token_rows(shape: str, count: int, prompt_share: float = 0.0) -> list[dict[str, list[int]]]:
    """``count`` rows of the shape's sequence length, random ids (seeded), every token a label but the first
    ``prompt_share`` of each row's (a prompt, as assistant-only loss leaves a chat row's user turns)."""
    _, cfg, _, seq = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (count, seq), generator=g)
    labels = ids.clone()
    labels[:, : round(prompt_share * seq)] = IGNORE_INDEX
    return [
        {"input_ids": row.tolist(), "labels": label.tolist()} for row, label in zip(ids, labels, strict=True)
    ]


def collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Equal-length rows stacked (no padding, so no attention mask: causal attention as in bench_train_step)."""
    return {
        "input_ids": torch.tensor([r["input_ids"] for r in rows]),
        "labels": torch.tensor([r["labels"] for r in rows]),
    }


class StepClock:
    """A runner callback: starts the clock after step ``warmup``, stops it (and reads the run's peak memory)
    after step ``last``, both after a device sync. Without warm-up steps (``warmup`` 0: a step long enough that
    its first-call costs, autotuning and plans, are a small part of it) the clock starts as the loader makes the
    run's first batch (:meth:`from_first_batch`), since callbacks run after a step.

    In between it also notes, without a sync, when the host finished each timed step (``host_ms``: where the host
    sets the pace these follow the synced mean; where the GPU does, the host runs ahead and the last is short),
    each step's time on the device (``gpu_ms``, from CUDA events read after the stop) and how many garbage
    collections of each generation ran (``gc_runs``): what tells a slow run from a fast one.
    """

    def __init__(self, warmup: int, last: int, device: torch.device) -> None:
        self.warmup, self.last, self.device = warmup, last, device
        self.start = self.stop = 0.0
        self.peak_gib: float | None = None
        self.reserved_gib: float | None = None
        self.host_ms: list[float] = []
        self.gpu_ms: list[float] = []
        self.gc_runs: list[int] = []
        self._marks: list[float] = []
        self._events: list[torch.cuda.Event] = []

    def _event(self) -> None:
        if self.device.type == "cuda":
            self._events.append(torch.cuda.Event(enable_timing=True))
            self._events[-1].record()

    def _start(self) -> None:
        sync(self.device)
        self.gc_runs = gc_collections()
        self.start = time.perf_counter()
        self._marks = [self.start]
        self._event()

    def from_first_batch(self, collate: Callable[[list], dict]) -> Callable[[list], dict]:
        """``collate``, starting the clock before it makes the run's first batch when there is no warm-up."""
        waiting = self.warmup == 0

        def timed(rows: list) -> dict:
            nonlocal waiting
            if waiting:
                waiting = False
                self._start()
            return collate(rows)

        return timed

    def __call__(self, state) -> None:
        if state.global_step == self.warmup:
            self._start()
        elif self.warmup < state.global_step <= self.last:
            self._marks.append(time.perf_counter())
            self._event()
        if state.global_step == self.last:
            sync(self.device)
            self.stop = time.perf_counter()
            self.host_ms = [(b - a) * 1e3 for a, b in zip(self._marks[:-1], self._marks[1:], strict=True)]
            self.gpu_ms = [
                a.elapsed_time(b) for a, b in zip(self._events[:-1], self._events[1:], strict=True)
            ]
            self.gc_runs = [now - then for now, then in zip(gc_collections(), self.gc_runs, strict=True)]
            if self.device.type == "cuda":
                self.peak_gib = torch.cuda.max_memory_allocated() / 2**30
                self.reserved_gib = torch.cuda.max_memory_reserved() / 2**30


class RankResults:
    """A runner callback after the :class:`StepClock`: at the clock's stop, every rank's step times and peaks go
    to the main process (``ranks``, in rank order; one entry without a process group), while the runner's
    process group is up."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self.ranks: list[dict] = []

    def __call__(self, state) -> None:
        if state.global_step == self.clock.last:
            clock = self.clock
            mine = {
                "gpu_step_ms": clock.gpu_ms,
                "peak_gib": clock.peak_gib,
                "peak_reserved_gib": clock.reserved_gib,
            }
            self.ranks = distributed.gather_to_main(mine)


class StepProfile:
    """A runner callback: profiles steps ``first``..``step`` (CPU activity, and CUDA's on a GPU, with input
    shapes) from a device sync after the step before them to one after the last (in a ``CLOSING`` range), with
    no sync between them; ``wall_ms`` is that span."""

    def __init__(self, first: int, step: int, device: torch.device) -> None:
        self.first, self.step, self.device = first, step, device
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda" else [])]
        self.prof = profile(activities=activities, record_shapes=True)
        self.start = 0.0
        self.wall_ms: float | None = None

    def __call__(self, state) -> None:
        if state.global_step == self.first - 1:
            sync(self.device)
            self.prof.start()
            self.start = time.perf_counter()
        elif state.global_step == self.step:
            with record_function(CLOSING):
                sync(self.device)
                self.wall_ms = (time.perf_counter() - self.start) * 1e3
            self.prof.stop()


def cap_memory(gib: float, device: torch.device) -> None:
    """Caps what this process may allocate on ``device`` at ``gib`` (``set_per_process_memory_fraction``), for
    the whole run: loading, setup, warm-up and the timed steps."""
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), device)


class RandomWeights:
    """A model's random weights by name, made on ``device`` when read (seeded): matrices normal with std 0.02,
    vectors (norm weights) ones."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.shapes = {name: p.shape for name, p in model.named_parameters()}
        self.device = device
        self.generator = torch.Generator(device).manual_seed(0)

    def names(self) -> set[str]:
        return set(self.shapes)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            shape = self.shapes[name]
            if len(shape) == 1:
                out[name] = torch.ones(shape, device=self.device)
            else:
                out[name] = torch.randn(shape, generator=self.generator, device=self.device).mul_(0.02)
        return out


def random_layers(shape: str, cfg, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The shape's model with random weights made one decoder layer at a time on ``device`` and packed as the
    runner packs a checkpoint it reads by layers (loralei.train.layered_load), for models whose dense
    checkpoint the disk or host memory cannot hold; the packed layers go to host memory when they stream."""
    config_cls, config, _, _ = SHAPES[shape]
    model = layered_load.empty_model(config_cls(**config), dtype, "sdpa", trust_remote_code=False)
    lora = cfg.lora.model_copy(update={"quantization_device": str(device)})
    keep = torch.device("cpu") if cfg.training.layer_offloading else device
    layered_load.load_by_layers(model, RandomWeights(model, device), lora, keep)
    return model


def host_peak_gib() -> float:
    """The process's peak resident host memory so far (``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def total_steps(args: argparse.Namespace) -> int:
    """The warm-up and timed steps, and the profiled ones after them with --profile."""
    return args.warmup + args.steps + (args.profile_steps if args.profile else 0)


def lora_targets(shape: str) -> dict:
    """The ``lora`` section's rank and targets, as bench_train_step's rows have them: every linear layer on dense
    shapes; on MoE shapes q/k/v/o and both expert banks (``all-linear`` there would leave the experts, which
    are no ``nn.Linear``, without LoRA and on Transformers' own forward)."""
    targets = MOE_TARGETS if is_moe(shape) else {"target_modules": "all-linear"}
    return {"r": RANK, "lora_alpha": ALPHA} | targets


def run_config(args: argparse.Namespace, out_dir: Path, model_dir: Path | None = None) -> dict:
    """The run's config: the runner loads the model from ``model_dir``; None names a model the caller passes to
    ``train`` itself (memory_step.py's census hooks the instance it built)."""
    _, _, batch_size, _ = SHAPES[args.shape]
    name = str(model_dir) if model_dir is not None else f"random-{args.shape}"
    return {
        "model": {"name_or_path": name, "dtype": args.dtype},
        "data": {"path": "in-memory"},
        "lora": lora_targets(args.shape)
        | ({"quantize_base": True, "quantization_type": args.quantize} if args.quantize else {})
        | ({"use_dora": True} if args.dora else {}),
        "training": {
            "max_seq_length": SHAPES[args.shape][3],
            "batch_size": batch_size,
            "max_steps": total_steps(args),
            "gradient_checkpointing": CHECKPOINTING[args.checkpointing],
            "torch_compile": args.compile,
            "liger_kernel": "auto" if args.liger else False,
            "cuda_graphs": "auto" if args.graphs else False,
            "layer_offloading": args.layer_offloading,
            "tiled_mlp": "auto" if args.tiled_mlp else False,
            "sequence_parallel_size": args.sequence_parallel,
            # once, at the end of the timed steps: no host sync inside them (a profiled step logs again)
            "logging_steps": args.warmup + args.steps,
            "save_steps": None,
        },
        "optimizer": {"name": "adamw", "lr": 1e-4, "warmup_steps": 0},
        "output_dir": str(out_dir),
        "overwrite_output_dir": True,
    }


def row_name(args: argparse.Namespace) -> str:
    """``loralei-runner (defaults)``, naming each flag that changed them."""
    changes = [
        *([] if args.liger else ["no Liger"]),
        *([] if args.graphs else ["no CUDA graphs"]),
        *([f"{args.quantize} base"] if args.quantize else []),
        *(["GPTQ checkpoint"] if args.gptq else []),
        *(["DoRA"] if args.dora else []),
        *(["NVFP4 checkpoint"] if args.nvfp4_checkpoint else []),
        *(["torch_compile"] if args.compile else []),
        *(["layer offloading"] if args.layer_offloading else []),
        *([] if args.tiled_mlp else ["MLP untiled"]),
        *(
            [f"attention kept from {args.keep_attention_from} tokens"]
            if args.keep_attention_from is not None
            else []
        ),
        *([f"DoRA link share 1 byte per {args.dora_link_flops} FLOPs"] if args.dora_link_flops else []),
        *([f"{args.memory_cap_gib:g} GiB device cap"] if args.memory_cap_gib else []),
        *([f"the first {args.prompt_share:.0%} of each row untrained"] if args.prompt_share else []),
        *([f"each sequence over {args.sequence_parallel} GPUs"] if args.sequence_parallel > 1 else []),
    ]
    return "loralei-runner (" + ", ".join(["defaults", *changes]) + ")"


def model_checkpoint(
    args: argparse.Namespace, directory: Path, device: torch.device, dtype: torch.dtype
) -> Path:
    """The shape's random-weight checkpoint in ``directory``: written there when it holds none, else checked to
    be the shape's (a directory of another shape is refused, not overwritten). save_checkpoint writes the
    tokenizer last, as bench_train_step relies on: a save cut short is redone."""
    config = directory / "config.json"
    if not (directory / "tokenizer.json").is_file():
        if processes() > 1:  # every process would write it
            raise SystemExit(
                f"--model-dir {directory} holds no checkpoint yet, and {processes()} processes would each write "
                "it: run once in one process first (the one-GPU baseline writes it)"
            )
        save = save_nvfp4_checkpoint if args.nvfp4_checkpoint else save_checkpoint
        return save(args.shape, directory, device, dtype)
    saved, (_, expected, _, _) = json.loads(config.read_text()), SHAPES[args.shape]
    differing = [key for key, value in expected.items() if saved.get(key, value) != value]
    if ("quantization_config" in saved) != args.nvfp4_checkpoint:
        differing.append("quantization_config")
    if differing:
        raise SystemExit(
            f"--model-dir {directory} holds a checkpoint of another shape (its {', '.join(differing)} differ from "
            f"{args.shape}'s); name an empty or missing directory"
        )
    return directory


def processes() -> int:
    """How many processes torchrun started for this run (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def run_dir(tmp: str) -> Path:
    """The run's output directory: a fresh temporary one in one process; under torchrun one path that every
    process names (the runner writes from the main process), overwritten by the next such run."""
    if processes() == 1:
        return Path(tmp) / "run"
    return Path(tempfile.gettempdir()) / "bench-runner-torchrun"


def largest(ranks: list[dict], key: str) -> float | None:
    """The largest of the ranks' ``key`` (peaks in GiB), or None off CUDA."""
    values = [rank[key] for rank in ranks if rank[key] is not None]
    return max(values) if values else None


def auto_choices(cfg, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[str]:
    """The runner's own choices for this device and model (it prints the same lines), from the shape's model
    made on the meta device (no memory) with the run's LoRA targets on loralei's fused kernels (an MoE model's
    experts decide whether its steps can replay graphs)."""
    model = build_model(args.shape, torch.device("meta"), dtype)
    inject_lora(model, loralei_config("loralei-fused", args.shape))
    apply_fused_kernels(model)
    resolved, choices = resolve_liger(cfg, device)
    resolved, loss_choice = resolve_loss(resolved, model, device)
    several = processes() > 1
    _, graph_choice = resolve_cuda_graphs(resolved, model, device, distributed=several, own_batches=True)
    return choices + loss_choice + graph_choice


def measure(args: argparse.Namespace) -> dict | None:
    device = default_device()
    if args.memory_cap_gib and device.type != "cuda":
        raise SystemExit(
            "--memory-cap-gib caps CUDA memory, and this machine has no CUDA device; leave it out"
        )
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    _, _, batch_size, seq = SHAPES[args.shape]
    if args.keep_attention_from is not None:  # a probe of the runner's threshold, this process only
        kept_attention.AUTO_TOKENS = args.keep_attention_from
    if args.dora_link_flops is not None:  # a probe of the stash's link share, this process only
        dora_stash.FLOPS_PER_LINK_BYTE = args.dora_link_flops
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir = None
        if not args.random_layers:
            model_dir = model_checkpoint(args, args.model_dir or Path(tmp) / "model", device, dtype)
        if args.gptq:
            model_dir = gptq_checkpoint.convert_beside(model_dir, GPTQ_GROUP.get(args.shape, 128))
        cfg = validate_config(run_config(args, run_dir(tmp), model_dir))
        clock = StepClock(args.warmup, args.warmup + args.steps, device)
        ranks = RankResults(clock)
        # after the clock's stop (the callbacks run in order), on the step after the timed ones; the main
        # process's only
        last = total_steps(args)
        main = os.environ.get("RANK", "0") == "0"
        profiler = StepProfile(last - args.profile_steps + 1, last, device) if args.profile and main else None
        choices = auto_choices(cfg, args, device, dtype)
        groups = processes() // args.sequence_parallel  # each draws its own rows
        rows = token_rows(args.shape, batch_size * groups * total_steps(args), args.prompt_share)
        callbacks = [clock, ranks, *([profiler] if profiler else [])]
        if args.memory_cap_gib:
            cap_memory(args.memory_cap_gib, device)
        if args.random_layers:
            model = random_layers(args.shape, cfg, device, dtype)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        batches = clock.from_first_batch(collate)
        result = train(cfg, model=model, dataset=rows, collate_fn=batches, callbacks=callbacks)
    if not main:
        return None
    seconds = (clock.stop - clock.start) / args.steps
    measured = {
        "shape": args.shape,
        "row": row_name(args),
        "checkpointing": args.checkpointing,
        "torch_compile": args.compile,
        "quantization_type": "gptq" if args.gptq else args.quantize,
        "nvfp4_checkpoint": args.nvfp4_checkpoint,
        "processes": processes(),
        "sequence_parallel_size": args.sequence_parallel,
        "tokens_per_s": batch_size * groups * seq / seconds,
        "tokens_per_step": batch_size * groups * seq,
        "prompt_share": args.prompt_share,
        "peak_gib": largest(ranks.ranks, "peak_gib"),  # the largest rank's, with several processes
        "memory_cap_gib": args.memory_cap_gib,
        "peak_reserved_gib": largest(ranks.ranks, "peak_reserved_gib"),
        "setup_peak_gib": result.memory_gib.get("setup"),
        "setup_host_peak_gib": result.memory_gib.get("setup_host"),  # resident host memory, from the runner
        "offload_host_gib": offload_host_bytes() / 2**30,  # pinned host memory of the offloaded layer inputs
        "loaded_from": "random layers, made and packed one at a time"
        if args.random_layers
        else "disk (model.name_or_path)",
        "host_peak_gib": host_peak_gib(),  # resident host memory, the whole process
        "adapter": result.adapter,
        "steps": args.steps,
        "warmup": args.warmup,
        "host_step_ms": clock.host_ms,
        "gpu_step_ms": clock.gpu_ms,
        "gc_runs": clock.gc_runs,
        "ranks": ranks.ranks,  # each process's GPU step ms and peaks
        "autotuned": autotuned(),
        "first_loss": result.first_loss,
        "last_loss": result.last_loss,
        "auto_choices": choices,
        "notes": result.notes,
        "runner_notes": result.setup_notes,  # the run's first lines (tiling, attention, fusion, offloading)
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    if profiler is not None:
        write_profile(args, profiler, seconds)
        measured["profile"] = str(args.profile)
    return measured


def autotuned() -> dict[str, dict]:
    """The gated-MLP kernels' autotuner choices of this process, by launch key (a noisy search can pick a slow
    tile in one process and a fast one in the next)."""
    return {"|".join(map(str, key)): tuned for key, tuned in gated_mlp_launch._TUNED.items()}


def write_profile(args: argparse.Namespace, profiler: StepProfile, timed_seconds: float) -> dict:
    """The profiled step's summary, printed and written to ``args.profile``."""
    kernels = summarize(profiler.prof)
    result = {
        "shape": args.shape,
        "row": row_name(args),
        "checkpointing": args.checkpointing,
        "torch_compile": args.compile,
        "quantization_type": args.quantize,
        "profiled_step": profiler.step,  # the last of them
        "profiled_steps": profiler.step - profiler.first + 1,
        "wall_ms": profiler.wall_ms,
        "gpu_busy_ms": kernels["total_ms"],
        "timed_step_ms": timed_seconds * 1e3,  # the timed steps' mean, unprofiled
        **kernels,
        **device_gaps(profiler.prof),
        **compute_gaps(profiler.prof),
        **copy_overlap(profiler.prof),
        **op_attribution(profiler.prof),
        **host_summary(profiler.prof),
    }
    print_summary(result)
    args.profile.parent.mkdir(parents=True, exist_ok=True)
    args.profile.write_text(json.dumps(result, indent=2) + "\n")
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--checkpointing", default="off", choices=sorted(CHECKPOINTING))
    parser.add_argument("--compile", action="store_true", help="training.torch_compile: true")
    parser.add_argument(
        "--quantize",
        choices=["nf4", "int4", "fp8"],
        help="lora.quantize_base with this quantization_type (QLoRA)",
    )
    parser.add_argument("--dora", action="store_true", help="lora.use_dora: true (DoRA)")
    parser.add_argument(
        "--gptq",
        action="store_true",
        help="load a GPTQ copy of the shape's checkpoint (gptq_checkpoint.py: 4-bit, groups of 128, written beside "
        "it as MODEL_DIR-gptq once) that the runner reads itself",
    )
    parser.add_argument(
        "--nvfp4-checkpoint",
        action="store_true",
        help="the model is a ModelOpt NVFP4 checkpoint (nvfp4_checkpoint.py), its linears and expert banks kept "
        "4-bit as stored",
    )
    parser.add_argument(
        "--no-liger", dest="liger", action="store_false", help="training.liger_kernel: false (default: auto)"
    )
    parser.add_argument(
        "--prompt-share",
        type=float,
        default=0.0,
        help="the share of each row's first tokens that are not trained (a prompt; default 0: every token)",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        dest="graphs",
        action="store_false",
        help="training.cuda_graphs: false (default: auto)",
    )
    parser.add_argument(
        "--no-tiled-mlp",
        dest="tiled_mlp",
        action="store_false",
        help="training.tiled_mlp: false (default: auto; the long shapes' MLPs then run whole, to check that "
        "the tiles give the same loss)",
    )
    parser.add_argument(
        "--keep-attention-from",
        type=int,
        metavar="TOKENS",
        help="a probe: with --checkpointing offload, rows of at least this many tokens keep their attention "
        "results and q/k/v/o outputs in host memory (kept_attention.AUTO_TOKENS; the runner's: 32768)",
    )
    parser.add_argument(
        "--dora-link-flops",
        type=int,
        metavar="FLOPS",
        help="a probe: with --dora and checkpointing off, each layer sends the host a byte of DoRA outputs a row "
        f"for every FLOPS of its projections (dora_stash.FLOPS_PER_LINK_BYTE; the runner's: "
        f"{dora_stash.FLOPS_PER_LINK_BYTE})",
    )
    parser.add_argument(
        "--layer-offloading",
        action="store_true",
        help="training.layer_offloading: true (the layers' frozen weights stream from host memory; needs "
        "--checkpointing on or offload)",
    )
    parser.add_argument(
        "--memory-cap-gib",
        type=float,
        help="cap the device memory this process may allocate (torch.cuda.set_per_process_memory_fraction) "
        "for the whole run (CUDA only)",
    )
    parser.add_argument(
        "--random-layers",
        action="store_true",
        help="no checkpoint on disk: the shape's random weights are made one decoder layer at a time on the "
        "device and packed as they come (needs --quantize), for shapes whose dense checkpoint does not fit the "
        "disk or host memory",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        help="the shape's random-weight checkpoint directory: written when it holds none, reused when it holds "
        "the shape's (default: a temporary one for this run)",
    )
    parser.add_argument(
        "--sequence-parallel",
        type=int,
        default=1,
        metavar="N",
        help="training.sequence_parallel_size: each sequence split over N processes; run under torchrun with a "
        "multiple of N processes, the shape's checkpoint already in --model-dir (a one-process run writes it)",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps first; with 0 the clock starts as the first batch is made (its step then includes "
        "the kernels' first-call costs)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", type=Path, required=True, help="JSON file of the result")
    parser.add_argument(
        "--profile",
        type=Path,
        help="profile more steps after the timed ones and write their summary to this JSON file",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=1,
        help="how many steps --profile takes, back to back (the summary's ms are their sum; with 2 or more the "
        "device gaps show whether the GPU waits between steps)",
    )
    args = parser.parse_args(argv)
    if args.random_layers and not args.quantize:
        parser.error("--random-layers packs each layer as it is made: give --quantize too")
    if args.gptq and (args.quantize or args.random_layers or args.nvfp4_checkpoint):
        parser.error(
            "--gptq loads a GPTQ checkpoint, already quantized: leave out --quantize, --random-layers and "
            "--nvfp4-checkpoint"
        )
    if args.nvfp4_checkpoint and (args.quantize or args.random_layers):
        parser.error("--nvfp4-checkpoint is quantized as stored: leave out --quantize and --random-layers")
    return args


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    result = measure(args)
    if result is None:  # a process other than torchrun's main one: the main one writes the result
        return None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
