"""DPO (every loss type, LD-DPO's weighted sums, WPO's pair weights), ORPO and CPO / SimPO / AlphaPO on a tiny model:
the loss and its LoRA gradients equal a direct fp64 computation of the objective from its definition (full logits,
one sequence at a time, the reference with the adapter off), for unpacked and packed batches of several shapes; ln
2 at a zero-initialised adapter; the metrics, with ``logits/*`` against the full logits of the completion tokens."""

from __future__ import annotations

import copy
import math
import typing

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pair_helpers import collate, make_pairs

from loralei import LoRAConfig, disable_lora, inject_lora
from loralei.train.loop import window_counts
from loralei.train.losses import IGNORE_INDEX, batch_targets, trainable_labels, with_trained_rows
from loralei.train.preference.checks import DPOLossType, loss_types
from loralei.train.preference.logps import PairLogps
from loralei.train.preference.losses import DPO_LOSSES, F_SCORES, CPOLoss, DPOLoss, ORPOLoss
from loralei.train.preference.objective import DPOObjective, ReferenceFreeObjective, count_pairs
from loralei.train.preference.reference import InStepReference
from loralei.train.schema import PreferenceSection
from tiny_models import tiny_model
from tolerances import FP32_MODEL_REL, assert_fp32_close, assert_fp32_rounding_close

pytestmark = pytest.mark.usefixtures("one_thread")


def lora_model(zero_b: bool = False, family: str = "llama", **overrides) -> torch.nn.Module:
    return inject_lora(
        tiny_model(family, **overrides),
        LoRAConfig(r=2, init_lora_weights=zero_b, target_modules="all-linear"),
    )


def token_logps(model: torch.nn.Module, ids: np.ndarray, labels: np.ndarray) -> torch.Tensor:
    """The log-probability of each of a sequence's labels, in order, from the model's full logits."""
    logits = model(input_ids=torch.as_tensor(ids)[None], use_cache=False).logits[0, :-1]
    targets = torch.as_tensor(labels[1:])
    keep = targets != IGNORE_INDEX
    return F.log_softmax(logits, -1)[keep].gather(1, targets[keep, None])[:, 0]


def direct_logps(model: torch.nn.Module, pairs: list[tuple], ld_alpha: float | None = None) -> torch.Tensor:
    """(P, 4): chosen and rejected log-probabilities, chosen and rejected token counts. With ``ld_alpha``
    (LD-DPO), (P, 5): the sums weigh each completion's tokens past min(chosen, rejected) tokens by ``ld_alpha``,
    and the fifth column is the chosen completion's unweighted sum."""
    rows = []
    for _, chosen, rejected in pairs:
        tc, tr = token_logps(model, *chosen), token_logps(model, *rejected)
        nc, nr = (torch.tensor(len(t), dtype=tc.dtype) for t in (tc, tr))
        if ld_alpha is None:
            rows.append(torch.stack([tc.sum(), tr.sum(), nc, nr]))
            continue
        shared = min(len(tc), len(tr))
        lc, lr = (t[:shared].sum() + ld_alpha * t[shared:].sum() for t in (tc, tr))
        rows.append(torch.stack([lc, lr, nc, nr, tc.sum()]))
    return torch.stack(rows)


def f_score(x: torch.Tensor, divergence: str, alpha: float) -> torch.Tensor:
    """f'(t) at t = e^x of the f-DPO divergences (Wang et al., 2023)."""
    return {
        "reverse_kl": lambda: x,
        "forward_kl": lambda: 1 - torch.exp(-x),
        "js_divergence": lambda: math.log(2) + torch.log(torch.sigmoid(x)),
        "alpha_divergence": lambda: (torch.exp((alpha - 1) * x) - 1) / (alpha - 1),
    }[divergence]()


