"""The peers' rows of bench_dpo.py: TRL's trainer of the objective on a PEFT LoRA model (``trl-peft``) and Unsloth's
path (``unsloth``: its LoRA model under the same trainer, which Unsloth rewrites when it is imported; its
``PatchDPOTrainer`` is a no-op in 2026.10.9). Both load the shape's checkpoint from disk, train r=16 on the seven
projections and run the trainer's own loop; a callback times the steps. The trainer: ``DPOTrainer`` for ``dpo``,
taking the reference from the model itself (``ref_model=None``, no precomputed log-probabilities: the reference
forward runs in every step); ``trl.experimental.cpo.CPOTrainer`` with ``loss_type="simpo"`` for ``simpo``
(reference-free; it forms the full logits of both completions and takes the chosen ones' NLL from them);
``KTOTrainer`` for ``kto`` (the pairs unpaired into two examples each, ``2 × pairs`` examples a step, each beside
its KL completion, the reference the model itself in every step).

What each does (TRL 1.15.0, Unsloth 2026.10.9, read from their wheels):

- ``trl-peft``: the model from ``from_pretrained`` (SDPA), ``peft_config`` given to the trainer, so the reference
  is the base with the adapter off; the LoRA factors cast to the model's dtype before training (PEFT's default
  keeps them in FP32); ``use_liger_kernel`` (Liger's RMSNorm, RoPE and SwiGLU; TRL 1.15's DPOTrainer turns Liger's
  fused linear cross entropy off and has no Liger DPO loss: its own chunked head scores the completions without the
  full logits); ``gradient_checkpointing`` (non-reentrant) for ``on``.
- ``unsloth``: ``FastLanguageModel.from_pretrained`` + ``get_peft_model`` (bench_rows.unsloth_model: FP32 factors,
  its offloaded ``"unsloth"`` checkpointing for ``on``), handed to the trainer as a PEFT model. TRL then adds a
  frozen copy of the adapter (``"ref"``) to serve as the reference (Unsloth's rewrite of the trainer keeps that step
  for DPO); it is deleted again before training, so that the reference is the base with the adapter off, as in the
  other rows (the same output for a fresh adapter, without the copy's LoRA products; the JSON notes it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from bench_rows import load_model, peft_config, unsloth_model
from transformers import AutoTokenizer, TrainerCallback

# --objective -> the preference settings every row trains with (the runner's preference section, TRL's names)
SETTINGS = {
    "dpo": {"beta": 0.1, "loss_type": "sigmoid"},
    "simpo": {"beta": 2.0, "loss_type": "simpo", "simpo_gamma": 0.5, "cpo_alpha": 1.0},
    "kto": {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0},
}
# the objectives with a reference pass (the adapter off, in every step)
REFERENCED = ("dpo", "kto")
# examples a pair gives: KTO's rows unpair each pair into its chosen and its rejected example (TRL's too)
EXAMPLES_PER_PAIR = {"kto": 2}
# --objective -> TRL's trainer of it, and how that trainer scores the completions
TRAINERS = {
    "dpo": ("DPOTrainer", "TRL's chunked log-prob head"),
    "simpo": ("CPOTrainer (loss_type simpo)", "the full logits"),
    "kto": ("KTOTrainer", "TRL's chunked log-prob head"),
}
# --row -> what the row is, for the JSON and the table
PEER_ROWS = {
    "trl-peft": "TRL {trainer} + PEFT LoRA (factors in the model's dtype, {liger}, {head})",
    "unsloth": "Unsloth FastLanguageModel + get_peft_model under TRL's {trainer} (as Unsloth patches it)",
}


def describe(row: str, liger: bool, objective: str) -> str:
    """What the peer row does, in a line."""
    trainer, head = TRAINERS[objective]
    return PEER_ROWS[row].format(
        trainer=trainer, head=head, liger="Liger's layer kernels" if liger else "no Liger"
    )


class ClockCallback(TrainerCallback):
    """Hands the trainer's state to a bench_runner.StepClock after every optimizer step (``global_step`` counts
    the steps done, as the runner's state does)."""

    def __init__(self, clock: Any) -> None:
        self.clock = clock

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.clock(state)


