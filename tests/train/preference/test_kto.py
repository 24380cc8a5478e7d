"""KTO on a tiny model: the loss and its LoRA gradients equal a direct fp64 computation from the definition (TRL's
``loss_type: kto``: full logits, one sequence at a time, the reference with the adapter off, each example's KL
sequence its prompt with the previous example's completion), 0.5 at a zero adapter; the batches, the KL estimate's
clamp and weights, and the metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pair_helpers import VOCAB
from test_objective import assert_matches_the_definition, direct, lora_grads, lora_model, run_objective

from loralei import disable_lora
from loralei.train import distributed
from loralei.train.data import make_collator
from loralei.train.data.kto import KTOCollator
from loralei.train.data.preference_collate import PreferenceCollator
from loralei.train.losses import IGNORE_INDEX, TRAINED_ROWS, trainable_labels, with_trained_rows
from loralei.train.preference.kto import KTOLoss, KTOMetrics, KTOObjective, KTOTerms
from loralei.train.preference.logps import DESIRABLE, PAIR_IDS, SEQUENCE_IDS, PairLogits, PairLogps
from loralei.train.preference.objective import count_pairs
from loralei.train.preference.reference import InStepReference
from tolerances import FP32_MODEL_REL, assert_fp32_close

pytestmark = pytest.mark.usefixtures("one_thread")


def make_examples(n: int, seed: int) -> list[tuple]:
    """``n`` examples ``(index, (ids, labels), desirable, prompt length)``: random prompts and completions,
    desirable or not at random (both kinds in every batch of 3 or more)."""
    rng = np.random.default_rng(seed)
    examples = []
    for i in range(n):
        prompt = rng.integers(3, VOCAB, int(rng.integers(2, 6)))
        completion = rng.integers(3, VOCAB, int(rng.integers(1, 6)))
        ids = np.concatenate([prompt, completion])
        labels = np.where(np.arange(len(ids)) >= len(prompt), ids, IGNORE_INDEX)
        desirable = bool(rng.integers(0, 2)) if i > 1 else i == 0
        examples.append((i, (ids, labels), desirable, len(prompt)))
    return examples


def kto_batch(examples: list[tuple], max_seq_length: int = 64) -> dict[str, torch.Tensor]:
    base = make_collator(
        0, max_seq_length=max_seq_length, pad_to_max_length=False, packed=False, attention_mask=True
    )
    collate = KTOCollator(PreferenceCollator(base), max_seq_length)
    return collate([{"example": example[:3]} for example in examples])


def kl_pairs(examples: list[tuple], max_seq_length: int = 64) -> list[tuple]:
    """Each example beside its KL sequence from the definition: its prompt, then the completion of the example
    before it (the first takes the last one's), cut to ``max_seq_length``."""
    pairs = []
    for k, (index, (ids, labels), _, prompt) in enumerate(examples):
        _, (other_ids, other_labels), _, other_prompt = examples[k - 1]
        kl_ids = np.concatenate([ids[:prompt], other_ids[other_prompt:]])[:max_seq_length]
        kl_labels = np.concatenate([labels[:prompt], other_labels[other_prompt:]])[:max_seq_length]
        pairs.append((index, (ids, labels), (kl_ids, kl_labels)))
    return pairs


def direct_kto(
    policy: torch.Tensor,
    ref: torch.Tensor,
    desirable: torch.Tensor,
    loss: KTOLoss,
    other_ranks: tuple[float, ...] = (),
) -> torch.Tensor:
    """KTO's losses from the definition, per example: ``policy`` and ``ref`` hold each example's summed
    log-probability and its KL sequence's (columns 0 and 1); ``other_ranks``: the other processes' micro batches'
    mean KL log-ratios, with which this one's is averaged before the clamp (TRL's gathered estimate)."""
    r = policy[:, 0] - ref[:, 0]
    if loss.loss_type == "apo_zero_unpaired":  # APO-zero, unpaired: no KL term
        gain = loss.desirable_weight * (1 - torch.sigmoid(loss.beta * r))
        return torch.where(desirable, gain, loss.undesirable_weight * torch.sigmoid(loss.beta * r))
    mine = (policy[:, 1] - ref[:, 1]).detach().mean()
    z = ((mine + sum(other_ranks)) / (1 + len(other_ranks))).clamp(min=0)
    gain = loss.desirable_weight * (1 - torch.sigmoid(loss.beta * (r - z)))
    pain = loss.undesirable_weight * (1 - torch.sigmoid(loss.beta * (z - r)))
    return torch.where(desirable, gain, pain)


LOSSES = [
    KTOLoss(0.5),
    KTOLoss(0.5, 1.5, 0.7),
    KTOLoss(2.0, 1.0, 1.33),
    KTOLoss(0.5, loss_type="apo_zero_unpaired"),
    KTOLoss(2.0, 1.5, 0.7, "apo_zero_unpaired"),
]


# (examples, their seed, the sign of the batch's KL estimate before the clamp on the tiny model's adapter)
BATCHES = [(3, 3, "negative"), (4, 9, "positive"), (6, 19, "positive"), (3, 24, "positive")]


@pytest.mark.parametrize(
    "loss",
    LOSSES,
    ids=lambda loss: f"{loss.loss_type}-beta{loss.beta}-{loss.desirable_weight}-{loss.undesirable_weight}",
)
@pytest.mark.parametrize(("n", "seed", "kl"), BATCHES)
def test_kto_loss_and_lora_gradients_equal_the_fp64_definition(loss, n, seed, kl) -> None:
    """Batches whose KL estimate is clamped (negative) and is not (positive), where the KL sequences' pairing
    decides the loss."""
    model = lora_model()
    examples = make_examples(n, seed)
    objective = KTOObjective(loss, InStepReference(disable_lora), InStepReference(disable_lora))
    value = run_objective(objective, model, kto_batch(examples))
    assert (objective.metrics.read()["kl"] > 0) == (kl == "positive" and loss.uses_kl)
    desirable = torch.tensor([example[2] for example in examples])
    definition = lambda policy, ref: direct_kto(policy, ref, desirable, loss)  # noqa: E731
    assert_matches_the_definition(model, value, kl_pairs(examples), definition)


@pytest.mark.parametrize("other", [-3.0, 0.7])
def test_training_averages_z_over_the_processes_and_evaluation_keeps_its_own(monkeypatch, other) -> None:
    """As TRL gathers it: with two processes, a training micro batch's z is the mean of both processes' estimates
    before the clamp (the other's here ``other``: clamped to 0 together where this one alone is positive, or
    averaged). Evaluation keeps each process's own and runs no collective (a rank may be evaluating an
    uncounted filler batch). The loss and its LoRA gradients equal the fp64 definition with that z."""
    reductions = []

    def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
        reductions.append(value.item())
        return value + other

    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "all_reduce_sum", all_reduce_sum)
    loss, examples = KTOLoss(0.5, 1.5, 0.7), make_examples(4, seed=9)  # its own estimate: positive (BATCHES)
    desirable = torch.tensor([example[2] for example in examples])
    model = lora_model()
    objective = KTOObjective(loss, InStepReference(disable_lora), InStepReference(disable_lora))
    batch = kto_batch(examples)
    with torch.no_grad():
        evaluated = objective(model, batch, trainable_labels(batch), count_pairs(batch))
    assert reductions == []
    own = lambda policy, ref: direct_kto(policy, ref, desirable, loss)  # noqa: E731
    exact, _ = direct(model, kl_pairs(examples), own, torch.float64)
    assert_fp32_close(evaluated, exact, "evaluation loss", FP32_MODEL_REL)
    trained = run_objective(objective, model, batch)
    assert len(reductions) == 1 and reductions[0] > 0
    both = lambda policy, ref: direct_kto(policy, ref, desirable, loss, (other,))  # noqa: E731
    assert_matches_the_definition(model, trained, kl_pairs(examples), both)


