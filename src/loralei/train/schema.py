"""The YAML schema of ``loralei-finetune``: typed sections, aliases, and readable errors.

Every section rejects unknown keys (with a "did you mean"), and every problem in a file is reported at once,
one line each, as ``<dotted.key>: <what is wrong> (got <value>)``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..config import LoRAConfig
from ..errors import ConfigError, did_you_mean

AttnImplementation = Literal["sdpa", "flash_attention_2", "eager"]
PositiveInt = Annotated[int, Field(ge=1)]

# Short spellings users write for dtypes and losses, mapped to the canonical value.
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
_LOSS_ALIASES = {"cce": "cut_cross_entropy", "ce": "cross_entropy", "lce": "linear_cross_entropy"}
# Section aliases, resolved on the raw mapping so that CLI overrides may use either spelling.
SECTION_ALIASES = {"dataset": "data"}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    """The base model: a hub name or a local directory, its dtype and attention backend."""

    name_or_path: str = Field(validation_alias=AliasChoices("name_or_path", "path", "name"))
    tokenizer: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    attn_implementation: AttnImplementation | None = None
    revision: str | None = None
    trust_remote_code: bool = False

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, v: Any) -> Any:
        return _DTYPE_ALIASES.get(v, v) if isinstance(v, str) else v


class DataSection(_Section):
    """Where the training rows come from and which fields hold what (see ``prepare_sft_dataset``)."""

    path: str
    split: str = "train"
    messages_field: str | None = None
    text_field: str | None = None
    instruction_field: str | None = None
    input_field: str | None = None
    response_field: str | None = None
    prompt_field: str | None = None
    completion_field: str | None = None
    chat_template: str | None = None
    truncate: bool = False
    eval_split: str | None = None
    eval_path: str | None = None


class FusedGroup(_Section):
    """A user-defined shared-input group: projections of one parent module called on the same input."""

    parent_name: str
    projection_names: list[str] = Field(min_length=2)


class CutCrossEntropySection(_Section):
    """Options of Apple's Cut Cross Entropy (``cut-cross-entropy`` package)."""

    impl: Literal[
        "cce", "cce_exact", "cce_kahan_full_c", "cce_kahan_full_e", "cce_kahan_full", "torch_compile"
    ] = "cce"


class TrainingSection(_Section):
    """The loop: sequence shape, batch, length of the run, kernels, logging, checkpoints."""

    max_seq_length: int = Field(2048, ge=2)
    packing: bool = False
    pad_to_max_length: bool = False
    omit_attention_mask_when_packed: bool = False
    attn_implementation: AttnImplementation | None = None
    torch_compile: bool = False
    # auto: on where a graph can serve the run (see fast_path.py and graphs.py)
    cuda_graphs: bool | Literal["auto"] = "auto"
    gradient_checkpointing: bool | Literal["offload"] = False  # offload: layer inputs in host memory
    distributed: Literal["auto", "none", "ddp", "fsdp2"] = "auto"
    fused_lora: bool = True
    fused_shared_input_lora: bool | list[FusedGroup] = True
    # auto: chosen for the run's device (see fast_path.py)
    liger_kernel: bool | Literal["auto"] = "auto"
    loss: Literal["auto", "cross_entropy", "cut_cross_entropy", "linear_cross_entropy"] = "auto"
    cut_cross_entropy: CutCrossEntropySection = CutCrossEntropySection()
    # auto: the cores this process may use (data.tokens.resolve_workers)
    preprocessing_num_workers: PositiveInt | Literal["auto"] = "auto"
    dataloader_num_workers: int = Field(0, ge=0)
    pin_memory: bool | Literal["auto"] = "auto"  # auto: pinned on CUDA (run.pin_memory)
    logging_steps: PositiveInt = 10
    report_to: list[Literal["wandb", "tensorboard"]] = []
    batch_size: PositiveInt = 1
    gradient_accumulation_steps: PositiveInt = 1
    num_epochs: float = Field(1.0, gt=0)
    max_steps: PositiveInt | None = None
    max_grad_norm: float | None = Field(1.0, gt=0)
    max_consecutive_skipped_steps: PositiveInt = 10
    seed: int = 0
    save_steps: PositiveInt | None = None
    eval_steps: PositiveInt | None = None
    eval_batch_size: PositiveInt | None = None
    save_total_limit: PositiveInt | None = None
    save_merged: bool = False
    resume_from_checkpoint: bool | str | None = None

    @field_validator("loss", mode="before")
    @classmethod
    def _loss_alias(cls, v: Any) -> Any:
        return _LOSS_ALIASES.get(v, v) if isinstance(v, str) else v

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, v: Any) -> Any:
        if v in (None, "none"):
            return []
        return [v] if isinstance(v, str) else v


