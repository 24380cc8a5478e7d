"""Where the runner's training step puts its peak memory, by category: weights (frozen base, LoRA factors,
buffers), optimizer state, gradients, saved activations (per decoder layer and by module, the loss and logits
apart) and the rest of the peak.

bench_runner's run (``loralei.train.run.train`` with its defaults on a benchmark shape: random weights, random
full-length rows) trains warm-up + 1 steps; a callback after the warm-up arms the probes for the last step:

- weights: bytes of the model's parameters (frozen base; trainable, i.e. the LoRA factors) and buffers;
- optimizer state: bytes of the optimizer's state tensors after the step;
- gradients: bytes of the trainable parameters' ``.grad`` when the optimizer steps (all of them alive then);
- saved activations, on CUDA: ``torch.cuda.memory_allocated`` read at every module's forward pre- and
  post-hook of the measured forward (global module hooks). What stays allocated between two readings goes to
  the innermost module running (``layer.self_attn.q_proj``, ``layer.mlp``, ``embed``, ``final norm``,
  ``lm_head/loss``, ...); a decoder layer's bytes are what its forward leaves allocated until the next module
  starts: its saved tensors and its output (the next layer's input). Module hooks rather than
  ``saved_tensors_hooks``, which torch's checkpointing installs itself: the readings hold with checkpointing
  off, on and offloaded. On the CPU (no allocator counter) with checkpointing off, a ``saved_tensors_hooks``
  census counts the storages the forward saves for the backward instead (each once; parameters, buffers and
  the batch left out); with checkpointing on or offload the CPU run measures no activations;
- peak (CUDA): the largest ``torch.cuda.max_memory_allocated`` of the step's phases (forward, backward,
  optimizer step; the counter is reset between them) and the largest reserved; "other at peak" is the peak
  less the categories above.

    python benchmarks/memory_step.py --shape llama3-8b --checkpointing off --out OUT/mem-8b-off.json
    python benchmarks/memory_step.py --shape llama3-8b --checkpointing on --out OUT/mem-8b-on.json
    python benchmarks/memory_step.py --shape llama3-8b --checkpointing offload --out OUT/mem-8b-offload.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import peak_snapshot
from bench_rows import SHAPES, build_model
from bench_runner import CHECKPOINTING, collate, run_config, token_rows
from bench_runner import parse_args as runner_parse_args

from loralei.train.compile import decoder_layers
from loralei.train.fast_path import resolve_liger, resolve_loss
from loralei.train.launch import LossModule
from loralei.train.run import train
from loralei.train.schema import validate_config

GIB, MIB = 2**30, 2**20
LOSS = "lm_head/loss"  # the output head, the model's top-level code and the loss function
LAYER = "layer"  # a decoder layer's own code (residual adds) and its output, the next layer's input
PHASES = ("forward", "backward", "optimizer step")
PEAK_FIELDS = (
    "allocated_bytes",
    "phase",
    "by_phase_bytes",
    "max_reserved_bytes",
    "slack_bytes",
    "allocated_at",
)
Owner = tuple[str, int | None]  # (category, decoder layer index or None)

# The categories of the peak, in table order, with their labels; on CUDA they sum to the peak.
CATEGORIES = {
    "weights_frozen_base": "weights: frozen base",
    "weights_lora": "weights: LoRA factors (trainable)",
    "weights_buffers": "weights: buffers",
    "optimizer_state": "optimizer state",
    "gradients": "gradients (LoRA, all alive at the optimizer step)",
    "step_start_other": "other allocated at step start (batch, workspaces)",
    "activations_layers": "saved activations: decoder layers",
    "activations_loss_logits": "saved activations: lm_head/loss (logits)",
    "activations_other": "saved activations: embed, final norm, rest",
    "other_at_peak": "other at peak (peak - the above; transients, lower bound)",
}
CUDA_METHOD = (
    "cuda memory_allocated deltas at module forward hooks (net bytes left allocated: a category that frees "
    "what another allocated can be negative)"
)
CENSUS_METHOD = (
    "saved_tensors_hooks census (CPU, checkpointing off): storages saved for the backward, each once, "
    "parameters, buffers and batch left out"
)
ACTIVATION_FIELDS = (
    "by_category_bytes",
    "per_layer_bytes",
    "layer_first_bytes",
    "layer_mean_bytes",
    "layers_total_bytes",
    "loss_logits_bytes",
    "forward_total_bytes",
)
NO_METHOD = (
    "not measured: the CPU has no allocator counter, and a saved_tensors_hooks census does not see what "
    "checkpointing keeps"
)


class DeviceMemory(Protocol):
    """The allocator counters the CUDA path reads (a test can stand in its own)."""

    def allocated(self) -> int: ...

    def peaks(self) -> tuple[int, int]: ...  # (max allocated, max reserved) since the last reset

    def reset_peaks(self) -> None: ...


class CudaMemory:
    """The CUDA caching allocator's counters on the current device."""

    def allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def peaks(self) -> tuple[int, int]:
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()

    def reset_peaks(self) -> None:
        torch.cuda.reset_peak_memory_stats()