def test_a_zero_adapter_gives_one_half() -> None:
    """Every log-ratio and the KL estimate are 0: each example's loss is 1 - σ(0) with its weight."""
    examples = make_examples(5, seed=1)
    objective = KTOObjective(KTOLoss(0.1), InStepReference(disable_lora), InStepReference(disable_lora))
    value = run_objective(objective, lora_model(zero_b=True), kto_batch(examples))
    assert value.item() == pytest.approx(0.5, abs=1e-6)


def test_the_kl_estimate_is_the_batch_mean_clamped_at_zero_and_each_side_weighed() -> None:
    loss = KTOLoss(beta=2.0, desirable_weight=1.5, undesirable_weight=0.5)
    ratios, desirable = torch.tensor([0.3, -0.2, 0.1]), torch.tensor([True, False, True])
    positive = loss(ratios, torch.tensor([0.4, 0.2, 0.3]), desirable)
    assert positive.kl.item() == pytest.approx(0.3)
    want = [
        1.5 * (1 - torch.sigmoid(torch.tensor(2.0 * (0.3 - 0.3)))),
        0.5 * (1 - torch.sigmoid(torch.tensor(1.0))),
    ]
    assert positive.losses[:2].tolist() == pytest.approx([w.item() for w in want])
    assert positive.rewards.tolist() == pytest.approx([0.6, -0.4, 0.2])
    negative = loss(ratios, torch.tensor([-0.4, -0.2, 0.3]), desirable)
    assert negative.kl.item() == 0.0
    assert negative.losses[1].item() == pytest.approx(0.5 * (1 - torch.sigmoid(torch.tensor(0.4))).item())


