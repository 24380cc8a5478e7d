"""Reading a base one decoder layer at a time, so that host memory never holds the dense model twice and the
device never holds it at all.

The runner builds the model without storage (its parameters on the meta device, its buffers, e.g. rotary
tables, computed as usual), reads the weights outside the decoder layers, then each decoder layer's in turn from
the checkpoint's safetensors files (copied out of them, so that no file stays mapped). With ``lora.quantize_base``
it packs the weights the adapter targets (:func:`loralei.modules.quantized.quantize_weight`, on the packing
device) before it reads the next layer: host memory holds one dense layer at a time besides the packed ones, and
the device one dense weight being packed. The packed layers stay on the packing device, or in host memory when
the layers stream from there (``training.layer_offloading``), so that the device never holds them all either;
injection then finds the bases packed and keeps them as they are. A dense base whose layers stream is read the
same way without packing, and each layer then moves to pinned memory in turn (:mod:`.layer_offload`): host memory
holds the dense model once, not beside a mapped copy of its files.

A checkpoint reads this way when it is a directory of safetensors files whose tensor names are the model's own
(every parameter found, nothing else but buffers). Transformers renames or converts some checkpoints while
loading them (e.g. one tensor per expert into packed expert banks); those load whole through Transformers, and
the run says so.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from ..config import LoRAConfig
from ..inject import find_targets
from ..modules.quantized import check_quantizable, quantize_weight
from ..modules.quantized.checkpoint_checks import TensorMeta
from . import heap
from .compile import decoder_layers

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# safetensors' dtype names, for the dtypes a checkpoint's tensors are checked against before they are read
_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}


class TensorSource(Protocol):
    """Where a model's tensors come from, by parameter name."""

    def names(self) -> set[str]:
        """Every tensor name the source holds."""
        ...

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors, read now (on the CPU or any device)."""
        ...


class SafetensorsDirectory:
    """A checkpoint directory's safetensors files (one, or several named by ``model.safetensors.index.json``)."""

    def __init__(self, directory: Path) -> None:
        self.files = _tensor_files(directory)

    def names(self) -> set[str]:
        return set(self.files)

    def _by_file(self, names: Iterable[str]) -> dict[Path, list[str]]:
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        return by_file

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        out = {}
        for path, group in self._by_file(names).items():
            with safe_open(str(path), framework="pt") as handle:  # copies: nothing keeps the file mapped
                out |= {name: handle.get_tensor(name).clone() for name in group}
        return out

    def metadata(self, names: Iterable[str]) -> dict[str, TensorMeta]:
        """The shape and dtype of each named tensor, from the files' headers (no data is read)."""
        from safetensors import safe_open

        out = {}
        for path, group in self._by_file(names).items():
            with safe_open(str(path), framework="pt") as handle:
                for name in group:
                    meta = handle.get_slice(name)
                    out[name] = TensorMeta(tuple(meta.get_shape()), _DTYPES[meta.get_dtype()])
        return out


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it; empty when the directory has no safetensors checkpoint."""
    if (index := directory / INDEX).is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: directory / file for name, file in weight_map.items()}
    if (single := directory / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), single)
    return {}


def empty_model(config, dtype: torch.dtype, attn_implementation: str, trust_remote_code: bool) -> nn.Module:
    """The causal LM of ``config`` with its parameters on the meta device (no memory), tied where the config ties
    them, and its buffers made as usual, in eval mode as Transformers loads models."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
        )
    model.tie_weights()  # a tied head is the embedding (a checkpoint holds it once), as Transformers' loader ties it
    return model.eval()


