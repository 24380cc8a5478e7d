"""The YAML schema of ``loralei-finetune``: typed sections, aliases, and readable errors.

Every section rejects unknown keys (with a "did you mean", other tools' names included), and every problem in a
file is reported at once, one line each, as ``<dotted.key>: <what is wrong>, e.g. <a good value> (got <value>)``
(:mod:`loralei.field_errors`). Each field's example is its ``examples`` entry, else its default.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..config import LoRAConfig
from ..errors import ConfigError
from ..field_errors import accepted_keys, error_lines, type_error_line
from ..renames import LORA_SECTION
from .preference.checks import PreferenceLossType, preference_problems

AttnImplementation = Literal["sdpa", "flash_attention_2", "flex_attention", "eager"]
PositiveInt = Annotated[int, Field(ge=1)]

# Short spellings users write for dtypes and losses, mapped to the canonical value.
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
_LOSS_ALIASES = {"cce": "cut_cross_entropy", "ce": "cross_entropy", "lce": "linear_cross_entropy"}
# Section aliases, resolved on the raw mapping so that CLI overrides may use either spelling.
SECTION_ALIASES = {"dataset": "data"}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSection(_Section):
    """The base model: a hub name or a local directory, its dtype and attention backend."""

    name_or_path: str = Field(
        validation_alias=AliasChoices("name_or_path", "path", "name"), examples=["Qwen/Qwen3-0.6B"]
    )
    tokenizer: str | None = Field(None, examples=["Qwen/Qwen3-0.6B"])
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", examples=["bfloat16"])
    attn_implementation: AttnImplementation | None = Field(None, examples=["sdpa"])
    revision: str | None = Field(None, examples=["main"])
    trust_remote_code: bool = False
    # fields of the model's Transformers config replaced before it is built (loralei.train.model_config)
    config_overrides: dict[str, Any] = Field(
        default_factory=dict,
        examples=[{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 131072}],
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, v: Any) -> Any:
        return _DTYPE_ALIASES.get(v, v) if isinstance(v, str) else v


class DataSection(_Section):
    """Where the training rows come from and which fields hold what (see ``prepare_sft_dataset``)."""

    path: str = Field(examples=["data/train.jsonl"])
    split: str = "train"
    messages_field: str | None = Field(None, examples=["messages"])
    text_field: str | None = Field(None, examples=["text"])
    instruction_field: str | None = Field(None, examples=["instruction"])
    input_field: str | None = Field(None, examples=["input"])
    response_field: str | None = Field(None, examples=["output"])
    prompt_field: str | None = Field(None, examples=["prompt"])
    completion_field: str | None = Field(None, examples=["completion"])
    # preference data (training.objective dpo, orpo, cpo, simpo; kto unpairs them): the completions preferred and not
    chosen_field: str | None = Field(None, examples=["chosen"])
    rejected_field: str | None = Field(None, examples=["rejected"])
    # KTO's unpaired rows (training.objective kto): whether each completion is desirable (true) or not (false)
    label_field: str | None = Field(None, examples=["label"])
    chat_template: str | None = Field(None, examples=["templates/chat.jinja"])
    truncate: bool = False
    eval_split: str | None = Field(None, examples=["train[95%:]"])
    eval_path: str | None = Field(None, examples=["data/eval.jsonl"])


class FusedGroup(_Section):
    """A user-defined shared-input group: projections of one parent module called on the same input."""

    parent_name: str = Field(examples=["model.layers.0.self_attn"])
    projection_names: list[str] = Field(min_length=2, examples=[["q_proj", "k_proj", "v_proj"]])


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
    attn_implementation: AttnImplementation | None = Field(None, examples=["sdpa"])
    torch_compile: bool = False
    # auto: on where a graph can serve the run (see fast_path.py and graphs.py)
    cuda_graphs: bool | Literal["auto"] = "auto"
    gradient_checkpointing: bool | Literal["offload"] = False  # offload: layer inputs in host memory
    # frozen layer weights in host memory, streamed to the device a layer ahead (see layer_offload.py)
    layer_offloading: bool = False
    # the MLP in sequence tiles; auto: when rows may be long (see tiled_mlp.py)
    tiled_mlp: bool | Literal["auto"] = "auto"
    distributed: Literal["auto", "none", "ddp", "fsdp2"] = "auto"
    # ranks that split each sequence (Ulysses, see sequence_parallel.py); data parallelism over the groups
    sequence_parallel_size: PositiveInt = 1
    fused_lora: bool = True
    fused_shared_input_lora: bool | list[FusedGroup] = True
    # auto: chosen for the run's device (see fast_path.py)
    liger_kernel: bool | Literal["auto"] = "auto"
    loss: Literal["auto", "cross_entropy", "cut_cross_entropy", "linear_cross_entropy"] = "auto"
    # sft: next-token loss; dpo / orpo / cpo / simpo: preference pairs; kto: completions labelled desirable or not
    # (the preference section, train/preference/)
    objective: Literal["sft", "dpo", "orpo", "cpo", "simpo", "kto"] = "sft"
    cut_cross_entropy: CutCrossEntropySection = Field(CutCrossEntropySection(), examples=[{"impl": "cce"}])
    # auto: the cores this process may use (data.tokens.resolve_workers)
    preprocessing_num_workers: PositiveInt | Literal["auto"] = Field("auto", examples=[4])
    dataloader_num_workers: int = Field(0, ge=0)
    pin_memory: bool | Literal["auto"] = "auto"  # auto: pinned on CUDA (run.pin_memory)
    logging_steps: PositiveInt = 10
    report_to: list[Literal["wandb", "tensorboard"]] = Field([], examples=[["tensorboard"]])
    batch_size: PositiveInt = Field(1, examples=[8])
    gradient_accumulation_steps: PositiveInt = 1
    num_epochs: float = Field(1.0, gt=0)
    max_steps: PositiveInt | None = Field(None, examples=[1000])
    max_grad_norm: float | None = Field(1.0, gt=0)
    max_consecutive_skipped_steps: PositiveInt = 10
    seed: int = 0
    # the same bits run to run on one GPU and software, at some speed (see determinism.py)
    deterministic: bool = False
    save_steps: PositiveInt | None = Field(None, examples=[500])
    eval_steps: PositiveInt | None = Field(None, examples=[200])
    eval_batch_size: PositiveInt | None = Field(None, examples=[8])
    save_total_limit: PositiveInt | None = Field(None, examples=[3])
    save_merged: bool = False
    # auto: resume an unfinished run of the same config in output_dir (loralei.train.output_dir)
    resume_from_checkpoint: bool | str | None = Field("auto", examples=[True])

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


class PreferenceSection(_Section):
    """DPO, ORPO, CPO, SimPO and KTO settings (``training.objective: dpo | orpo | cpo | simpo | kto``), named as TRL
    names them."""

    beta: float = Field(0.1, gt=0)
    # DPO: one loss type, or several summed with loss_weights (TRL's MPO, RPO = [sigmoid, sft]); CPO: sigmoid,
    # hinge, ipo or simpo; KTO (read only where given, else kto): kto or apo_zero_unpaired
    loss_type: PreferenceLossType | Annotated[list[PreferenceLossType], Field(min_length=1)] = Field(
        "sigmoid", examples=["sigmoid", ["sigmoid", "sft"]]
    )
    loss_weights: list[Annotated[float, Field(ge=0)]] | None = Field(None, examples=[[1.0, 0.5]])
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    f_divergence_type: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = "reverse_kl"
    f_alpha_divergence_coef: float = Field(0.5, gt=0)
    discopop_tau: float = Field(0.05, gt=0)
    # DPO: LD-DPO's weight of the completion tokens past the pair's shared length (None: 1, no weighting)
    ld_alpha: float | None = Field(None, ge=0, le=1, examples=[0.5])
    # DPO: WPO, each pair's loss weighted by how likely the policy finds its completions (TRL's use_weighting)
    use_weighting: bool = False
    # CPO and SimPO: the weight of the chosen completions' NLL (0: the SimPO paper's loss), SimPO's target margin γ
    cpo_alpha: float = Field(1.0, ge=0)
    simpo_gamma: float = Field(0.5, ge=0)
    # CPO and SimPO: AlphaPO's α, the rewards (1 - p^-α)/α of the completions' probabilities (0: their log-probs)
    alpha: float = Field(0.0, examples=[0.25])
    # adapter_off: the model with its adapter disabled (PiSSA/OLoRA: with its initial factors, the model the
    # policy started from); or an adapter directory the policy starts from
    reference: str = Field("adapter_off", examples=["outputs/sft/adapter"])
    precompute_reference: bool = False
    # the pair objectives: each pair one row, its prompt run once (auto: where the run can; train/shared_prompt.py)
    share_prompt: bool | Literal["auto"] = "auto"
    # KTO: the weights of the desirable and the undesirable examples' losses
    desirable_weight: float = Field(1.0, gt=0)
    undesirable_weight: float = Field(1.0, gt=0)


class OptimizerSection(_Section):
    """Optimizer and learning-rate schedule (built by ``loralei.train.optim``)."""

    name: Literal["adamw", "skipstepadamw", "polora"] = "adamw"
    lr: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    warmup_ratio: float | None = Field(None, ge=0, lt=1, examples=[0.03])
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    # LoRA+ (Hayou et al., 2024): the B factors learn at this multiple of lr (every optimizer, polora included)
    loraplus_lr_ratio: float | None = Field(None, gt=0, examples=[16.0])
    kwargs: dict[str, Any] = Field({}, examples=[{"amsgrad": True}])


class WandbSection(_Section):
    """Weights & Biases run settings (needs the ``wandb`` package)."""

    project: str = "loralei"
    name: str | None = Field(None, examples=["qwen3-lora-r16"])
    entity: str | None = Field(None, examples=["my-team"])
    tags: list[str] = Field([], examples=[["lora", "qwen3"]])


class RunConfig(_Section):
    """A whole fine-tuning job, as written in one YAML file."""

    model: ModelSection = Field(examples=[{"name_or_path": "Qwen/Qwen3-0.6B"}])
    lora: LoRAConfig = Field(LoRAConfig(), examples=[{"r": 16, "lora_alpha": 32}])
    data: DataSection = Field(examples=[{"path": "data/train.jsonl", "messages_field": "messages"}])
    training: TrainingSection = Field(TrainingSection(), examples=[{"max_steps": 1000, "batch_size": 8}])
    optimizer: OptimizerSection = Field(OptimizerSection(), examples=[{"lr": 2e-4}])
    preference: PreferenceSection | None = Field(None, examples=[{"beta": 0.1, "loss_type": "sigmoid"}])
    wandb: WandbSection | Literal[False] | None = Field(None, examples=[{"project": "my-project"}])
    output_dir: str = Field(examples=["outputs/run"])
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
    if t.max_steps is not None and cfg.optimizer.warmup_steps >= t.max_steps:
        problems.append(
            f"optimizer.warmup_steps: {cfg.optimizer.warmup_steps} is not below training.max_steps "
            f"{t.max_steps}, so the run would end before its learning rate reached the peak; set "
            f"optimizer.warmup_steps below {t.max_steps} (e.g. 0), use optimizer.warmup_ratio (e.g. 0.1, a "
            "fraction of the run) instead, or raise training.max_steps"
        )
    if t.gradient_checkpointing == "offload" and t.torch_compile:
        problems.append(
            "training.gradient_checkpointing: offload does not run under torch_compile yet; use "
            "gradient_checkpointing: true with torch_compile, or turn torch_compile off"
        )
    if t.tiled_mlp is True:
        problems += [
            f"training.tiled_mlp: true cannot run here: {why}; set tiled_mlp: auto or false"
            for why in tiled_mlp_refusals(cfg)
        ]
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
    if t.gradient_checkpointing == "offload" and t.distributed == "fsdp2":
        problems.append(
            "training.gradient_checkpointing: offload does not run with distributed: fsdp2 yet; use "
            "gradient_checkpointing: true, or distributed: ddp"
        )
    problems += [
        f"training.sequence_parallel_size: {t.sequence_parallel_size} does not run with {why}"
        for why in sequence_parallel_refusals(cfg)
    ]
    problems += [
        f"training.layer_offloading: true does not run {why}" for why in layer_offloading_refusals(cfg)
    ]
    problems += preference_problems(cfg)
    if t.liger_kernel is True and t.loss == "cut_cross_entropy":
        problems.append(
            "training.liger_kernel: Liger's fused linear cross entropy and training.loss cut_cross_entropy "
            "both replace the loss; choose one"
        )
    return problems


# ------------------------------------------------------------------------------------------ error reporting


def _section_keys() -> dict[str, list[str]]:
    """The keys accepted at each dotted location, for "did you mean" suggestions on unknown keys."""
    models: dict[str, type[BaseModel]] = {
        "": RunConfig,
        "model": ModelSection,
        LORA_SECTION: LoRAConfig,
        "data": DataSection,
        "training": TrainingSection,
        "training.cut_cross_entropy": CutCrossEntropySection,
        "optimizer": OptimizerSection,
        "preference": PreferenceSection,
        "wandb": WandbSection,
    }
    return {where: accepted_keys(model) for where, model in models.items()}


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
    """Validates the ``lora`` section through ``LoRAConfig`` itself, wording its problems as YAML fields.

    Cross-field problems that ``LoRAConfig`` reports without a field are put under ``lora``; dropout with expert
    banks is checked here first, so that its line names both YAML fields.
    """
    if raw is None:
        return LoRAConfig(), []
    if not isinstance(raw, dict):
        return None, [type_error_line(LORA_SECTION, RunConfig.model_fields[LORA_SECTION], raw)]
    lines = []
    if problem := _expert_dropout_problem(raw):
        lines.append(problem)
        raw = {**raw, "lora_dropout": 0.0}  # the rest of the section is still checked
    try:
        lora = LoRAConfig(**raw)
    except ConfigError as exc:
        lora = None
        lines += error_lines(
            exc.validation_errors,
            LoRAConfig,
            raw,
            prefix=f"{LORA_SECTION}.",
            section=LORA_SECTION,
            sections=_section_keys(),
        )
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
        lines += error_lines(err.errors(), RunConfig, raw, sections=_section_keys())
    else:
        if lora is not None:
            cfg = cfg.model_copy(update={"lora": lora})
            lines = _cross_field_problems(cfg)
    if not lines:
        return cfg
    count = f"{len(lines)} problem{'s' if len(lines) > 1 else ''}"
    raise ConfigError(f"invalid config {source} ({count}):\n" + "\n".join(f"  {line}" for line in lines))


def sequence_parallel_refusals(cfg: RunConfig) -> list[str]:
    """The settings a sequence-parallel run (``training.sequence_parallel_size`` > 1) cannot take, each with its
    fix (none for one rank per sequence)."""
    t = cfg.training
    if t.sequence_parallel_size == 1:
        return []
    attention = t.attn_implementation or cfg.model.attn_implementation
    settings = [
        (
            t.liger_kernel is True,
            "liger_kernel: true (Liger's loss shifts each shard's labels itself); set liger_kernel: auto or false",
        ),
        (t.torch_compile, "torch_compile: true yet; turn torch_compile off"),
        (
            t.cuda_graphs is True,
            "cuda_graphs: true (its collectives run in every step); set cuda_graphs: auto",
        ),
        (
            t.distributed == "none",
            "distributed: none (it runs its ranks under DDP or FSDP2); set distributed: auto, ddp or fsdp2",
        ),
        (
            attention == "eager",
            "attn_implementation: eager (it wraps sdpa, flash_attention_2 or flex_attention); set it to sdpa",
        ),
    ]
    return [why for refused, why in settings if refused]


def tiled_mlp_refusals(cfg: RunConfig) -> list[str]:
    """Why the MLP cannot run in tiles in this run (``training.tiled_mlp: true`` is an error then, ``auto``
    stays off and says why)."""
    reasons = []
    if cfg.training.torch_compile:
        reasons.append(
            "torch_compile compiles the layers, which the tiles' second run does not go through yet"
        )
    if cfg.lora.lora_dropout > 0:
        reasons.append(
            f"lora.lora_dropout {cfg.lora.lora_dropout} would draw other masks when the backward runs each tile "
            "again"
        )
    return reasons


def layer_offloading_refusals(cfg: RunConfig) -> list[str]:
    """The settings a run that streams its layers' frozen weights (``training.layer_offloading: true``) cannot
    take, each with its fix (none when it is off)."""
    t = cfg.training
    if not t.layer_offloading:
        return []
    settings = [
        (
            t.gradient_checkpointing is False,
            "without gradient_checkpointing (autograd would keep weights that are streamed out before the "
            "backward); set training.gradient_checkpointing: true or offload",
        ),
        (
            t.torch_compile,
            "with torch_compile: true yet (compiled layers are not known to see their weights move); turn "
            "torch_compile off",
        ),
        (
            t.cuda_graphs is True,
            "with cuda_graphs: true (a graph replays the addresses of weights that move every step); set "
            "cuda_graphs: auto or false",
        ),
        (
            t.distributed == "fsdp2",
            "with distributed: fsdp2 (it shards and gathers the layers' weights itself); use distributed: ddp "
            "or none",
        ),
        (
            cfg.lora.use_dora,
            "with lora.use_dora: true yet (DoRA's row norms read each streamed weight outside its layer's "
            "forward); set lora.use_dora: false, or layer_offloading: false",
        ),
        (
            t.save_merged,
            "with training.save_merged: true yet (merging needs every layer's weights on the device); set "
            "save_merged: false and merge the saved adapter afterwards (loralei.load_pretrained, then "
            "loralei.merge_and_unload_lora)",
        ),
    ]
    return [why for refused, why in settings if refused]