class OptimizerSection(_Section):
    """Optimizer and learning-rate schedule (built by ``loralei.train.optim``)."""

    name: Literal["adamw", "skipstepadamw", "polora"] = "adamw"
    lr: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    warmup_ratio: float | None = Field(None, ge=0, lt=1)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    kwargs: dict[str, Any] = {}


class WandbSection(_Section):
    """Weights & Biases run settings (needs the ``wandb`` package)."""

    project: str = "loralei"
    name: str | None = None
    entity: str | None = None
    tags: list[str] = []


class RunConfig(_Section):
    """A whole fine-tuning job, as written in one YAML file."""

    model: ModelSection
    lora: LoRAConfig = LoRAConfig()
    data: DataSection
    training: TrainingSection = TrainingSection()
    optimizer: OptimizerSection = OptimizerSection()
    wandb: WandbSection | Literal[False] | None = None
    output_dir: str
    overwrite_output_dir: bool = False

    @property
    def attn_implementation(self) -> str:
        """The attention backend: ``training.attn_implementation``, else ``model.attn_implementation``, else sdpa."""
        return self.training.attn_implementation or self.model.attn_implementation or "sdpa"

    @property
    def wandb_settings(self) -> WandbSection | None:
        """The W&B settings when W&B logging is on (a ``wandb`` section, or ``report_to: wandb``), else None."""
        if isinstance(self.wandb, WandbSection):
            return self.wandb
        return WandbSection() if "wandb" in self.training.report_to else None