def test_each_example_is_batched_beside_its_prompt_with_the_previous_completion() -> None:
    """Rows alternate example, KL sequence; a KL sequence longer than max_seq_length is cut; the batch says which
    examples are desirable; a batch of one pairs the example with itself."""
    examples = make_examples(4, seed=3)
    longest = max(len(ids) for _, (ids, _), _, _ in examples)
    for max_seq_length in (64, longest):
        batch = kto_batch(examples, max_seq_length)
        for k, (_, example, kl) in enumerate(kl_pairs(examples, max_seq_length)):
            for row, (ids, labels) in ((2 * k, example), (2 * k + 1, kl)):
                sequence = batch[SEQUENCE_IDS][row]
                assert batch["input_ids"][row][sequence == row].tolist() == ids.tolist()
                assert batch["labels"][row][sequence == row].tolist() == labels.tolist()
        assert batch[DESIRABLE].tolist() == [example[2] for example in examples]
        assert batch[PAIR_IDS].tolist() == [0, 1, 2, 3]
    assert batch["input_ids"].shape[1] <= longest
    single = kto_batch(examples[:1])
    assert torch.equal(single["input_ids"][0], single["input_ids"][1])


def test_metrics_are_means_over_each_side_and_the_kl_over_micro_batches() -> None:
    metrics = KTOMetrics()
    for rewards, kl, desirable in (
        ([1.0, -2.0, 3.0], 0.5, [True, False, True]),
        ([0.0, 4.0, -1.0], 1.5, [False, True, False]),
    ):
        n = len(rewards)
        terms = KTOTerms(torch.zeros(n), torch.tensor(rewards), torch.tensor(kl))
        policy = PairLogps(torch.tensor(rewards) * 10, torch.zeros(n), torch.full((n,), 2.0), torch.ones(n))
        logits = PairLogits(torch.tensor(rewards) * 4, torch.zeros(n))
        metrics.add(terms, policy, logits, torch.tensor(desirable))
    got = metrics.read()
    assert got["rewards/chosen"] == pytest.approx((1 + 3 + 4) / 3)
    assert got["rewards/rejected"] == pytest.approx((-2 + 0 - 1) / 3)
    assert got["rewards/margins"] == pytest.approx(8 / 3 + 1)
    assert got["logps/chosen"] == pytest.approx(80 / 3)
    assert got["logits/chosen"] == pytest.approx(32 / 6)  # per token: two a completion
    assert got["kl"] == pytest.approx(1.0)
    assert metrics.read() == {}


def test_a_batch_listing_its_trained_rows_trains_as_one_that_does_not() -> None:
    """The list of an eager batch's trained positions counts the whole batch's rows; the examples' and the KL
    sequences' passes take every second row, so they leave it out and score every row: the same loss and
    gradients."""
    examples = make_examples(4, seed=3)
    batch = kto_batch(examples)
    results = []
    for listed in (batch, with_trained_rows(batch)):
        model = lora_model()
        objective = KTOObjective(KTOLoss(0.1), InStepReference(disable_lora), InStepReference(disable_lora))
        results.append((run_objective(objective, model, listed).detach(), lora_grads(model)))
    assert TRAINED_ROWS in with_trained_rows(batch)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_apo_zero_unpaired_runs_no_kl_sequence(monkeypatch) -> None:
    """Without a KL term the step runs the reference and the policy over the examples alone (half the rows), and a
    zero adapter gives each example 1 - σ(0) or σ(0): 0.5."""
    from loralei.train.preference import logps

    scored: list[int] = []
    real = logps.linear_token_losses

    def counting(hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        scored.append(hidden.shape[0])
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(logps, "linear_token_losses", counting)
    batch = kto_batch(make_examples(4, seed=2))
    loss = KTOLoss(0.1, loss_type="apo_zero_unpaired")
    objective = KTOObjective(loss, InStepReference(disable_lora), InStepReference(disable_lora))
    value = run_objective(objective, lora_model(zero_b=True), batch)
    assert value.item() == pytest.approx(0.5, abs=1e-6)
    rows = batch["input_ids"].numel()
    assert scored == [
        rows // 2,
        rows // 2,
    ]  # the reference's and the policy's passes, over the examples' rows
    assert objective.metrics.read()["kl"] == 0.0
