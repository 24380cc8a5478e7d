"""Building a run's data from its config: the training and evaluation splits (SFT rows or preference pairs),
tokenized and packed as ``data`` and ``training`` say, and the batch collator."""

from __future__ import annotations

import dataclasses
from typing import Any

from .schema import RunConfig


def prepare_dataset(cfg: RunConfig, tokenizer: Any, *, evaluation: bool = False) -> Any:
    """Tokenizes (and packs) the training or evaluation split as ``data`` and ``training`` say: SFT rows, the
    preference pairs of a pair ``training.objective`` (dpo, orpo, cpo, simpo), or KTO's examples.

    Errors name the keys that gave the split's source (``data.eval_path``, ``data.eval_split`` for evaluation).
    """
    from .data import prepare_sft_dataset
    from .data.kto import UNPAIRED_FIELDS, prepare_kto_dataset
    from .data.preference import prepare_preference_dataset
    from .data.preference_rows import PREFERENCE_FIELDS

    d, common = cfg.data, _common_arguments(cfg, evaluation)
    if cfg.training.objective == "kto":
        common.pop("packing")
        fields = {key: getattr(d, key) for key in {**PREFERENCE_FIELDS, **UNPAIRED_FIELDS}}
        return prepare_kto_dataset(tokenizer, fields=fields, **common)
    if cfg.training.objective != "sft":
        fields = {key: getattr(d, key) for key in PREFERENCE_FIELDS}
        return prepare_preference_dataset(tokenizer, fields=fields, **common)
    sources = {"path", "split", "eval_path", "eval_split", "chat_template", "truncate"}
    fields = d.model_dump(exclude={*sources, "chosen_field", "rejected_field", "label_field"})
    return prepare_sft_dataset(tokenizer, **common, **fields)


def _common_arguments(cfg: RunConfig, evaluation: bool) -> dict[str, Any]:
    """What the SFT and the preference preparation both take: the split's source (path, split, the keys that gave
    them), its limits, template, workers and seed."""
    d, t = cfg.data, cfg.training
    if not evaluation:
        path, split, keys = d.path, d.split, ("data.path", "data.split")
    elif d.eval_path is not None:
        path, split, keys = d.eval_path, d.eval_split, ("data.eval_path", "data.eval_split")
    else:
        path, split, keys = d.path, d.eval_split, ("data.path", "data.eval_split")
    return {
        "path": path, "split": split, "keys": keys, "max_seq_length": t.max_seq_length, "packing": t.packing,
        "chat_template": d.chat_template, "truncate": d.truncate, "num_proc": t.preprocessing_num_workers,
        "seed": t.seed,
    }  # fmt: skip


def make_collate(cfg: RunConfig, tokenizer: Any) -> Any:
    """The batch collator for the configured padding, packing and attention backend (of pairs, for the
    preference objectives: their packed rows hold up to twice ``max_seq_length``)."""
    from .data import make_collator
    from .data.kto import KTOCollator
    from .data.preference_collate import PreferenceCollator

    t = cfg.training
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pairs = t.objective != "sft"
    collate = make_collator(
        pad_id,
        max_seq_length=t.max_seq_length * (2 if pairs and t.packing else 1),
        pad_to_max_length=t.pad_to_max_length,
        packed=t.packing,
        attention_mask=not (t.packing and t.omit_attention_mask_when_packed),
        attn_implementation=cfg.attn_implementation,
    )
    if t.objective == "kto":
        return KTOCollator(PreferenceCollator(collate), t.max_seq_length)
    return PreferenceCollator(collate) if pairs else collate


def build_data(cfg: RunConfig, tokenizer: Any) -> tuple[Any, Any, Any]:
    """Training set, evaluation set (None unless ``data.eval_split`` is set) and collator."""
    from .data import check_packing_backend

    # Before any tokenization, so that an unusable backend fails fast (make_collator checks it again).
    check_packing_backend(cfg.attn_implementation, cfg.training.packing)
    train_set = prepare_dataset(cfg, tokenizer)
    eval_set = None if cfg.data.eval_split is None else prepare_dataset(cfg, tokenizer, evaluation=True)
    return train_set, eval_set, make_collate(cfg, tokenizer)


def padded_batch_tokens(cfg: RunConfig, dataset: Any, width: int) -> int:
    """The tokens of a micro batch of the runner's data with every row ``width`` tokens wide."""
    return cfg.training.batch_size * dataset.rows_per_item * width


def pad_to_width(collate: Any, width: int) -> Any:
    """The runner's collator (the SFT collator, or one that wraps it as ``base``) padding every batch to at least
    ``width`` tokens: the data's widest row gives every batch one width, for CUDA graphs."""
    from .data.collate import Collator

    if isinstance(collate, Collator):
        return dataclasses.replace(collate, pad_width=width)
    return dataclasses.replace(collate, base=pad_to_width(collate.base, width))