def device_memory(device: torch.device) -> DeviceMemory | None:
    """The counters of ``device``; None on the CPU, which keeps none."""
    return CudaMemory() if device.type == "cuda" else None


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors' storages, each storage once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the frozen parameters, the trainable ones (the LoRA factors) and the buffers."""
    params = list(model.parameters())
    return {
        "weights_frozen_base": sum(p.nbytes for p in params if not p.requires_grad),
        "weights_lora": sum(p.nbytes for p in params if p.requires_grad),
        "weights_buffers": sum(b.nbytes for b in model.buffers()),
    }


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    tensors = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return storage_bytes(tensors)


def gradient_bytes(optimizer: torch.optim.Optimizer) -> int:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return sum(p.grad.nbytes for p in params if p.grad is not None)


def category(name: str, layer_prefix: str | None) -> str:
    """A module's category from its name: ``layer.<path in the layer>`` inside a decoder layer (a LoRA
    projection's own submodules count as the projection), ``final norm`` for a norm outside the layers, else
    the name."""
    if layer_prefix is not None and name.startswith(layer_prefix):
        inner = name[len(layer_prefix) :].split(".")[1:]  # the path after the layer's index
        kept = itertools.takewhile(lambda part: not part.startswith("lora_"), inner)
        return ".".join([LAYER, *kept])
    return "final norm" if name.rsplit(".", 1)[-1].endswith("norm") else name


def module_categories(model: nn.Module) -> tuple[dict[int, str], dict[int, int]]:
    """The category of each module of ``model`` and the index of each decoder layer, both by module id."""
    layers = decoder_layers(model) or nn.ModuleList()
    names = {id(m): name for name, m in model.named_modules()}
    prefix = names[id(layers)] + "." if id(layers) in names else None
    categories = {id(m): category(name, prefix) for name, m in model.named_modules()}
    categories[id(model)] = LOSS
    for module, label in ((model.get_input_embeddings(), "embed"), (model.get_output_embeddings(), LOSS)):
        if module is not None:
            categories[id(module)] = label
    return categories, {id(layer): i for i, layer in enumerate(layers)}