def trainer_config(args: Any, out_dir: Path, checkpointing: bool, liger: bool) -> Any:
    """The trainer's settings: the run's pairs a step and sequence length in one micro batch (no gradient
    accumulation), the objective's SETTINGS (DPO: the reference in every step), AdamW (fused on CUDA, as the
    runner's) at a constant 1e-4 without weight decay (the runner's default), no saving, one log at the end (TRL
    still reads its metrics on the host in every step).

    Every setting that decides a step's work is passed, not left to the config's defaults: importing Unsloth
    rewrites the TRL configs' defaults (2026.10.9: ``gradient_accumulation_steps`` 2, ``weight_decay`` 0.001,
    ``warmup_steps`` 0.1, ``seed`` 3407, ...), and a default of 2 micro batches made its steps twice the others'
    (:func:`check_step`)."""
    settings = dict(SETTINGS[args.objective])
    if args.objective == "dpo":
        from trl import DPOConfig as Config

        settings |= {"loss_type": [settings["loss_type"]], "precompute_ref_log_probs": False}
    elif args.objective == "kto":
        from trl import KTOConfig as Config

        settings |= {"loss_type": "kto", "precompute_ref_log_probs": False}
    else:
        from trl.experimental.cpo import CPOConfig as Config
    steps = args.warmup + args.steps
    return Config(
        output_dir=str(out_dir),
        per_device_train_batch_size=examples_per_step(args),
        gradient_accumulation_steps=1,
        max_steps=steps,
        max_length=args.seq,
        learning_rate=1e-4,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch_fused" if torch.cuda.is_available() else "adamw_torch",
        gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if checkpointing else None,
        use_liger_kernel=liger,
        bf16=args.dtype == "bfloat16",
        use_cpu=not torch.cuda.is_available(),
        logging_steps=steps,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        **settings,
    )


def examples_per_step(args: Any) -> int:
    """The examples (sequences for KTO, pairs otherwise) every row trains on a step."""
    return args.pairs * EXAMPLES_PER_PAIR.get(args.objective, 1)


def check_step(trainer: Any, args: Any) -> None:
    """Raises unless the trainer's optimizer step takes exactly the run's examples in one micro batch on one
    process, as the runner's row does (the tokens/s of every row assume it).

    Raises:
        RuntimeError: naming the trainer's batch size, accumulation and processes.
    """
    t = trainer.args
    got = (t.per_device_train_batch_size, t.gradient_accumulation_steps, t.world_size)
    if got != (examples_per_step(args), 1, 1):
        raise RuntimeError(
            f"the {args.row} trainer's step is per_device_train_batch_size={got[0]} x "
            f"gradient_accumulation_steps={got[1]} x {got[2]} processes; the rows compare steps of "
            f"{examples_per_step(args)} examples in one micro batch on one process: pass the settings explicitly"
        )


def reference_of(model: Any) -> str:
    """Which reference the trainer runs: a frozen copy of the adapter, or the base with the adapter off."""
    adapters = getattr(model, "peft_config", {})
    return "frozen copy of the adapter ('ref')" if "ref" in adapters else "adapter off"


def build_trainer(
    row: str, args: Any, checkpoint: Path, rows: list[dict[str, str]], out_dir: Path, clock: Any
) -> Any:
    """The row's trainer over ``rows`` (prompt / chosen / rejected text), with ``clock`` as a callback."""
    from datasets import Dataset

    if args.objective == "dpo":
        from trl import DPOTrainer as Trainer

        reference = {"ref_model": None}
    elif args.objective == "kto":
        from trl import KTOTrainer as Trainer

        reference = {"ref_model": None}
    else:
        from trl.experimental.cpo import CPOTrainer as Trainer

        reference = {}
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    checkpointing = args.checkpointing == "on"
    if row == "unsloth":
        model = unsloth_model("unsloth-bf16", args.shape, checkpoint, checkpointing)
        extra, config = {}, trainer_config(args, out_dir, checkpointing=False, liger=False)
    else:
        model = load_model(checkpoint, device, dtype)
        extra, config = (
            {"peft_config": peft_config(args.shape)},
            trainer_config(args, out_dir, checkpointing, args.liger),
        )
    trainer = Trainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[ClockCallback(clock)],
        **reference,
        **extra,
    )
    if row == "trl-peft":  # bf16 adapters, as the bar asks (the optimizer is made in train(), after this)
        for param in trainer.model.parameters():
            if param.requires_grad:
                param.data = param.data.to(dtype)
    return trainer


def base_as_reference(trainer: Any) -> str | None:
    """Deletes the trainer's frozen copy of the adapter (``"ref"``, added when it was handed a PEFT model), so that
    its reference passes run with the adapter off (TRL picks the reference by that name in every step); says so."""
    if "ref" not in getattr(trainer.model, "peft_config", {}):
        return None
    trainer.model.delete_adapter("ref")
    return "TRL's frozen copy of the fresh adapter ('ref') deleted before training: the reference is the adapter off"


def sequence_tokens(trainer: Any) -> list[int]:
    """The distinct lengths of the trainer's tokenized sequences (prompt + chosen, prompt + rejected): DPOTrainer
    keeps the prompt's ids apart, CPOTrainer whole sequences; KTOTrainer's are prompt + completion."""
    data = trainer.train_dataset
    if "completion_ids" in data.column_names:
        return sorted(
            {len(p) + len(c) for p, c in zip(data["prompt_ids"], data["completion_ids"], strict=True)}
        )
    if "chosen_input_ids" in data.column_names:
        return sorted(
            {len(ids) for column in ("chosen_input_ids", "rejected_input_ids") for ids in data[column]}
        )
    return sorted(
        {len(p) + len(c) for p, c in zip(data["prompt_ids"], data["chosen_ids"], strict=True)}
        | {len(p) + len(r) for p, r in zip(data["prompt_ids"], data["rejected_ids"], strict=True)}
    )
