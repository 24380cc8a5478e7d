"""LoRAConfig: what to adapt and how. Validated once, here, at construction."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .errors import ConfigError
from .field_errors import error_lines
from .renames import LORA_SECTION

ALL_LINEAR = "all-linear"
InitKind = bool | str  # True, False, "gaussian", "pissa", "pissa_niter_<K>", "olora" (_valid_init)
# PiSSA / OLoRA (loralei.modules.principal_init); kept here so a config is read without importing torch
PRINCIPAL_INIT = re.compile(r"pissa(_niter_[1-9][0-9]*)?|olora")
QuantizationType = Literal["nf4", "int4", "fp8"]
NF4Kernel = Literal["dequantize", "triton"]
FP8Kernel = Literal["auto", "emulated"]
QATWeight = Literal["int4", "nf4", "fp8", "nvfp4"]
# Per ``qat.weight``: the group sizes it takes (``None``: any even size >= 2) and its default (``None``: per row).
_QAT_GROUPS: dict[str, tuple[tuple[int, ...] | None, int | None]] = {
    "int4": ((32, 64, 128, 256), 128),
    "nf4": (None, 64),
    "fp8": ((), None),
    "nvfp4": ((16,), 16),
}
# Values users ask for that loralei does not offer, with the reason and what to use instead.
_NOT_OFFERED: dict[tuple[str, Any], str] = {
    ("nf4_kernel", "tilelang"): (
        "tilelang is not used: loralei's fused NF4 matmul is written in Triton, which ships with PyTorch and "
        "also runs on the CPU in interpreter mode for tests; use 'triton' or 'dequantize'"
    ),
}
# What ``torch.device`` accepts, checked without importing torch (a config is read before torch is loaded):
# a device type, then an optional index.
_DEVICE = re.compile(r"(cpu|cuda|xpu|mps|hpu|mtia|xla|meta|privateuseone)(:\d+)?")
# Fields that only mean something with ``quantize_base=True``, and the quantization type each belongs to.
_QUANT_FIELDS: dict[str, str | None] = {
    "quantization_type": None,
    "nf4_block_size": "nf4",
    "nf4_scaler_block_size": "nf4",
    "nf4_kernel": "nf4",
    "nf4_autotune": "nf4",
    "int4_group_size": "int4",
    "fp8_kernel": "fp8",
    "fp8_fast_accum": "fp8",
    "quantization_device": None,
}


class QATConfig(BaseModel):
    """Quantization-aware training: the export format the forward simulates (``LoRAConfig.qat``).

    Attributes:
        weight: ``"int4"`` (asymmetric 4-bit, a scale and a zero point per ``group_size`` inputs, TorchAO's
            tinygemm recipe), ``"nf4"`` (QLoRA's NormalFloat, TorchAO's ``NF4Tensor``: a scale per ``group_size``
            elements, the scales double-quantized in groups of ``scaler_block_size``), ``"fp8"`` (e4m3 with one
            FP32 scale per output row) or ``"nvfp4"`` (e2m1 with an e4m3 scale per 16 inputs and an FP32 global
            scale, as NVIDIA ModelOpt exports it).
        group_size: inputs per scale: int4 32, 64, 128 or 256 (default 128); nf4 any even size (default 64);
            nvfp4 16 (its only size); fp8 none (one scale per row).
        scaler_block_size: nf4 only: block scales per double-quantization group (default 256; a weight's element
            count must divide by ``group_size * scaler_block_size``).
        start_step: the runner trains the first ``start_step`` optimizer steps as plain LoRA (the dense merged
            weight), then fake-quantizes every forward (:mod:`loralei.train.qat_start`); 0: from the first step.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    weight: QATWeight = Field(examples=["int4"])
    group_size: int | None = Field(None, examples=[64])
    scaler_block_size: int | None = Field(None, examples=[256])
    start_step: int = Field(0, ge=0, examples=[300])

    @model_validator(mode="after")
    def _group_fits_format(self) -> QATConfig:
        allowed, _ = _QAT_GROUPS[self.weight]
        size = self.group_size
        if size is not None and allowed == ():
            raise ValueError(
                f"group_size={size} does not apply to weight={self.weight!r} (one scale per output row); remove it"
            )
        if size is not None and allowed is None and (size < 2 or size % 2):
            raise ValueError(f"group_size={size}: {self.weight} takes an even group size >= 2 (default 64)")
        if size is not None and allowed and size not in allowed:
            sizes = (
                ", ".join(map(str, allowed[:-1])) + (" or " if len(allowed) > 1 else "") + str(allowed[-1])
            )
            raise ValueError(f"group_size={size}: {self.weight} takes {sizes}; choose one of those")
        if self.scaler_block_size is not None and self.weight != "nf4":
            raise ValueError(f"scaler_block_size applies to weight='nf4', not {self.weight!r}; remove it")
        if self.scaler_block_size is not None and self.scaler_block_size < 1:
            raise ValueError(f"scaler_block_size={self.scaler_block_size} must be >= 1 (default 256)")
        return self

    @property
    def group(self) -> int | None:
        """The group size in effect: the one given, or the format's default (``None``: one scale per row)."""
        return self.group_size if self.group_size is not None else _QAT_GROUPS[self.weight][1]

    @property
    def scaler_block(self) -> int:
        """NF4's double-quantization group in effect (256 unless given)."""
        return self.scaler_block_size if self.scaler_block_size is not None else 256


