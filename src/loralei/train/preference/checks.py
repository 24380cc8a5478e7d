"""The config checks of the preference objectives (``training.objective: dpo | orpo | cpo | simpo | kto``), run by
the schema with its other cross-field checks."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from ...field_errors import word_join

if TYPE_CHECKING:
    from ..schema import PreferenceSection, RunConfig

ADAPTER_OFF = "adapter_off"
# TRL 1.x's DPO loss types (each defined in losses.py); preference.loss_type takes one or a list of them
DPOLossType = Literal[
    "sigmoid",
    "robust",
    "hinge",
    "ipo",
    "sigmoid_norm",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
]
# TRL's KTO loss types (training.objective kto; unset: kto): KTO's, and APO-zero unpaired (no KL term)
KTOLossType = Literal["kto", "apo_zero_unpaired"]
# preference.loss_type's values: DPO's, simpo (training.objective cpo) and KTO's
PreferenceLossType = Literal[DPOLossType, "simpo", KTOLossType]
# the loss types that read preference.label_smoothing (exo_pair needs it above 0)
SMOOTHED = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired")
# the loss types an f-divergence other than reverse KL applies to (TRL's: in the others the partition function
# of the f-DPO reparameterisation does not cancel)
F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
# the objectives that read each preference setting besides beta (the others refuse it where it is not its default)
_READ_BY: dict[str, tuple[str, ...]] = {
    "loss_type": ("dpo", "cpo", "kto"),
    "loss_weights": ("dpo",),
    "label_smoothing": ("dpo", "cpo", "simpo"),
    "f_divergence_type": ("dpo",),
    "f_alpha_divergence_coef": ("dpo",),
    "discopop_tau": ("dpo",),
    "ld_alpha": ("dpo",),
    "use_weighting": ("dpo",),
    "cpo_alpha": ("cpo", "simpo"),
    "simpo_gamma": ("cpo", "simpo"),
    "alpha": ("cpo", "simpo"),
    "reference": ("dpo", "kto"),
    "precompute_reference": ("dpo", "kto"),  # kto: refused with its reason (_kto_problems)
    "desirable_weight": ("kto",),
    "undesirable_weight": ("kto",),
    "share_prompt": ("dpo", "orpo", "cpo", "simpo"),
}
# TRL's CPO loss types (training.objective cpo; simpo is cpo with loss_type simpo)
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
# what the pair objectives' data holds (False), and KTO's (True)
_COLUMNS = {
    False: "prompt / chosen / rejected columns (data.prompt_field, data.chosen_field, data.rejected_field)",
    True: "prompt / completion / label columns (data.prompt_field, data.completion_field, data.label_field) or "
    "preference pairs",
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
        keys = ("chosen_field", "rejected_field", "label_field")
        fields = [f"data.{key}" for key in keys if getattr(cfg.data, key)]
        unused = [*fields, *(["preference"] if p is not None else [])]
        return [
            f"{field}: only read with a preference training.objective (dpo, orpo, cpo, simpo, kto; it is sft); set "
            "training.objective, or remove it"
            for field in unused
        ]
    problems = [
        f"data.{key}: {getattr(cfg.data, key)!r} names an SFT column; training.objective {t.objective} reads "
        f"{_COLUMNS[t.objective == 'kto']}"
        for key in _SFT_FIELDS
        if getattr(cfg.data, key) and not (t.objective == "kto" and key == "completion_field")
    ]
    if t.objective != "kto" and cfg.data.label_field:
        problems.append(
            f"data.label_field: {cfg.data.label_field!r} is read by training.objective kto only (it is "
            f"{t.objective}, which reads {_COLUMNS[False]}); remove it, or set training.objective: kto"
        )
    problems += _loss_problems(cfg)
    if t.objective == "kto":
        problems += _kto_problems(t, p)
    if p is not None and p.ld_alpha is not None and t.sequence_parallel_size > 1:
        problems.append(
            f"preference.ld_alpha: {p.ld_alpha} does not run with training.sequence_parallel_size "
            f"{t.sequence_parallel_size} yet: LD-DPO weighs a token by its place in its completion, which the "
            "shards of a split sequence do not know; remove ld_alpha or set sequence_parallel_size: 1"
        )
    if p is not None and p.share_prompt is True and t.objective != "kto":
        problems += _share_prompt_problems(cfg)
    return problems if p is None else problems + _setting_problems(t.objective, p)


def _share_prompt_problems(cfg: RunConfig) -> list[str]:
    """``preference.share_prompt: true`` where the run cannot store its pairs' prompts once."""
    from ..shared_prompt import refusal  # the attention's module, loaded only when asked

    why = refusal(cfg)
    return (
        []
        if why is None
        else [f"preference.share_prompt: true cannot run here: {why}; set it to auto or false"]
    )