class ForwardTracker:
    """Follows the measured forward module by module and gives bytes to the innermost module running: the
    allocator's deltas between two hook readings (``memory``), or the storages saved for the backward
    (``census``, a ``saved_tensors_hooks`` census)."""

    def __init__(self, model: nn.Module, memory: DeviceMemory | None, census: bool) -> None:
        self.categories, self.layer_index = module_categories(model)
        self.model, self.memory = model, memory
        self.stack: list[Owner] = [(LOSS, None)]
        self.owner: Owner = (LOSS, None)
        self.by_category: dict[str, int] = {}
        self.per_layer = [0] * len(self.layer_index)
        self.last = 0
        self.seen: set[int] = set()  # census: storages counted, or not activations (weights, the batch)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t) if census else None
        self.census_on = False

    def begin(self, inputs: Iterable[Any]) -> None:
        """The measured forward starts (the loss module's pre-hook, with its arguments)."""
        batch = [t for x in inputs for t in (x.values() if isinstance(x, dict) else [x])]
        kept = [*self.model.parameters(), *self.model.buffers(), *batch]
        self.seen = {t.untyped_storage().data_ptr() for t in kept if isinstance(t, torch.Tensor)}
        self.last = self.memory.allocated() if self.memory is not None else 0
        if self.hooks is not None:
            self.hooks.__enter__()
            self.census_on = True

    def end(self) -> None:
        self._read()
        self.stop_census()

    def stop_census(self) -> None:
        """Takes the census hooks off (at the end of the forward, or when it raised)."""
        if self.census_on:
            self.hooks.__exit__(None, None, None)
            self.census_on = False

    def pre(self, module: nn.Module) -> None:
        self._read()
        parent_category, parent_layer = self.stack[-1]
        key = id(module)
        self.owner = (self.categories.get(key, parent_category), self.layer_index.get(key, parent_layer))
        self.stack.append(self.owner)

    def post(self, module: nn.Module) -> None:
        self._read()
        _, layer = self.stack.pop()
        # after a decoder layer, what happens until the next module starts (its output replacing its input)
        # is the layer's
        self.owner = (LAYER, layer) if id(module) in self.layer_index else self.stack[-1]

    def _read(self) -> None:
        if self.memory is not None:
            now = self.memory.allocated()
            self._add(now - self.last)
            self.last = now

    def _add(self, nbytes: int) -> None:
        name, layer = self.owner
        self.by_category[name] = self.by_category.get(name, 0) + nbytes
        if layer is not None:
            self.per_layer[layer] += nbytes

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self._add(storage.nbytes())
        return tensor


