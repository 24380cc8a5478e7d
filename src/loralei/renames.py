"""What an unknown config key probably meant: other tools' names first, then the same key in another section,
then a close spelling.

Users bring names from PEFT, TRL, Axolotl and the Hugging Face Trainer; :data:`FOREIGN_KEYS` maps each to
loralei's field, so that ``lora.rank`` answers 'did you mean "r"' where spelling distance alone finds nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from .errors import did_you_mean

# The section of a run config that holds LoRAConfig's fields.
LORA_SECTION = "lora"

# Other tools' keys, by the section they were written in ("*": any section, the top level included), and
# loralei's field for them: "section.key", "key" at the top level, or "section.key: value" where a flag of theirs
# is a value of ours.
FOREIGN_KEYS: dict[tuple[str, str], str] = {
    ("lora", "rank"): "lora.r",
    ("*", "lora_r"): "lora.r",
    ("lora", "alpha"): "lora.lora_alpha",
    ("lora", "dropout"): "lora.lora_dropout",
    ("*", "lora_target_modules"): "lora.target_modules",
    ("*", "peft_use_dora"): "lora.use_dora",
    ("lora", "dora"): "lora.use_dora",
    ("*", "learning_rate"): "optimizer.lr",
    ("training", "lr"): "optimizer.lr",
    ("*", "epochs"): "training.num_epochs",
    ("*", "num_train_epochs"): "training.num_epochs",
    ("*", "max_length"): "training.max_seq_length",
    ("*", "max_seq_len"): "training.max_seq_length",
    ("*", "seq_len"): "training.max_seq_length",
    ("*", "sequence_len"): "training.max_seq_length",
    ("*", "per_device_train_batch_size"): "training.batch_size",
    ("*", "micro_batch_size"): "training.batch_size",
    ("*", "gradient_accumulation"): "training.gradient_accumulation_steps",
    ("*", "warmup"): "optimizer.warmup_steps",
    ("*", "lr_scheduler_type"): "optimizer.schedule",
    ("*", "lr_scheduler"): "optimizer.schedule",
    ("*", "scheduler"): "optimizer.schedule",
    ("*", "optim"): "optimizer.name",
    ("*", "base_model"): "model.name_or_path",
    ("*", "model_name_or_path"): "model.name_or_path",
    ("*", "output"): "output_dir",
    ("*", "datasets"): "data",
    ("*", "bf16"): "model.dtype: bfloat16",
    ("*", "fp16"): "model.dtype: float16",
    ("training", "weight_decay"): "optimizer.weight_decay",
    ("preference", "rpo_alpha"): "preference.loss_type: [sigmoid, sft]",
    ("preference", "precompute_ref_log_probs"): "preference.precompute_reference",
    ("preference", "ref_model"): "preference.reference",
}

# What TRL's TR-DPO keys are (three of them below)
_TR_DPO = "TRL's TR-DPO reference updates, which TRL runs without PEFT only and loralei does not have"
# Other tools' keys for what loralei does not do, by section, and what they are
NOT_TAKEN: dict[tuple[str, str], str] = {
    ("preference", "sync_ref_model"): _TR_DPO,
    ("preference", "ref_model_mixup_alpha"): _TR_DPO,
    ("preference", "ref_model_sync_steps"): _TR_DPO,
}

# Other tools' values of a field that loralei writes another way, by the field and the value, and what to write
FOREIGN_VALUES: dict[tuple[str, str], str] = {
    ("preference.loss_type", "alphapo"): (
        "TRL's alphapo is loss_type: simpo with cpo_alpha: 0; set alpha, AlphaPO's α, too (e.g. 0.25)"
    ),
}


def _section(target: str) -> str:
    """``"optimizer.lr"`` -> ``"optimizer"``; ``"output_dir"`` -> ``""``."""
    field = target.partition(": ")[0]
    return field.rpartition(".")[0]


def _suggestion(target: str, parent: str) -> str:
    """``target`` as seen from section ``parent``: bare inside its own section, marked at the top level."""
    section = _section(target)
    if section == parent:
        return f'"{target.removeprefix(f"{section}.") if section else target}"'
    return f'"{target}"' if section else f'top-level "{target}"'


def unknown_key_hint(
    key: str, parent: str, keys: Collection[str], sections: Mapping[str, Collection[str]]
) -> str:
    """' (did you mean "x"?)' for an unknown ``key`` written in section ``parent``, or '' when nothing fits.

    In order: other tools' name for what loralei does not do (what it is), other tools' name for a loralei field,
    the same key in another section, the closest key of ``parent``.

    Args:
        key: the unknown key.
        parent: the dotted section it was written in (``""`` for the top level).
        keys: the keys that section accepts.
        sections: the keys of every section known where the key was written, by dotted name; other tools'
            names are suggested only when loralei's field lies in one of them, and a key that belongs to
            another of them is pointed there.

    Returns:
        The hint, with its leading space.
    """
    if (what := NOT_TAKEN.get((parent, key))) is not None:
        return f" ({what})"
    target = FOREIGN_KEYS.get((parent, key)) or FOREIGN_KEYS.get(("*", key))
    if target is not None and _section(target) in sections:
        return f" (did you mean {_suggestion(target, parent)}?)"
    for where, accepted in sections.items():
        if where != parent and key in accepted:
            return f" (did you mean {_suggestion(f'{where}.{key}' if where else key, parent)}?)"
    return did_you_mean(key, keys)