def _setting_problems(objective: str, p: PreferenceSection) -> list[str]:
    """The preference settings that contradict each other or the objective."""
    defaults = {key: _default(p, key) for key in _READ_BY}
    if objective == "simpo" and p.loss_type == "simpo":  # its own loss type, written out
        defaults["loss_type"] = "simpo"
    problems = [
        f"preference.{key}: {getattr(p, key)!r} is read by training.objective {word_join(readers, 'and')} only "
        f"(it is {objective}); remove it, or set training.objective"
        for key, readers in _READ_BY.items()
        if objective not in readers and getattr(p, key) != defaults[key]
    ]
    if objective == "dpo":
        return problems + _dpo_problems(p)
    if objective in ("cpo", "simpo"):
        return problems + _cpo_problems(objective, p)
    return problems


def kto_loss_type(p: PreferenceSection | None) -> Any:
    """KTO's loss type: ``preference.loss_type`` where given (a KTO run reads it only then), else ``kto``."""
    return p.loss_type if p is not None and "loss_type" in p.model_fields_set else "kto"


def _kto_problems(t: Any, p: PreferenceSection | None) -> list[str]:
    """A loss type that is not KTO's, and what KTO's KL term rules out: each example's KL sequence pairs its prompt
    with the completion of another example of its micro batch, so a micro batch needs two examples, each its own
    row, and the batches change with the data order."""
    loss, problems = kto_loss_type(p), []
    if loss not in get_args(KTOLossType):
        problems.append(
            f"preference.loss_type: {loss!r} is not a loss type of training.objective kto; give kto (the default) "
            "or apo_zero_unpaired, or set training.objective"
        )
    if t.packing:
        problems.append(
            "training.packing: true does not run with training.objective kto: each example's KL sequence is made "
            "in its micro batch from another example's completion (as TRL does), so examples are batched one to a "
            "row; set packing: false"
        )
    if t.batch_size < 2 and loss != "apo_zero_unpaired":
        problems.append(
            f"training.batch_size: {t.batch_size} is too small for training.objective kto: its KL term pairs each "
            "prompt with another example's completion of the same micro batch (TRL refuses a batch of 1 too); "
            "set batch_size to 2 or more"
        )
    if p is not None and p.precompute_reference:
        why = (
            "not built for apo_zero_unpaired"
            if loss == "apo_zero_unpaired"
            else "the KL sequences are made in each micro batch, whose examples change with the data order, so "
            "their reference log-probabilities cannot be computed once"
        )
        problems.append(
            f"preference.precompute_reference: true does not run with training.objective kto: {why}; remove it "
            "(the reference runs in each step)"
        )
    return problems


def _cpo_problems(objective: str, p: PreferenceSection) -> list[str]:
    """CPO's and SimPO's settings that do not fit their loss type."""
    loss = cpo_loss_type(objective, p.loss_type)
    problems = []
    if objective == "cpo" and loss not in CPO_LOSS_TYPES:
        problems.append(
            f"preference.loss_type: {loss!r} is not a loss type of training.objective cpo; give one of "
            f"{word_join(CPO_LOSS_TYPES)} (a list is DPO's), or set training.objective: dpo"
        )
    if p.label_smoothing and loss not in ("sigmoid", "simpo"):
        problems.append(
            f"preference.label_smoothing: {p.label_smoothing} is read by CPO's loss_type sigmoid and simpo only, "
            f"not {loss}; set it to 0.0 or change loss_type"
        )
    if p.simpo_gamma != _default(p, "simpo_gamma") and loss != "simpo":
        problems.append(
            f"preference.simpo_gamma: {p.simpo_gamma} is read by SimPO only (training.objective simpo, or cpo with "
            f"loss_type simpo; it is {loss}); remove it or set loss_type: simpo"
        )
    return problems