def _cross_field_problems(cfg: RunConfig) -> list[str]:
    """Problems that involve two fields; checked once every field is valid on its own."""
    problems = []
    t = cfg.training
    if t.attn_implementation and cfg.model.attn_implementation not in (None, t.attn_implementation):
        problems.append(
            f"training.attn_implementation: {t.attn_implementation!r} contradicts model.attn_implementation "
            f"{cfg.model.attn_implementation!r}; set only one of them"
        )
    if cfg.wandb is False and "wandb" in t.report_to:
        problems.append("wandb: false contradicts training.report_to: wandb; remove one of them")
    if cfg.model.dtype == "float16" and not cfg.lora.lora_fp32_gradients:
        problems.append(
            "lora.lora_fp32_gradients: must be true with model.dtype float16 (fp16 LoRA weights and gradients "
            "overflow; loralei keeps them in fp32 and scales the loss); or use bfloat16"
        )
    if t.eval_steps is not None and cfg.data.eval_split is None:
        problems.append(
            "training.eval_steps: evaluation needs data.eval_split (e.g. 'train[95%:]' with data.split "
            "'train[:95%]', or a split of data.eval_path)"
        )
    if cfg.data.eval_path is not None and cfg.data.eval_split is None:
        problems.append("data.eval_path: set data.eval_split too (the split of eval_path to evaluate on)")
    if cfg.optimizer.warmup_ratio is not None and cfg.optimizer.warmup_steps:
        problems.append("optimizer.warmup_ratio: set either warmup_steps or warmup_ratio, not both")
    if t.gradient_checkpointing == "offload" and t.torch_compile:
        problems.append(
            "training.gradient_checkpointing: offload does not run under torch_compile yet; use "
            "gradient_checkpointing: true with torch_compile, or turn torch_compile off"
        )
    if t.cuda_graphs is True and t.torch_compile:
        problems.append(
            "training.cuda_graphs: true and torch_compile: true cannot be combined (torch.compile runs its own "
            "graphs); turn one of them off"
        )
    if t.cuda_graphs is True and t.distributed in ("ddp", "fsdp2"):
        problems.append(
            f"training.cuda_graphs: true does not run with distributed: {t.distributed} (its gradient hooks run "
            "on the host in every backward); set cuda_graphs: auto or false"
        )
    if t.cuda_graphs is True and cfg.model.dtype == "float16":
        problems.append(
            "training.cuda_graphs: true does not run with model.dtype float16 (its loss scaler checks the "
            "gradients on the host); use bfloat16, or set cuda_graphs: auto or false"
        )
    if t.gradient_checkpointing == "offload" and t.distributed in ("ddp", "fsdp2"):
        problems.append(
            f"training.gradient_checkpointing: offload does not run with distributed: {t.distributed} yet; use "
            "gradient_checkpointing: true"
        )
    if t.liger_kernel is True and t.loss == "cut_cross_entropy":
        problems.append(
            "training.liger_kernel: Liger's fused linear cross entropy and training.loss cut_cross_entropy "
            "both replace the loss; choose one"
        )
    return problems


# ------------------------------------------------------------------------------------------ error reporting

# Pydantic inserts the tried member of a union into an error location ("bool", "list[FusedGroup]",
# "literal[False]", "WandbSection"); these are not keys the user wrote, so they are dropped.
_TYPE_TAGS = {"bool", "int", "float", "str", "none", "dict", "list", "tuple"}


