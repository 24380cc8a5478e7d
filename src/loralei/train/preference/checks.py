"""The config checks of the preference objectives (``training.objective: dpo | orpo``), run by the schema with its
other cross-field checks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..schema import PreferenceSection, RunConfig

ADAPTER_OFF = "adapter_off"
# settings a preference run does not take yet: (refused?, the setting as written, the value to set)
_REFUSED: list[tuple[Callable[[Any], bool], str, str]] = [
    (lambda t: t.sequence_parallel_size > 1, "training.sequence_parallel_size > 1", "1"),
    (lambda t: t.layer_offloading, "training.layer_offloading: true", "false"),
    (lambda t: t.cuda_graphs is True, "training.cuda_graphs: true", "auto"),
    # a reference adapter is swapped into each LoRA parameter's storage, which FSDP2 shards
    (lambda t: t.distributed == "fsdp2", "training.distributed: fsdp2", "ddp"),
]

# the DPO settings and their defaults (ORPO takes none of them)
_DPO_ONLY = {
    "loss_type": "sigmoid",
    "label_smoothing": 0.0,
    "reference": ADAPTER_OFF,
    "precompute_reference": False,
}
# the data fields of SFT rows, which preference data does not have
_SFT_FIELDS = (
    "messages_field",
    "text_field",
    "instruction_field",
    "input_field",
    "response_field",
    "completion_field",
)


def preference_problems(cfg: RunConfig) -> list[str]:
    """The settings that do not fit ``training.objective`` (the preference section, the data fields, the loss and
    the features a preference run does not take yet)."""
    t, p = cfg.training, cfg.preference
    if t.objective == "sft":
        fields = [f"data.{key}" for key in ("chosen_field", "rejected_field") if getattr(cfg.data, key)]
        unused = [*fields, *(["preference"] if p is not None else [])]
        return [
            f"{field}: only read with training.objective dpo or orpo (it is sft); set training.objective, or "
            "remove it"
            for field in unused
        ]
    problems = [
        f"data.{key}: {getattr(cfg.data, key)!r} names an SFT column; training.objective {t.objective} reads "
        "prompt / chosen / rejected columns (data.prompt_field, data.chosen_field, data.rejected_field)"
        for key in _SFT_FIELDS
        if getattr(cfg.data, key)
    ]
    problems += _loss_problems(cfg)
    problems += [
        f"{setting} does not run with training.objective {t.objective} yet; set it to {fix}"
        for on, setting, fix in _REFUSED
        if on(t)
    ]
    return problems if p is None else problems + _setting_problems(t.objective, p)


def _setting_problems(objective: str, p: PreferenceSection) -> list[str]:
    """The preference settings that contradict each other or the objective."""
    problems = []
    if objective == "orpo":
        problems += [
            f"preference.{key}: {getattr(p, key)!r} is a DPO setting and ORPO is reference-free; remove it, or "
            "set training.objective: dpo"
            for key, default in _DPO_ONLY.items()
            if getattr(p, key) != default
        ]
    if p.label_smoothing and p.loss_type not in ("sigmoid", "robust"):
        problems.append(
            f"preference.label_smoothing: {p.label_smoothing} is read by loss_type sigmoid and robust only, not "
            f"{p.loss_type}; set it to 0.0 or change loss_type"
        )
    return problems


def _loss_problems(cfg: RunConfig) -> list[str]:
    t = cfg.training
    if t.loss in ("auto", "linear_cross_entropy"):
        return []
    return [
        f"training.loss: {t.loss} is an SFT loss; training.objective {t.objective} takes its log-probabilities "
        "from loralei's chunked head (linear_cross_entropy); set loss: auto"
    ]


def check_reference_path(reference: str) -> str | None:
    """What is wrong with ``preference.reference`` before anything loads (a directory that does not exist), or
    None."""
    if reference == ADAPTER_OFF or Path(reference).expanduser().is_dir():
        return None
    return (
        f"preference.reference: {reference!r} is neither {ADAPTER_OFF!r} nor an existing adapter directory; give "
        f"the directory an adapter was saved to (e.g. outputs/sft/adapter), or reference: {ADAPTER_OFF}"
    )