def _dpo_problems(p: PreferenceSection) -> list[str]:
    """DPO's settings that contradict each other."""
    types = loss_types(p.loss_type)
    if "simpo" in types:
        return [
            "preference.loss_type: 'simpo' is CPO's reference-free loss, not DPO's; set training.objective: simpo "
            "(or cpo with loss_type: simpo)"
        ]
    if kto := [name for name in types if name in get_args(KTOLossType)]:
        return [
            f"preference.loss_type: {word_join(kto, 'and')} is KTO's (unpaired examples), not DPO's; set "
            "training.objective: kto"
        ]
    problems = [
        f"preference.loss_type: {name!r} is listed {types.count(name)} times; list it once (its weight in "
        "preference.loss_weights)"
        for name in dict.fromkeys(types)
        if types.count(name) > 1
    ]
    if p.loss_weights is not None and len(p.loss_weights) != len(types):
        problems.append(
            f"preference.loss_weights: {p.loss_weights} has {len(p.loss_weights)} weights for the "
            f"{len(types)} loss types {list(types)}; give one weight per loss type (in their order), or remove it "
            "(every loss weighs 1)"
        )
    return problems + _read_settings_problems(p, types)


def _read_settings_problems(p: PreferenceSection, types: tuple[str, ...]) -> list[str]:
    """The DPO settings that no listed loss type reads, or that one of them needs."""
    problems, named = [], word_join(types, "and")
    if p.label_smoothing and not set(types) & set(SMOOTHED):
        problems.append(
            f"preference.label_smoothing: {p.label_smoothing} is read by loss_type {word_join(SMOOTHED, 'and')} "
            f"only, not {named}; set it to 0.0 or change loss_type"
        )
    if "exo_pair" in types and not p.label_smoothing:
        problems.append(
            "preference.label_smoothing: 0.0 with loss_type exo_pair, whose target probabilities are "
            "(1 - label_smoothing, label_smoothing): it needs label_smoothing > 0 (the EXO paper uses 0.001)"
        )
    if p.f_divergence_type != "reverse_kl" and (others := [t for t in types if t not in F_DIVERGENCE_LOSSES]):
        problems.append(
            f"preference.f_divergence_type: {p.f_divergence_type} has no valid form for loss_type "
            f"{word_join(others, 'and')} (only for {word_join(F_DIVERGENCE_LOSSES, 'and')}); use reverse_kl or "
            "change loss_type"
        )
    if (
        p.f_alpha_divergence_coef != _default(p, "f_alpha_divergence_coef")
        and p.f_divergence_type != "alpha_divergence"
    ):
        problems.append(
            f"preference.f_alpha_divergence_coef: {p.f_alpha_divergence_coef} is read by f_divergence_type "
            f"alpha_divergence only (it is {p.f_divergence_type}); remove it or set f_divergence_type"
        )
    if p.discopop_tau != _default(p, "discopop_tau") and "discopop" not in types:
        problems.append(
            f"preference.discopop_tau: {p.discopop_tau} is read by loss_type discopop only, not {named}; "
            "remove it or add discopop to loss_type"
        )
    if p.use_weighting and (sorted_pairs := [t for t in types if t in ("aot", "aot_unpaired")]):
        problems.append(
            f"preference.use_weighting: true does not apply to loss_type {word_join(sorted_pairs, 'and')}, which "
            "compare the micro-batch's pairs sorted, not pair by pair (TRL refuses it too); remove it or change "
            "loss_type"
        )
    return problems


def _default(p: PreferenceSection, key: str) -> Any:
    """The schema's default of ``preference.<key>``."""
    return type(p).model_fields[key].default


def cpo_loss_type(objective: str, loss_type: Any) -> Any:
    """The loss type of ``training.objective`` cpo (``preference.loss_type``) or simpo (simpo)."""
    return "simpo" if objective == "simpo" else loss_type


def loss_types(loss_type: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``preference.loss_type`` as a tuple: one loss type, or the list of those combined."""
    return (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)


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