def direct_dpo(policy: torch.Tensor, ref: torch.Tensor, loss: DPOLoss) -> torch.Tensor:
    """The DPO losses from their definitions (TRL's; ``sft``: each pair's mean token loss), per pair, summed with
    their weights."""
    beta, eps, tau = loss.beta, loss.label_smoothing, loss.discopop_tau
    c, r = policy[:, 0] - ref[:, 0], policy[:, 1] - ref[:, 1]
    fc, fr = (f_score(x, loss.f_divergence_type, loss.f_alpha_divergence_coef) for x in (c, r))
    z, zbar = fc - fr, fc / policy[:, 2] - fr / policy[:, 3]
    log_sig = lambda x: torch.log(torch.sigmoid(x))  # noqa: E731
    smoothed = lambda d: -(1 - eps) * log_sig(beta * d) - eps * log_sig(-beta * d)  # noqa: E731
    aot = torch.sort(policy[:, 0] - policy[:, 1]).values - torch.sort(ref[:, 0] - ref[:, 1]).values
    mix = torch.sigmoid(beta * z / tau)
    losses = {
        "sigmoid": lambda: smoothed(z),
        "robust": lambda: (-(1 - eps) * log_sig(beta * z) + eps * log_sig(-beta * z)) / (1 - 2 * eps),
        "hinge": lambda: torch.clamp(1 - beta * z, min=0),
        "ipo": lambda: (zbar - 1 / (2 * beta)) ** 2,
        "sigmoid_norm": lambda: -log_sig(beta * zbar),
        "exo_pair": lambda: (
            torch.sigmoid(beta * z) * (log_sig(beta * z) - math.log(1 - eps))
            + torch.sigmoid(-beta * z) * (log_sig(-beta * z) - math.log(eps))
        ),
        "nca_pair": lambda: -log_sig(beta * c) - 0.5 * log_sig(-beta * c) - 0.5 * log_sig(-beta * r),
        "bco_pair": lambda: -log_sig(beta * c) - log_sig(-beta * r),
        "sppo_hard": lambda: (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2,
        "aot": lambda: smoothed(aot),
        "aot_unpaired": lambda: smoothed(torch.sort(c).values - torch.sort(r).values),
        "apo_zero": lambda: 1 - torch.sigmoid(beta * c) + torch.sigmoid(beta * r),
        "apo_down": lambda: torch.sigmoid(beta * c) + 1 - torch.sigmoid(beta * (c - r)),
        "discopop": lambda: -log_sig(beta * z) * (1 - mix) + torch.exp(-beta * z) * mix,
        "sft": lambda: -policy[:, 4 if policy.shape[1] > 4 else 0] / policy[:, 2],  # unweighted under LD-DPO
    }
    types = loss_types(loss.loss_type)
    weights = loss.loss_weights or [1.0] * len(types)
    return sum(w * losses[name]() for name, w in zip(types, weights, strict=True))


def direct_cpo(policy: torch.Tensor, loss: CPOLoss) -> torch.Tensor:
    """CPO's losses from their definitions (TRL's CPO trainer; the NLL per pair; AlphaPO's rewards
    (1 - p^-α)/α of the probabilities p), per pair."""
    beta, eps, alpha = loss.beta, loss.label_smoothing, loss.alpha
    means = loss.loss_type in ("ipo", "simpo")
    chosen, rejected = (
        (policy[:, 0] / policy[:, 2], policy[:, 1] / policy[:, 3]) if means else policy[:, :2].T
    )
    if alpha:
        chosen, rejected = ((1 - torch.exp(logp) ** -alpha) / alpha for logp in (chosen, rejected))
    d = chosen - rejected - (loss.simpo_gamma / beta if loss.loss_type == "simpo" else 0.0)
    preference = {
        "sigmoid": lambda: (
            -(1 - eps) * torch.log(torch.sigmoid(beta * d)) - eps * torch.log(torch.sigmoid(-beta * d))
        ),
        "hinge": lambda: torch.clamp(1 - beta * d, min=0),
        "ipo": lambda: (d - 1 / (2 * beta)) ** 2,
    }[loss.loss_type if loss.loss_type != "simpo" else "sigmoid"]()
    return preference - loss.cpo_alpha * policy[:, 0] / policy[:, 2]


def direct_orpo(policy: torch.Tensor, beta: float) -> torch.Tensor:
    chosen, rejected = policy[:, 0] / policy[:, 2], policy[:, 1] / policy[:, 3]
    odds = (chosen - rejected) - (torch.log(1 - torch.exp(chosen)) - torch.log(1 - torch.exp(rejected)))
    return -chosen - beta * torch.log(torch.sigmoid(odds))


def lora_grads(model: torch.nn.Module) -> torch.Tensor:
    grads = [p.grad.flatten() for n, p in model.named_parameters() if "lora_" in n]
    model.zero_grad(set_to_none=True)
    return torch.cat(grads)


def direct(
    model: torch.nn.Module, pairs: list[tuple], objective, dtype: torch.dtype, ld_alpha: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean loss from the definition (``objective(policy logps, reference logps)``) on a copy of ``model``
    in ``dtype``, and that copy's LoRA gradients."""
    twin = copy.deepcopy(model).to(dtype)
    twin.zero_grad(set_to_none=True)
    with torch.no_grad(), disable_lora(twin):
        ref = direct_logps(twin, pairs, ld_alpha)
    loss = objective(direct_logps(twin, pairs, ld_alpha), ref).mean()
    loss.backward()
    return loss, lora_grads(twin)


def assert_matches_the_definition(
    model, loss: torch.Tensor, pairs: list[tuple], objective, ld_alpha: float | None = None
) -> None:
    """The loss within FP32_MODEL_REL of the fp64 definition; the LoRA gradients within FP32_ROUNDING_FACTOR times
    the spread that FP32 rounding gives the definition (tolerances.fp32_rounding_spread), a bound of the input's
    own conditioning, the same on every CPU.

    The gradients are ill-conditioned, by how much depends on the input: the attention's softmax amplifies
    rounding, and DPO's z cancels digits. Over make_pairs(3, seed) for seeds 0-39, ORPO's spread is 1.3e-6 to
    1.3e-4, and the error of any one FP32 computation falls anywhere up to a few spreads, in a direction set by
    its kernels' summation orders, so by the CPU (LoRA-gradient errors; AVX2: this Xeon's AVX2 kernels)::

        seed   spread    loralei AVX-512   loralei AVX2   plain fp32 AVX-512   plain fp32 AVX2
        1      5.1e-5    1.1e-4            9.9e-6         2.0e-5               4.0e-5
        7      2.9e-5    1.4e-5            8.0e-5         3.6e-5               2.3e-5
        13     2.2e-5    4.3e-5            3.7e-5         4.7e-6               5.7e-6

    Loralei's objective on an fp64 copy of the model (its sums kept in fp64) is at most 1.1e-15 from the
    definition (seeds 0-7, packed and not); with the backbone in fp64 and its chunked head, token sums and loss
    in FP32, at most 4.3e-7 (seeds 1, 5, 7, 13); with the attention modules alone in fp64, at most 4.8e-6: the
    error is the backbone's rounding, in the attention, through the same ops as the definition's."""
    exact_loss, exact_grads = direct(model, pairs, objective, torch.float64, ld_alpha)
    assert_fp32_close(loss, exact_loss, "loss", FP32_MODEL_REL)
    rounded = lambda: direct(model, pairs, objective, torch.float64, ld_alpha)[1]  # noqa: E731
    assert_fp32_rounding_close(lora_grads(model), exact_grads, rounded, "LoRA gradients")


def run_objective(objective, model, batch) -> torch.Tensor:
    loss = objective(model, batch, trainable_labels(batch), count_pairs(batch))
    loss.backward()
    return loss


# every loss type (exo_pair needs ε > 0), label smoothing where read, combinations (MPO's weights; RPO), and the
# f-divergences
LOSSES = [
    DPOLoss(0.5, name, 0.2 if name in ("exo_pair", "robust") else 0.0)
    for name in typing.get_args(DPOLossType)
] + [
    DPOLoss(0.5, "sigmoid", 0.2),
    DPOLoss(0.5, "aot", 0.1),
    DPOLoss(0.5, "aot_unpaired", 0.1),
    DPOLoss(0.5, ["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),
    DPOLoss(0.5, ["sigmoid", "sft"]),
    DPOLoss(0.5, "sigmoid", f_divergence_type="forward_kl"),
    DPOLoss(0.5, ["ipo", "sft"], f_divergence_type="js_divergence"),
    DPOLoss(
        0.5, "discopop", f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3, discopop_tau=0.2
    ),
]


def test_the_cases_cover_every_loss_type_of_the_table_and_the_schema() -> None:
    assert set(DPO_LOSSES) == set(typing.get_args(DPOLossType))
    assert set(F_SCORES) == set(
        typing.get_args(PreferenceSection.model_fields["f_divergence_type"].annotation)
    )
    assert {d.f_divergence_type for d in LOSSES} == set(F_SCORES)


def case_id(loss: DPOLoss) -> str:
    """E.g. ``sigmoid+sft`` or ``discopop-eps0.2-alpha_divergence``."""
    parts = ["+".join(loss_types(loss.loss_type))]
    parts += [f"eps{loss.label_smoothing}"] if loss.label_smoothing else []
    return "-".join(parts + ([loss.f_divergence_type] if loss.f_divergence_type != "reverse_kl" else []))


@pytest.mark.parametrize("loss", LOSSES, ids=case_id)
@pytest.mark.parametrize(("n", "packed"), [(3, False), (4, True), (5, True)])
def test_dpo_loss_and_lora_gradients_equal_the_fp64_definition(loss, n, packed) -> None:
    model = lora_model()
    pairs = make_pairs(n, seed=n)
    objective = DPOObjective(loss, InStepReference(disable_lora), InStepReference(disable_lora))
    loss_value = run_objective(objective, model, collate(pairs, packed))
    definition = lambda policy, ref: direct_dpo(policy, ref, loss)  # noqa: E731
    assert_matches_the_definition(model, loss_value, pairs, definition)


@pytest.mark.parametrize(
    "loss", [DPOLoss(0.5, ["sigmoid", "sft"]), DPOLoss(0.5, "ipo")], ids=lambda loss: case_id(loss)
)
@pytest.mark.parametrize("ld_alpha", [0.0, 0.3])
@pytest.mark.parametrize(("n", "packed"), [(3, False), (5, True)])
def test_ld_dpo_weighs_the_tokens_past_the_shared_length_as_the_definition(loss, ld_alpha, n, packed) -> None:
    """LD-DPO (``preference.ld_alpha``): both models' sums weigh each completion's tokens past the pair's shared
    length (the shorter completion's) by α; ``sft`` stays the unweighted mean; the completions of make_pairs differ
    in length (1 to 5 tokens), so the weighting changes the loss."""
    model = lora_model()
    pairs = make_pairs(n, seed=30 + n)
    reference = InStepReference(disable_lora, ld_alpha)
    objective = DPOObjective(loss, reference, reference, ld_alpha)
    value = run_objective(objective, model, collate(pairs, packed))
    definition = lambda policy, ref: direct_dpo(policy, ref, loss)  # noqa: E731
    assert_matches_the_definition(model, value, pairs, definition, ld_alpha)
    assert abs(value.item() - direct(model, pairs, definition, torch.float64)[0].item()) > 1e-4


def direct_wpo_weights(model: torch.nn.Module, pairs: list[tuple]) -> torch.Tensor:
    """(P,) WPO's pair weights from the definition on an fp64 copy of ``model``: over the pair's completions, the
    product of exp(mean over the completion's tokens of log p(token) - log Σ_v p_v²)."""
    twin = copy.deepcopy(model).double()
    weights = []
    with torch.no_grad():
        for _, *sequences in pairs:
            weight = torch.tensor(1.0, dtype=torch.float64)
            for ids, labels in sequences:
                logits = twin(input_ids=torch.as_tensor(ids)[None], use_cache=False).logits[0, :-1]
                keep = torch.as_tensor(labels[1:]) != IGNORE_INDEX
                sum_sq = torch.log((torch.softmax(logits, -1) ** 2).sum(-1))[keep]
                weight = weight * torch.exp((token_logps(twin, ids, labels) - sum_sq).mean())
            weights.append(weight)
    return torch.stack(weights)


@pytest.mark.parametrize("loss", [DPOLoss(0.5), DPOLoss(0.5, ["sigmoid", "sft"])], ids=case_id)
@pytest.mark.parametrize("ld_alpha", [None, 0.3])
@pytest.mark.parametrize(("n", "packed"), [(3, False), (5, True)])
def test_wpo_weighs_each_pairs_loss_as_the_definition(loss, ld_alpha, n, packed) -> None:
    """WPO (``preference.use_weighting``): each pair's loss times its weight from the policy (no gradient through
    the weight), alone and with LD-DPO's sums."""
    model = lora_model()
    pairs = make_pairs(n, seed=40 + n)
    reference = InStepReference(disable_lora, ld_alpha)
    objective = DPOObjective(loss, reference, reference, ld_alpha, use_weighting=True)
    value = run_objective(objective, model, collate(pairs, packed))
    weights = direct_wpo_weights(model, pairs)
    assert (weights < 0.99).all()  # not 1: the weighting changes the loss
    definition = lambda policy, ref: direct_dpo(policy, ref, loss) * weights  # noqa: E731
    assert_matches_the_definition(model, value, pairs, definition, ld_alpha)


@pytest.mark.parametrize(("n", "packed"), [(3, False), (4, True)])
def test_orpo_loss_and_lora_gradients_equal_the_fp64_definition(n, packed) -> None:
    model, beta = lora_model(), 0.3
    pairs = make_pairs(n, seed=10 + n)
    loss = run_objective(ReferenceFreeObjective(ORPOLoss(beta)), model, collate(pairs, packed))
    assert_matches_the_definition(model, loss, pairs, lambda policy, _ref: direct_orpo(policy, beta))


CPO_LOSSES = [
    CPOLoss(0.5, "sigmoid", 0.2),
    CPOLoss(0.5, "hinge", cpo_alpha=0.0),
    CPOLoss(2.0, "ipo", cpo_alpha=0.5),
    CPOLoss(2.0, "simpo", cpo_alpha=0.0, simpo_gamma=1.0),
    CPOLoss(2.5, "simpo", 0.1),
    CPOLoss(
        2.0, "simpo", cpo_alpha=0.0, alpha=0.25
    ),  # AlphaPO as its paper runs it (TRL's loss_type alphapo)
    CPOLoss(0.5, "sigmoid", alpha=-0.1),
]


@pytest.mark.parametrize(
    "loss",
    CPO_LOSSES,
    ids=lambda c: f"{c.loss_type}-alpha{c.cpo_alpha}-eps{c.label_smoothing}-alphapo{c.alpha}",
)
@pytest.mark.parametrize(("n", "packed"), [(3, False), (4, True)])
def test_cpo_and_simpo_losses_and_lora_gradients_equal_the_fp64_definition(loss, n, packed) -> None:
    model, pairs = lora_model(), make_pairs(n, seed=20 + n)
    value = run_objective(ReferenceFreeObjective(loss), model, collate(pairs, packed))
    assert_matches_the_definition(model, value, pairs, lambda policy, _ref: direct_cpo(policy, loss))


@pytest.mark.parametrize(
    ("loss_type", "eps"),
    [
        ("sigmoid", 0.0),
        ("sigmoid", 0.1),
        ("robust", 0.1),
        ("sigmoid_norm", 0.0),
        ("aot", 0.1),
        ("aot_unpaired", 0.0),
    ],
)
def test_the_first_step_loss_is_ln2_with_a_zero_adapter(loss_type, eps) -> None:
    model = lora_model(zero_b=True)
    objective = DPOObjective(
        DPOLoss(0.1, loss_type, eps), InStepReference(disable_lora), InStepReference(disable_lora)
    )
    loss = run_objective(objective, model, collate(make_pairs(4, 0), packed=True))
    assert abs(loss.item() - math.log(2)) < 1e-6
    rewards = objective.metrics.read()
    assert rewards["rewards/chosen"] == rewards["rewards/rejected"] == rewards["rewards/margins"] == 0.0


def test_metrics_are_trl_names_averaged_over_the_pairs_of_training_steps_only() -> None:
    model = lora_model()
    objective = DPOObjective(DPOLoss(0.5), InStepReference(disable_lora), InStepReference(disable_lora))
    pairs = make_pairs(3, 1)
    batch = collate(pairs, packed=False)
    run_objective(objective, model, batch)
    with torch.no_grad():  # an evaluation batch: not in the training metrics
        objective(model, batch, trainable_labels(batch), 1)
    metrics = objective.metrics.read()
    assert set(metrics) == {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "logits/chosen",
        "logits/rejected",
    }
    exact = copy.deepcopy(model).double()
    policy = direct_logps(exact, pairs).detach()
    with torch.no_grad(), disable_lora(exact):
        ref = direct_logps(exact, pairs)
    chosen, rejected = 0.5 * (policy[:, 0] - ref[:, 0]), 0.5 * (policy[:, 1] - ref[:, 1])
    assert metrics["rewards/margins"] == pytest.approx(float((chosen - rejected).mean()), rel=1e-4)
    assert metrics["rewards/accuracies"] == pytest.approx(float((chosen > rejected).double().mean()))
    assert metrics["logps/chosen"] == pytest.approx(float(policy[:, 0].mean()), rel=1e-5)
    assert objective.metrics.read() == {}  # read once


@pytest.mark.parametrize("packed", [False, True])
def test_a_window_averages_over_pairs_and_counts_the_trained_tokens(packed: bool) -> None:
    """The loss of a preference window is a mean over its pairs, while the run's trainable-token count (its
    ``trainable_tokens_seen``) counts the completion tokens trained, as for SFT."""
    window = [collate(make_pairs(4, seed), packed) for seed in (0, 1)]
    counts = window_counts(window, torch.device("cpu"), count_items=count_pairs)
    assert counts.items == 8
    assert counts.trainable == sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in window) > 8


def direct_mean_logits(model: torch.nn.Module, pairs: list[tuple], completions: bool = True) -> list[float]:
    """TRL's ``logits/chosen`` and ``logits/rejected`` of ``pairs`` from the model's full fp64 logits: the mean
    over the vocabulary and over the tokens predicted on the completions (``completions=False``: over every
    position, the prompt's included, a wrong definition the test must tell apart)."""
    twin = copy.deepcopy(model).double()
    sums, tokens = [0.0, 0.0], [0, 0]
    with torch.no_grad():
        for _, *sequences in pairs:
            for side, (ids, labels) in enumerate(sequences):
                logits = twin(input_ids=torch.as_tensor(ids)[None], use_cache=False).logits[0, :-1]
                keep = torch.as_tensor(labels[1:]) != IGNORE_INDEX if completions else slice(None)
                sums[side] += float(logits[keep].mean(-1).sum())
                tokens[side] += int(logits[keep].shape[0])
    return [total / count for total, count in zip(sums, tokens, strict=True)]


OBJECTIVES = {
    "dpo": lambda: DPOObjective(DPOLoss(0.5), InStepReference(disable_lora), InStepReference(disable_lora)),
    "orpo": lambda: ReferenceFreeObjective(ORPOLoss(0.3)),
    "simpo": lambda: ReferenceFreeObjective(CPOLoss(2.0, "simpo")),
}


# Gemma 2 with a tight final soft-cap: its logits' mean is not the head's column means' dot
MODELS = {"llama": {}, "gemma2": {"final_logit_softcapping": 2.0}}


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@pytest.mark.parametrize(("family", "packed"), [("llama", False), ("llama", True), ("gemma2", False)])
def test_logits_metrics_are_the_mean_full_logit_over_completion_tokens_and_vocabulary(
    name, family, packed
) -> None:
    """Two accumulated batches (a window): the token-weighted mean over both, as one batch of all the pairs."""
    model, objective = lora_model(family=family, **MODELS[family]), OBJECTIVES[name]()
    with torch.no_grad():  # a head whose logits do not average to 0 over the vocabulary
        model.get_output_embeddings().weight.add_(0.05)
    first, second = make_pairs(3, seed=20), make_pairs(2, seed=21)
    for pairs in (first, second):
        run_objective(objective, model, collate(pairs, packed))
    metrics = objective.metrics.read()
    want = direct_mean_logits(model, first + second)
    wrong = direct_mean_logits(model, first + second, completions=False)
    for side, key in enumerate(("logits/chosen", "logits/rejected")):
        assert metrics[key] == pytest.approx(want[side], rel=1e-5, abs=1e-6), key
        assert abs(want[side] - wrong[side]) > 1e-3 * max(abs(want[side]), 1e-3)  # the prompt's tokens matter
        assert abs(want[side]) > 1e-2  # a value left at 0 fails


def test_discopop_and_the_alpha_divergence_stay_finite_far_from_zero() -> None:
    """Far below zero discopop's e^{-βz} overflows FP32 where its weight σ(βz/τ) is 0 (the formula as written gives
    0·inf = NaN there); far above, the alpha divergence's exponent is capped."""

    def terms(loss: DPOLoss, chosen: float) -> tuple[torch.Tensor, torch.Tensor]:
        policy = torch.tensor([chosen, 0.0], requires_grad=True)
        zeros, tokens = torch.zeros(2), torch.full((2,), 10.0)
        losses = loss(
            PairLogps(policy, zeros, tokens, tokens), PairLogps(zeros, zeros, tokens, tokens)
        ).losses
        losses.sum().backward()
        return losses.detach(), policy.grad

    losses, grad = terms(DPOLoss(0.1, "discopop"), -2000.0)
    assert losses[0].item() == pytest.approx(200.0) and losses[1].item() == pytest.approx(
        (math.log(2) + 1) / 2
    )
    assert grad[0].item() == pytest.approx(-0.1) and torch.isfinite(grad).all()
    losses, grad = terms(
        DPOLoss(0.1, "sigmoid", f_divergence_type="alpha_divergence", f_alpha_divergence_coef=3.0), 1e3
    )
    assert torch.isfinite(losses).all() and torch.isfinite(grad).all()


def test_alphapo_rewards_stay_finite_for_long_completions() -> None:
    """AlphaPO's p^-α of a summed log-probability (sigmoid, not length-normalised) overflows FP32 near -355 at
    α 0.25 (TRL's form: inf, then NaN); the capped exponent keeps the loss and its gradient finite, and below the
    cap the reward is (1 - p^-α)/α."""
    loss = CPOLoss(0.5, "sigmoid", alpha=0.25)
    chosen = torch.tensor([-2000.0, -3.0], requires_grad=True)
    rejected, tokens = torch.tensor([-1.0, -2.0]), torch.full((2,), 500.0)
    terms = loss(PairLogps(chosen, rejected, tokens, tokens))
    terms.losses.sum().backward()
    assert torch.isfinite(terms.losses).all() and torch.isfinite(chosen.grad).all()
    want = (1 - math.exp(3.0) ** 0.25) / 0.25
    assert terms.chosen_rewards[1].item() == pytest.approx(0.5 * want, rel=1e-6)


# (objective, its loss, LD-DPO's alpha, WPO): each kind of pass over the pairs
SHARED_CASES = {
    "dpo-sigmoid+sft": (DPOLoss(0.5, ["sigmoid", "sft"]), None, False),
    "dpo-ipo-ld-wpo": (DPOLoss(0.5, "ipo"), 0.3, True),
    "orpo": (ORPOLoss(0.3), None, False),
    "simpo": (CPOLoss(2.0, "simpo", cpo_alpha=0.5, simpo_gamma=1.0), None, False),
}


def _shared_objective(case: str):
    loss, ld_alpha, weighting = SHARED_CASES[case]
    if isinstance(loss, DPOLoss):
        reference = InStepReference(disable_lora, ld_alpha)
        return DPOObjective(loss, reference, reference, ld_alpha, use_weighting=weighting)
    return ReferenceFreeObjective(loss)


@pytest.mark.parametrize(
    ("family", "packed"), [("llama", False), ("qwen3", False), ("mistral", False), ("llama", True)]
)
@pytest.mark.parametrize("case", list(SHARED_CASES))
def test_pairs_with_their_prompt_stored_once_train_as_unshared(family: str, packed: bool, case: str) -> None:
    """``preference.share_prompt``: each pair stored with its prompt once (a row each, or packed two to a row),
    attention over the pair's virtual rows.
    On an fp64 model the loss and every LoRA gradient equal the unshared batch's up to the order of the FP32 sums
    of token log-probabilities (the chunked head's per-token losses are FP32; stored once, a pair's tokens are
    summed in another order: up to 7e-6 of a gradient element, against O(1) for a token attending to the wrong
    ones); on the FP32 model they match the fp64 definition as the unshared ones do."""
    from loralei.train import shared_prompt

    pairs = make_pairs(5, seed=60)
    results = []
    for share in (False, True):
        model = lora_model(family=family).double()
        if share:
            shared_prompt.enable(model)
        value = run_objective(_shared_objective(case), model, collate(pairs, packed, share=share))
        results.append((value.detach(), lora_grads(model)))
    (plain_loss, plain_grads), (loss, grads) = results
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(grads, plain_grads, rtol=2e-5, atol=1e-7)
    _shared_matches_the_definition(family, packed, case, pairs)


def test_through_the_kernels_pairs_stored_once_match_the_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on the FP32 model in Triton's interpreter, where the fused ops and the attention gathers'
    backward run their kernels (``gather_sum``'s torch twin is taken away)."""
    pytest.importorskip("triton")
    from loralei.kernels import gather_sum

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(gather_sum, "_torch_gather_sum", None)
    _shared_matches_the_definition("llama", True, "dpo-sigmoid+sft", make_pairs(5, seed=60))


def _shared_matches_the_definition(family: str, packed: bool, case: str, pairs: list) -> None:
    """The FP32 ``family`` model with ``pairs`` stored with their prompts once: ``case``'s loss and LoRA
    gradients match its fp64 definition."""
    from loralei.train import shared_prompt

    model = lora_model(family=family)
    shared_prompt.enable(model)
    objective = _shared_objective(case)
    value = run_objective(objective, model, collate(pairs, packed, share=True))
    loss, ld_alpha, weighting = SHARED_CASES[case]
    if isinstance(loss, DPOLoss):
        weights = direct_wpo_weights(model, pairs) if weighting else 1.0
        definition = lambda policy, ref: direct_dpo(policy, ref, loss) * weights  # noqa: E731
    elif isinstance(loss, ORPOLoss):
        definition = lambda policy, _ref: direct_orpo(policy, loss.beta)  # noqa: E731
    else:
        definition = lambda policy, _ref: direct_cpo(policy, loss)  # noqa: E731
    assert_matches_the_definition(model, value, pairs, definition, ld_alpha)


@pytest.mark.parametrize(("packed", "share"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("case", ["dpo-ipo-ld-wpo", "orpo"])
def test_the_head_scores_only_the_rows_an_eager_batch_lists_as_trained(
    monkeypatch, packed, share, case
) -> None:
    """The runner's eager steps list each batch's trained positions (``losses.with_trained_rows``, on the host):
    the chunked head scores those rows alone, in the reference's pass and in the policy's (prompts and padding
    skipped), and the loss, WPO's weights, LD-DPO's sums and every LoRA gradient are those of the pass that
    scores every row (on an fp64 model, up to the order of FP32 sums)."""
    from loralei.train import shared_prompt
    from loralei.train.preference import logps

    scored: list[int] = []

    def counting(hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        scored.append(hidden.shape[0])
        return real(hidden, *args, **kwargs)

    real = logps.linear_token_losses
    monkeypatch.setattr(logps, "linear_token_losses", counting)
    batch = collate(make_pairs(5, seed=61), packed, share=share)
    results = []
    for listed in (batch, with_trained_rows(batch)):
        model = lora_model().double()
        if share:
            shared_prompt.enable(model)
        value = run_objective(_shared_objective(case), model, listed)
        results.append((value.detach(), lora_grads(model)))
    rows = batch["input_ids"].numel()
    trained = int((batch_targets(batch, trainable_labels(batch)) != IGNORE_INDEX).sum())
    passes = 2 if case == "dpo-ipo-ld-wpo" else 1  # the reference's, the policy's
    assert trained < rows and scored == [rows] * passes + [trained] * passes
    (every_loss, every_grads), (loss, grads) = results
    torch.testing.assert_close(loss, every_loss, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(grads, every_grads, rtol=2e-5, atol=1e-7)