class LoRAConfig(BaseModel):
    """Settings of a LoRA adapter.

    Attributes:
        r: rank of the update (A: r×in, B: out×r).
        lora_alpha: scale numerator; the update is multiplied by ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA).
        lora_dropout: dropout probability on the LoRA branch input, in [0, 1).
        target_modules: module-name suffixes (``["q_proj", "v_proj"]``), one regex string that must match the
            whole module name, or ``"all-linear"`` (every ``nn.Linear`` but the output head). Defaults to
            ``"all-linear"``, or to no modules when ``target_parameters`` is given.
        target_parameters: 3-D expert parameters of MoE experts modules, as name suffixes
            (``["experts.gate_up_proj", "experts.down_proj"]``); each gets per-expert factors A (E×r×in) and
            B (E×out×r). Not with ``lora_dropout > 0``.
        exclude_modules: same forms as ``target_modules``; matches are never adapted.
        layers_to_transform: only adapt modules inside these decoder-layer indices.
        layers_pattern: name of the layer list in module paths (``"layers"``, ``"h"``); ``None`` accepts any
            ``.<name>.<index>.`` segment.
        use_rslora: scale by ``lora_alpha / sqrt(r)`` (rank-stabilised LoRA) instead of ``lora_alpha / r``.
        use_dora: DoRA (weight-decomposed LoRA, PEFT's ``use_dora``): each output row of ``W + s·B·A`` is
            rescaled to a trainable magnitude, ``W' = m ⊙ (W + s·B·A) / ‖W + s·B·A‖_row``. Linear modules only
            (not with ``target_parameters``).
        init_lora_weights: ``True``: Kaiming-uniform A, zero B (the update starts at zero); ``"gaussian"``:
            normal A with std ``1/r``, zero B; ``False``: random A and B (a non-zero update, for tests);
            ``"pissa"`` / ``"pissa_niter_K"`` / ``"olora"``: A and B start as the base weight's r principal
            components (SVD, K-iteration randomized SVD, QR) and the base keeps the residual (packed, with
            ``quantize_base``); linear modules only, on bases loaded dense.
        lora_fp32_gradients: keep A, B and their gradients in FP32 whatever the model dtype.
        quantize_base: store each adapted projection's frozen weight quantized (QLoRA); compute stays in the
            weight's dtype.
        quantization_type: ``"nf4"`` (TorchAO ``NF4Tensor``, double-quantized block scales), ``"int4"``
            (TorchAO tile-packed int4 with tinygemm; CUDA, compute capability >= 8.0, bfloat16) or ``"fp8"``
            (``float8_e4m3fn`` codes with one FP32 scale per output row, held as a TorchAO ``Float8Tensor``).
        nf4_block_size: NF4 elements per block scale (a weight's element count must divide by
            ``nf4_block_size * nf4_scaler_block_size``).
        nf4_scaler_block_size: NF4 block scales per double-quantization group.
        nf4_kernel: ``"dequantize"``: dequantize into a reused per-shape buffer and run the dense GEMMs;
            ``"triton"``: loralei's fused NF4 dequant-matmul for the forward and input-gradient products.
        nf4_autotune: search the Triton NF4 kernel's tiles once per GPU and shape (cached on disk); ``False``
            uses one conservative tile.
        int4_group_size: int4 inputs per scale/zero-point group (32, 64, 128 or 256).
        fp8_kernel: ``"auto"``: FP8 GEMMs (``torch._scaled_mm``, activations rounded to e4m3 per token), which
            need a CUDA GPU of compute capability >= 8.9 and weight dimensions that are multiples of 16
            (anything else is refused at injection); ``"emulated"``: dequantize into a reused per-shape buffer
            and run the dense GEMMs, on any device (for checking numerics). The 128x128 block-scaled bases of a
            fine-grained FP8 checkpoint (kept as loaded, with or without ``quantize_base``) run block-scaled FP8
            GEMMs under ``"auto"`` on compute capability 9.x and the dequantize backend elsewhere.
        fp8_fast_accum: the per-row FP8 GEMMs' forward product ``X Wᵀ`` runs with fast accumulation
            (``use_fast_accum``: the tensor cores' partial sums are not periodically promoted to FP32), as TorchAO's
            Float8 training recipe runs its output GEMM; the input gradient ``dY W`` accumulates in FP32 either way.
            ``False``: FP32 accumulation for both.
        quantization_device: quantize on this device (e.g. ``"cuda"``) and keep the packed weight there, for
            a model loaded on the CPU; ``None`` quantizes where the weight lives.
        qat: quantization-aware training (:class:`QATConfig`): each adapted projection's forward uses its merged
            weight fake-quantized to the export format, with straight-through gradients to A and B. Needs a
            dense (bf16/fp16/fp32) base: not with ``quantize_base`` or a base loaded quantized; not with
            ``lora_dropout > 0`` or ``target_parameters``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    r: int = Field(8, examples=[16])
    lora_alpha: float = Field(16.0, examples=[32])
    lora_dropout: float = Field(0.0, examples=[0.05])
    target_modules: list[str] | str | None = Field(None, examples=[["q_proj", "v_proj"]])
    target_parameters: list[str] | None = Field(
        None, examples=[["experts.gate_up_proj", "experts.down_proj"]]
    )
    exclude_modules: list[str] | str | None = Field(None, examples=[["o_proj"]])
    layers_to_transform: list[int] | None = Field(None, examples=[[0, 1, 2]])
    layers_pattern: str | None = Field(None, examples=["layers"])
    use_rslora: bool = False
    use_dora: bool = False
    init_lora_weights: InitKind = True
    lora_fp32_gradients: bool = False
    quantize_base: bool = False
    quantization_type: QuantizationType = "nf4"
    nf4_block_size: int = 64
    nf4_scaler_block_size: int = 256
    nf4_kernel: NF4Kernel = "dequantize"
    nf4_autotune: bool = True
    int4_group_size: Literal[32, 64, 128, 256] = 128
    fp8_kernel: FP8Kernel = "auto"
    fp8_fast_accum: bool = True
    quantization_device: str | None = Field(None, examples=["cuda"])
    qat: QATConfig | None = Field(None, examples=[{"weight": "int4", "group_size": 64}])

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            lines = error_lines(err.errors(), type(self), data, section=LORA_SECTION)
            raise ConfigError("invalid LoRAConfig:\n" + "\n".join(lines), err.errors()) from None

    @model_validator(mode="before")
    @classmethod
    def _default_targets(cls, data: Any) -> Any:
        """``target_modules`` defaults to all-linear, unless expert parameters alone are targeted."""
        if isinstance(data, dict) and "target_modules" not in data and not data.get("target_parameters"):
            return {**data, "target_modules": ALL_LINEAR}
        return data

    @field_validator("r")
    @classmethod
    def _positive_rank(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("r must be a positive integer, e.g. 8 or 16")
        return v

    @field_validator("lora_alpha")
    @classmethod
    def _positive_alpha(cls, v: float) -> float:
        if v <= 0:
            raise ValueError("lora_alpha must be > 0; a common choice is 2*r")
        return v

    @field_validator("init_lora_weights")
    @classmethod
    def _valid_init(cls, v: bool | str) -> bool | str:
        if isinstance(v, str) and v != "gaussian" and not PRINCIPAL_INIT.fullmatch(v):
            raise ValueError(
                'must be true, false, "gaussian", "pissa", "pissa_niter_<K>" (e.g. "pissa_niter_4") or "olora"'
            )
        return v

    @field_validator("lora_dropout")
    @classmethod
    def _dropout_range(cls, v: float) -> float:
        if not 0.0 <= v < 1.0:
            raise ValueError("lora_dropout must be in [0, 1); use 0.0 to disable dropout")
        return v

    @field_validator("target_modules", "exclude_modules")
    @classmethod
    def _valid_patterns(cls, v: list[str] | str | None) -> list[str] | str | None:
        if isinstance(v, list) and (not v or any(not s for s in v)):
            raise ValueError('must be a non-empty list of module-name suffixes, e.g. ["q_proj", "v_proj"]')
        if isinstance(v, str) and v != ALL_LINEAR:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(
                    f'is not a valid regular expression ({exc}); or use a list or "all-linear"'
                ) from None
        return v

    @field_validator("target_parameters")
    @classmethod
    def _valid_parameter_names(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or any(not s or s.startswith(".") or s.endswith(".") for s in v)):
            raise ValueError(
                'must be a non-empty list of parameter-name suffixes, e.g. ["experts.gate_up_proj", '
                '"experts.down_proj"]'
            )
        return v

    @model_validator(mode="after")
    def _something_targeted(self) -> LoRAConfig:
        if self.target_modules is None and not self.target_parameters:
            raise ValueError(
                "target_modules and target_parameters are both empty: nothing would be adapted; set "
                'target_modules (e.g. "all-linear") or target_parameters'
            )
        if self.target_parameters and PRINCIPAL_INIT.fullmatch(str(self.init_lora_weights)):
            raise ValueError(
                f"init_lora_weights={self.init_lora_weights!r} cannot apply to target_parameters (expert banks): "
                "PiSSA/OLoRA decompose linear modules only; use init_lora_weights: true, or adapt only "
                "target_modules"
            )
        if self.target_parameters and self.lora_dropout > 0:
            raise ValueError(
                f"lora_dropout={self.lora_dropout} cannot apply to target_parameters (expert banks): the routed "
                "experts share one input per token; set lora_dropout: 0.0, or adapt only target_modules"
            )
        if self.use_dora and self.target_parameters:
            raise ValueError(
                f"use_dora=True cannot apply to target_parameters {self.target_parameters} (expert banks have no "
                "DoRA magnitude in loralei or PEFT); set use_dora: false, or adapt only target_modules"
            )
        if (
            self.use_dora
            and isinstance(self.init_lora_weights, str)
            and PRINCIPAL_INIT.fullmatch(self.init_lora_weights)
        ):
            raise ValueError(
                f"use_dora=True with init_lora_weights={self.init_lora_weights!r}: a PiSSA/OLoRA adapter is exported "
                "as a rank-2r LoRA on the original base, which DoRA's row norms of W + s·B·A do not survive; "
                "choose one of the two (init_lora_weights: true with DoRA)"
            )
        return self

    @field_validator("nf4_block_size", "nf4_scaler_block_size")
    @classmethod
    def _even_block(cls, v: int) -> int:
        if v < 2 or v % 2:
            raise ValueError("must be an even integer >= 2 (two 4-bit codes share a byte); default 64 / 256")
        return v

    @field_validator("nf4_kernel", mode="before")
    @classmethod
    def _not_offered(cls, v: Any, info: ValidationInfo) -> Any:
        reason = _NOT_OFFERED.get((info.field_name, v)) if isinstance(v, str) else None
        if reason:
            raise ValueError(reason)
        return v

    @field_validator("quantization_device")
    @classmethod
    def _valid_device(cls, v: str | None) -> str | None:
        if v is not None and not _DEVICE.fullmatch(v):
            raise ValueError('is not a torch device; use e.g. "cuda", "cuda:1" or "cpu"')
        return v

    @model_validator(mode="after")
    def _quantization_settings_apply(self) -> LoRAConfig:
        """A quantization setting that would be ignored is an error, not a silent no-op."""
        defaults = type(self).model_fields
        for name, kind in _QUANT_FIELDS.items():
            if getattr(self, name) == defaults[name].default:
                continue
            if not self.quantize_base:
                raise ValueError(f"{name}={getattr(self, name)!r} has no effect without quantize_base=True")
            if kind is not None and kind != self.quantization_type:
                raise ValueError(
                    f"{name} applies to quantization_type={kind!r}, not {self.quantization_type!r}; remove it"
                )
        return self

    @model_validator(mode="after")
    def _qat_applies(self) -> LoRAConfig:
        """QAT merges a dense base with the update in every forward: refuse what would break that."""
        if self.qat is None:
            return self
        if self.quantize_base:
            raise ValueError(
                "qat needs the dense base it will merge into, but quantize_base=True stores it quantized; train "
                "QAT on the bf16/fp32 base (remove quantize_base) or drop qat"
            )
        if self.lora_dropout > 0:
            raise ValueError(
                f"qat cannot combine with lora_dropout={self.lora_dropout}: with dropout the update is not a "
                "weight that merges; set lora_dropout: 0.0 or drop qat"
            )
        if self.target_parameters:
            raise ValueError(
                "qat covers target_modules only, not target_parameters (expert banks); remove one of them"
            )
        if self.use_dora:
            raise ValueError(
                "qat simulates the merged LoRA weight W + s·B·A, not DoRA's rescaled rows: use_dora=True and qat "
                "cannot combine; drop one of them"
            )
        return self

    @field_validator("layers_to_transform", mode="before")
    @classmethod
    def _layers_list(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool):
            v = [v]
        if isinstance(v, list) and any(isinstance(i, int) and i < 0 for i in v):
            raise ValueError("layer indices must be >= 0")
        return v

    @property
    def scale(self) -> float:
        """The factor applied to ``B @ A``: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA."""
        return self.lora_alpha / (self.r**0.5 if self.use_rslora else self.r)