class StepProbe:
    """A runner callback: after step ``warmup`` it arms global module and optimizer hooks for the next step,
    which it measures in three phases (forward, backward, optimizer step); after that step it disarms them."""

    def __init__(
        self, model: nn.Module, warmup: int, memory: DeviceMemory | None, census: bool, snapshot: bool = False
    ) -> None:
        self.model, self.warmup, self.memory, self.census = model, warmup, memory, census
        self.snapshot = snapshot and memory is not None  # the allocator's history of the step (CUDA)
        self.events: list[dict[str, Any]] = []
        self.phase = "idle"
        self.handles: list[RemovableHandle] = []
        self.weights: dict[str, int] = {}
        self.tracker: ForwardTracker | None = None
        self.engine: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.peaks: dict[str, tuple[int, int]] = {}
        self.allocated: dict[str, int] = {}
        self.gradients = self.optimizer_state = 0

    def __call__(self, state: Any) -> None:
        if state.global_step == self.warmup:
            self.arm()
        elif state.global_step == self.warmup + 1:
            self.finish()

    def arm(self) -> None:
        self.weights = weight_bytes(self.model)  # the runner has injected and fused LoRA by now
        self.tracker = ForwardTracker(self.model, self.memory, self.census)
        self.handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post),
            register_optimizer_step_pre_hook(self._before_optimizer),
        ]
        if self.memory is not None:
            self.memory.reset_peaks()
        if self.snapshot:
            peak_snapshot.record()
        self.phase = "armed"

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.tracker is not None:
            self.tracker.stop_census()

    def finish(self) -> None:
        if self.phase != "optimizer step":
            raise RuntimeError(f"the measured step ended in phase {self.phase!r}, not at the optimizer step")
        self.optimizer_state = optimizer_state_bytes(self.optimizer)
        self._end_phase("optimizer step")
        if self.snapshot:
            self.events = peak_snapshot.stop()
        self.close()
        self.phase = "done"

    def _end_phase(self, name: str) -> None:
        if self.memory is not None:
            self.peaks[name] = self.memory.peaks()
            self.allocated[f"end of {name}"] = self.memory.allocated()
            self.memory.reset_peaks()

    def _pre(self, module: nn.Module, args: tuple) -> None:
        if self.phase == "armed" and isinstance(module, LossModule):
            self.engine, self.phase = module, "forward"
            if self.memory is not None:
                self.allocated["forward start"] = self.memory.allocated()  # the batch is on the device
            self.tracker.begin(args)
        elif self.phase == "forward":
            self.tracker.pre(module)

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.phase != "forward":
            return
        if module is not self.engine:
            self.tracker.post(module)
            return
        self.tracker.end()
        self._end_phase("forward")
        self.phase = "backward"

    def _before_optimizer(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.phase == "backward":
            self.optimizer, self.gradients = optimizer, gradient_bytes(optimizer)
            self._end_phase("backward")
            self.phase = "optimizer step"


def activations(probe: StepProbe, method: str) -> dict[str, Any]:
    """The saved-activation fields: by module category, per decoder layer, the loss and logits."""
    if method == NO_METHOD:
        return {"method": method, **dict.fromkeys(ACTIVATION_FIELDS)}
    tracker = probe.tracker
    per_layer = tracker.per_layer
    return {
        "method": method,
        "by_category_bytes": tracker.by_category,
        "per_layer_bytes": per_layer,
        "layer_first_bytes": per_layer[0] if per_layer else None,
        "layer_mean_bytes": sum(per_layer) / len(per_layer) if per_layer else None,
        "layers_total_bytes": sum(per_layer),
        "loss_logits_bytes": tracker.by_category.get(LOSS, 0),
        "forward_total_bytes": sum(tracker.by_category.values()),
    }


def peak(probe: StepProbe) -> dict[str, Any]:
    """The step's peak allocated memory, the phase it fell in, each phase's peak, the reserved maximum."""
    if not probe.peaks:
        return dict.fromkeys(PEAK_FIELDS)
    by_phase = {name: probe.peaks[name][0] for name in PHASES}
    top = max(by_phase, key=by_phase.__getitem__)
    reserved = max(r for _, r in probe.peaks.values())
    return {
        "allocated_bytes": by_phase[top],
        "phase": top,
        "by_phase_bytes": by_phase,  # "backward" includes gradient clipping
        "max_reserved_bytes": reserved,
        "slack_bytes": reserved - by_phase[top],  # allocator slack: reserved maximum - peak allocated
        "allocated_at": probe.allocated,  # bytes allocated at the forward's start and each phase's end
    }


def categories(probe: StepProbe, saved: dict[str, Any], top: dict[str, Any]) -> dict[str, int | None]:
    """The peak's categories (CATEGORIES); on CUDA ``other_at_peak`` makes them sum to the peak."""
    parts: dict[str, int | None] = {**probe.weights, "optimizer_state": probe.optimizer_state}
    parts["gradients"] = probe.gradients
    measured = probe.memory is not None
    held = sum(probe.weights.values()) + probe.optimizer_state
    parts["step_start_other"] = probe.allocated["forward start"] - held if measured else None
    layers, loss = saved["layers_total_bytes"], saved["loss_logits_bytes"]
    parts["activations_layers"], parts["activations_loss_logits"] = layers, loss
    parts["activations_other"] = saved["forward_total_bytes"] - layers - loss if layers is not None else None
    known = sum(v for v in parts.values() if v is not None)
    parts["other_at_peak"] = top["allocated_bytes"] - known if measured else None
    return parts


NOTES = [
    "gradients and saved activations are counted in full, though the backward frees activations as gradients "
    "appear: other_at_peak is a lower bound on the transient buffers live at the peak (and can be negative)",
    "a decoder layer's bytes include its output, the next layer's input; with offload the input goes to host "
    "memory, so a layer keeps about nothing",
    "the census (CPU) gives a saved tensor to the first module that saved it; the CUDA readings give it to "
    "the module that allocated it, so the layer split differs by about one hidden state, the totals do not",
    "max_reserved_bytes is the reserved maximum over the step, not sampled at the moment of the allocated "
    "peak",
]


def activation_method(memory: DeviceMemory | None, checkpointing: str) -> str:
    if memory is not None:
        return CUDA_METHOD
    return CENSUS_METHOD if checkpointing == "off" else NO_METHOD


def run_probe(
    args: argparse.Namespace, device: torch.device, memory: DeviceMemory | None, census: bool
) -> tuple[StepProbe, list[str]]:
    """Trains warm-up + 1 steps through the runner with a StepProbe; returns it and the auto choices."""
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    batch_size = SHAPES[args.shape][2]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = validate_config(run_config(runner_args(args), Path(tmp) / "run"))
        model = build_model(args.shape, device, dtype)
        resolved, choices = resolve_liger(cfg, device)
        choices += resolve_loss(resolved, model, device)[1]
        probe = StepProbe(model, args.warmup, memory, census, args.snapshot)
        try:
            rows = token_rows(args.shape, batch_size * (args.warmup + 1))
            train(cfg, model=model, dataset=rows, collate_fn=collate, callbacks=[probe])
        finally:
            probe.close()
    return probe, choices


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    memory = device_memory(device)
    method = activation_method(memory, args.checkpointing)
    probe, choices = run_probe(args, device, memory, method == CENSUS_METHOD)
    saved, top = activations(probe, method), peak(probe)
    found = {
        "shape": args.shape,
        "row": "loralei-runner (defaults)",
        "checkpointing": args.checkpointing,
        "dtype": args.dtype,
        "warmup": args.warmup,
        "categories": categories(probe, saved, top),
        "saved_activations": saved,
        "peak": top,
        "weights": probe.weights,
        "auto_choices": choices,
        "notes": NOTES,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    if probe.events:
        batch, length = SHAPES[args.shape][2:]
        step_peak, blocks = peak_snapshot.alive_at_peak(probe.events)
        found["alive_at_peak"] = {
            "bytes_allocated_in_step": step_peak,
            "by_site": peak_snapshot.grouped(blocks, batch * length),
        }
    return found


def _size(nbytes: float | None, peak_bytes: int | None) -> str:
    if nbytes is None:
        return "| n/a | n/a | n/a |"
    share = f"{100 * nbytes / peak_bytes:.1f}%" if peak_bytes else "n/a"
    return f"| {nbytes / GIB:.3f} | {nbytes / MIB:.2f} | {share} |"


def table(result: dict[str, Any]) -> str:
    """The result as markdown: the saved activations by module, then the peak's categories (last, so that the
    end of the output holds them)."""
    top, saved = result["peak"], result["saved_activations"]
    total = top["allocated_bytes"]
    lines = [f"saved activations: {saved['method']}", *activation_lines(saved, top), ""]
    lines += [
        f"{result['shape']}, checkpointing {result['checkpointing']} ({result['device']})",
        "",
        "| category | GiB | MiB | share of peak |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {label} {_size(result['categories'][key], total)}" for key, label in CATEGORIES.items()]
    return "\n".join(
        [
            *lines,
            f"| **peak allocated** ({top['phase'] or 'not measured'}) {_size(total, total)}",
            f"| max reserved {_size(top['max_reserved_bytes'], total)}",
            f"| allocator slack (reserved - peak allocated) {_size(top['slack_bytes'], total)}",
        ]
    )


def activation_lines(saved: dict[str, Any], top: dict[str, Any]) -> list[str]:
    """The saved activations by module (summed over the layers), per layer, the loss and logits."""
    if saved["by_category_bytes"] is None:
        return []
    lines = ["", "| saved by (summed over layers) | MiB |", "| --- | ---: |"]
    lines += [f"| {name} | {b / MIB:.2f} |" for name, b in saved["by_category_bytes"].items()]
    count, loss = len(saved["per_layer_bytes"]), saved["loss_logits_bytes"]
    lines += [
        "",
        f"per decoder layer: first {saved['layer_first_bytes'] / MIB:.2f} MiB, mean "
        f"{saved['layer_mean_bytes'] / MIB:.2f} MiB, {count} layers "
        f"{saved['layers_total_bytes'] / GIB:.3f} GiB; loss/logits {loss / MIB:.2f} MiB",
    ]
    if top["by_phase_bytes"] is not None:
        lines.append(f"peak during backward: {top['by_phase_bytes']['backward'] / GIB:.3f} GiB")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--checkpointing", default="off", choices=sorted(CHECKPOINTING))
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the measured one (>= 1)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", type=Path, required=True, help="JSON file of the result")
    parser.add_argument(
        "--snapshot",
        action="store_true",
        help="record the allocator's history of the measured step (CUDA): what is alive at its peak, by site",
    )
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the optimizer state exists after a step")
    return args


def runner_args(args: argparse.Namespace) -> argparse.Namespace:
    """bench_runner's arguments for the same run, one measured step (its defaults for any other option), without
    CUDA graphs: a replayed graph runs no module hooks, so the probe would see nothing of the measured step."""
    argv = [
        "--shape",
        args.shape,
        "--checkpointing",
        args.checkpointing,
        "--dtype",
        args.dtype,
        "--no-cuda-graphs",
    ]
    return runner_parse_args([*argv, "--warmup", str(args.warmup), "--steps", "1", "--out", str(args.out)])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return result


if __name__ == "__main__":
    main()