def _user_loc(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    def is_tag(part: Any) -> bool:
        return isinstance(part, str) and ("[" in part or part[:1].isupper() or part in _TYPE_TAGS)

    return tuple(part for part in loc if not is_tag(part))


def _accepted_keys(model: type[BaseModel]) -> list[str]:
    keys = []
    for name, info in model.model_fields.items():
        alias = info.validation_alias
        keys.extend(alias.choices if isinstance(alias, AliasChoices) else [name])
    return [str(k) for k in keys]


def _section_types() -> dict[str, type[BaseModel]]:
    """The model class at each dotted location, for "did you mean" suggestions on unknown keys."""
    return {
        "": RunConfig,
        "model": ModelSection,
        "lora": LoRAConfig,
        "data": DataSection,
        "training": TrainingSection,
        "training.cut_cross_entropy": CutCrossEntropySection,
        "optimizer": OptimizerSection,
        "wandb": WandbSection,
    }


def format_errors(errors: list[dict]) -> list[str]:
    """One line per problem, merging the alternatives pydantic reports for a union-typed key.

    Args:
        errors: ``ValidationError.errors()`` of :class:`RunConfig`.

    Returns:
        Lines like ``training.max_seq_length: Input should be greater than or equal to 2 (got 1)``.
    """
    sections = _section_types()
    merged: dict[str, list[str]] = {}
    inputs: dict[str, Any] = {}
    for err in errors:
        loc = _user_loc(err["loc"])
        where = ".".join(str(p) for p in loc) or "config"
        if err["type"] == "extra_forbidden":
            parent = ".".join(str(p) for p in loc[:-1])
            section = sections.get(parent)
            hint = did_you_mean(str(loc[-1]), _accepted_keys(section)) if section else ""
            hint = hint or _elsewhere_hint(str(loc[-1]), parent, sections)
            merged.setdefault(where, []).append(f"unknown key{hint}; remove it or fix its spelling")
            continue
        if err["type"] == "missing":
            merged.setdefault(where, []).append("is required but missing")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        if msg not in merged.setdefault(where, []):
            merged[where].append(msg)
        inputs[where] = err.get("input")
    return [
        f"{where}: {_join_alternatives(msgs)}" + (f" (got {inputs[where]!r})" if where in inputs else "")
        for where, msgs in merged.items()
    ]


def _elsewhere_hint(key: str, parent: str, sections: dict[str, type[BaseModel]]) -> str:
    """' (did you mean "optimizer.lr"?)' when the key belongs to another section (e.g. ``training.lr``)."""
    for where, section in sections.items():
        if where != parent and key in _accepted_keys(section):
            return f' (did you mean "{where}.{key}"?)' if where else f' (did you mean top-level "{key}"?)'
    return ""


def _join_alternatives(msgs: list[str]) -> str:
    """``Input should be a valid boolean`` + ``Input should be a valid list`` -> ``... boolean or a valid list``."""
    first, *rest = (m.removesuffix(", unable to interpret input") for m in msgs)
    return " or ".join([first, *(m.removeprefix("Input should be ") for m in rest)])


def _expert_dropout_problem(raw: dict[str, Any]) -> str | None:
    """``lora.lora_dropout > 0`` with ``lora.target_parameters``, named by both YAML fields."""
    dropout, banks = raw.get("lora_dropout"), raw.get("target_parameters")
    number = isinstance(dropout, int | float) and not isinstance(dropout, bool)
    if not (number and 0 < dropout < 1 and isinstance(banks, list) and banks):
        return None  # nothing to say, or a bad value that LoRAConfig reports itself
    return (
        f"lora.lora_dropout: {dropout} cannot be combined with lora.target_parameters (expert banks): the experts "
        "a token is routed to share its one input, so there is no LoRA branch input to drop out; set "
        "lora.lora_dropout: 0.0, or remove lora.target_parameters and adapt only lora.target_modules"
    )


def _validate_lora(raw: Any) -> tuple[LoRAConfig | None, list[str]]:
    """Validates the ``lora`` section through ``LoRAConfig`` itself (its constructor reports its own errors).

    Cross-field problems that ``LoRAConfig`` reports without a field (``config: ...``) are put under ``lora``;
    dropout with expert banks is checked here first, so that its line names both YAML fields.
    """
    if raw is None:
        return LoRAConfig(), []
    if not isinstance(raw, dict):
        return None, [f"lora: must be a section of LoRA settings such as r and lora_alpha (got {raw!r})"]
    lines = []
    if problem := _expert_dropout_problem(raw):
        lines.append(problem)
        raw = {**raw, "lora_dropout": 0.0}  # the rest of the section is still checked
    try:
        lora = LoRAConfig(**raw)
    except ConfigError as exc:
        lora = None
        for line in str(exc).splitlines()[1:]:
            field, _, message = line.partition(": ")
            lines.append(f"lora: {message}" if field == "config" else f"lora.{line}")
    return (lora, []) if not lines else (None, lines)


def validate_config(raw: dict[str, Any], source: str = "config") -> RunConfig:
    """Validates a raw mapping (section aliases already applied) into a :class:`RunConfig`.

    Args:
        raw: the parsed YAML with overrides applied.
        source: where it came from, for the error heading.

    Returns:
        The validated config.

    Raises:
        ConfigError: listing every problem, one per line.
    """
    raw = dict(raw)
    lora, lines = _validate_lora(raw.pop("lora", None))
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as err:
        lines += format_errors(err.errors())
    else:
        if lora is not None:
            cfg = cfg.model_copy(update={"lora": lora})
            lines = _cross_field_problems(cfg)
    if not lines:
        return cfg
    count = f"{len(lines)} problem{'s' if len(lines) > 1 else ''}"
    raise ConfigError(f"invalid config {source} ({count}):\n" + "\n".join(f"  {line}" for line in lines))
