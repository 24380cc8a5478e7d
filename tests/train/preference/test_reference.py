"""The reference policy: precomputed log-probabilities equal those of the step; a reference adapter is loaded
into the policy and swapped in for the reference pass, leaving the trained factors as they were; an adapter that
does not fit is refused naming preference.reference."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from pair_helpers import collate, make_pairs

from loralei import LoRAConfig, disable_lora, inject_lora, save_pretrained
from loralei.checkpoint import lora_state_dict
from loralei.errors import ConfigError
from loralei.train.losses import trainable_labels
from loralei.train.preference import reference as reference_module
from loralei.train.preference.logps import pair_logps
from loralei.train.preference.reference import InStepReference, precompute_reference, reference_context
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def lora_model(r: int = 2, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return inject_lora(
        tiny_model("llama"), LoRAConfig(r=r, init_lora_weights=False, target_modules="all-linear")
    )


@pytest.mark.parametrize("ld_alpha", [None, 0.3])
def test_precomputed_reference_equals_the_one_in_the_step(ld_alpha) -> None:
    model, pairs = lora_model(), make_pairs(5, 3)
    batches = [collate(pairs[:2], packed=True), collate(pairs[2:], packed=False)]
    in_step = InStepReference(disable_lora, ld_alpha)
    table = precompute_reference(model, batches, in_step, 5, torch.device("cpu"))
    for batch in reversed(batches):  # looked up by the pairs' dataset indices, in any order
        labels = trainable_labels(batch)
        computed = in_step.logps(model, batch, labels)
        assert (computed.unweighted_chosen is None) == (ld_alpha is None)
        for stored, value in zip(table.logps(model, batch, labels)[:4], computed[:4], strict=True):
            torch.testing.assert_close(stored, value)


def test_precomputing_shows_a_bar_of_the_pairs(monkeypatch) -> None:
    """A dataset's reference pass can take minutes: it counts its pairs on the setup's progress bar."""
    seen: list = []

    def bar(**kwargs):
        seen.append(kwargs)
        return nullcontext(SimpleNamespace(update=lambda n: seen.append(n)))

    monkeypatch.setattr(reference_module.progress, "bar", bar)
    pairs = make_pairs(5, 3)
    batches = [collate(pairs[:2], packed=True), collate(pairs[2:], packed=False)]
    precompute_reference(lora_model(), batches, InStepReference(disable_lora), 5, torch.device("cpu"))
    assert seen == [{"total": 5, "desc": "reference log-probabilities", "unit": "pair"}, 2, 3]


def test_a_reference_adapter_starts_the_policy_and_is_swapped_in_for_the_reference(tmp_path) -> None:
    saved = save_pretrained(lora_model(seed=1), tmp_path / "sft")
    model = lora_model(seed=2)
    context = reference_context(model, str(saved))
    reference = {name: t.clone() for name, t in lora_state_dict(lora_model(seed=1)).items()}
    for name, tensor in lora_state_dict(model).items():  # the policy starts from the adapter
        torch.testing.assert_close(tensor, reference[name])
    with torch.no_grad():
        for tensor in lora_state_dict(model).values():  # the policy trains away from it
            tensor.add_(0.1)
    trained = {name: t.clone() for name, t in lora_state_dict(model).items()}
    batch = collate(make_pairs(3, 0), packed=True)
    with torch.no_grad(), context(model):
        for name, tensor in lora_state_dict(model).items():
            torch.testing.assert_close(tensor, reference[name])
        ref = pair_logps(model, batch, trainable_labels(batch))
    for name, tensor in lora_state_dict(model).items():
        torch.testing.assert_close(tensor, trained[name])
    expected = pair_logps(lora_model(seed=1), batch, trainable_labels(batch))
    torch.testing.assert_close(ref.chosen, expected.chosen.detach())


def test_an_adapter_that_does_not_fit_is_refused_naming_the_field(tmp_path) -> None:
    saved = save_pretrained(lora_model(r=4), tmp_path / "other")
    with pytest.raises(ConfigError, match=r"preference\.reference: .*r=4.*same lora settings"):
        reference_context(lora_model(r=2), str(saved))


def test_adapter_off_with_pissa_is_the_model_the_policy_started_from() -> None:
    """Switching a PiSSA adapter off would leave the residual base; the reference is the original model."""
    model = inject_lora(tiny_model("llama"), LoRAConfig(r=2, init_lora_weights="pissa"))
    batch = collate(make_pairs(3, 0), packed=True)
    labels = trainable_labels(batch)
    original = pair_logps(tiny_model("llama").requires_grad_(False), batch, labels)
    with torch.no_grad():
        for tensor in lora_state_dict(model).values():  # the policy trains away from its start
            tensor.add_(0.01)
    with torch.no_grad(), reference_context(model, "adapter_off")(model):
        ref = pair_logps(model, batch, labels)
    torch.testing.assert_close(ref.chosen, original.chosen.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref.rejected, original.rejected.detach(), rtol=1e-5, atol=1e-5)