def mismatch(model: nn.Module, source: TensorSource) -> str | None:
    """Why ``source`` cannot fill ``model`` name for name, or None: a parameter it lacks, or a tensor the model
    does not have (a checkpoint Transformers would rename or convert); no decoder-layer list to walk; or modules
    Transformers would keep in float32."""
    if decoder_layers(model) is None:
        return "the model has no decoder-layer list"
    if _kept_in_float32(model):
        return "the model keeps some modules in float32, as Transformers' loader does"
    held = source.names()
    if missing := [name for name, _ in model.named_parameters() if name not in held]:
        return f"the checkpoint has no tensor named {missing[0]!r} ({len(missing)} parameters missing)"
    known = set(model.state_dict())
    if extra := sorted(held - known):
        return f"the checkpoint's {extra[0]!r} is not a tensor of the model (Transformers converts it)"
    return None


def _kept_in_float32(model: nn.Module) -> bool:
    """Whether Transformers would load some of the model's modules in float32 whatever the dtype asked (its
    ``_keep_in_fp32_modules_strict``; ``_keep_in_fp32_modules`` for float16), which building it does not do."""
    dtype = next(model.parameters()).dtype
    strict = getattr(model, "_keep_in_fp32_modules_strict", None)
    loose = getattr(model, "_keep_in_fp32_modules", None)
    return bool(strict and dtype in (torch.float16, torch.bfloat16)) or bool(loose and dtype == torch.float16)


def _fill(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Puts each named tensor in the model, as a parameter (of the meta one's dtype and gradient flag) or a
    buffer."""
    for name, tensor in tensors.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if leaf in module._parameters:
            old = module._parameters[leaf]
            module._parameters[leaf] = nn.Parameter(tensor.to(old.dtype), requires_grad=old.requires_grad)
        else:
            module._buffers[leaf] = tensor.to(module._buffers[leaf].dtype)


def moved(packed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A packed weight (a tensor subclass that lists its inner tensors: codes, scales) with those inner tensors on
    ``device``, the same kind of wrapper around them."""
    names, context = packed.__tensor_flatten__()
    inner = {name: getattr(packed, name).to(device) for name in names}
    return type(packed).__tensor_unflatten__(inner, context, packed.shape, packed.stride())


def _pack(model: nn.Module, targets: Iterable[str], lora: LoRAConfig, keep: torch.device) -> None:
    """Packs each target linear's weight (on the packing device) and keeps the result on ``keep``."""
    for name in targets:
        linear = model.get_submodule(name)
        packed = quantize_weight(linear.weight, lora).data
        linear.weight = nn.Parameter(moved(packed, keep), requires_grad=False)


def load_by_layers(
    model: nn.Module,
    source: TensorSource,
    lora: LoRAConfig,
    keep: torch.device,
) -> None:
    """Fills ``model`` (built by :func:`empty_model`) from ``source``: first what lies outside the decoder
    layers, then each layer in turn, its LoRA targets packed as ``lora`` says and kept on ``keep`` before the
    next layer is read. Tied parameters are tied again at the end.

    Raises:
        InjectionError: ``lora``'s targets are wrong, or one cannot be packed (``check_quantizable``), before
            anything is read.
    """
    names = source.names()
    layers = decoder_layers(model)
    names_of = {id(m): name for name, m in model.named_modules()}
    prefixes = [f"{names_of[id(layer)]}." for layer in layers]
    targets = find_targets(model, lora) if lora.quantize_base else []
    # every refusal before the first read; a source reads to the CPU, where packing runs unless told otherwise
    checked = lora if lora.quantization_device else lora.model_copy(update={"quantization_device": "cpu"})
    for name in targets:
        check_quantizable(name, model.get_submodule(name), checked)
    outside = [n for n in names if not n.startswith(tuple(prefixes))]
    _fill(model, source.read(outside))
    what = "reading and packing layers" if lora.quantize_base else "reading layers"
    for prefix in tqdm(prefixes, desc=what, unit="layer"):
        _fill(model, source.read([n for n in names if n.startswith(prefix)]))
        _pack(model, [t for t in targets if t.startswith(prefix)], lora, keep)
        heap.trim()  # the dense weights just packed: their pages go back, not only to the heap
    model.tie_weights()
