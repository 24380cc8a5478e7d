"""Losses: token normalisation over the accumulation window, packed boundaries, CCE and Liger glue."""

from __future__ import annotations

import inspect
import re
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from loralei import LoRAConfig, inject_lora
from loralei.train import losses
from loralei.train.data import DataError
from loralei.train.loop import EvenRuns, LoopSettings, _forward_backward, evaluate
from loralei.train.losses import (
    IGNORE_INDEX,
    check_token_ids,
    count_trainable_tokens,
    cross_entropy_loss,
    trainable_labels,
)
from loralei.train.state import Trainables
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
CPU_LOOP = LoopSettings(1, 2, None, 1, None, None, 3, torch.device("cpu"))


def lora_model():
    torch.manual_seed(0)
    return inject_lora(tiny_model("llama"), LoRAConfig(r=2, init_lora_weights=False))


def batch(labels_kept: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (2, 10), generator=g)
    labels = ids.clone()
    labels[:, : 10 - labels_kept] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def test_cross_entropy_matches_transformers_loss():
    model, b = lora_model(), batch(6, seed=0)
    ours = cross_entropy_loss(model, b, trainable_labels(b), count_trainable_tokens(b))
    theirs = model(input_ids=b["input_ids"], labels=b["labels"]).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)


def test_window_loss_is_normalised_by_all_its_tokens_not_per_micro_batch():
    model = lora_model()
    small, large = batch(2, seed=1), batch(9, seed=2)  # 2 vs 16 trainable positions
    objs = Trainables(model, optimizer=None, scheduler=None)
    loss, _, trainable = _forward_backward(objs, [small, large], cross_entropy_loss, CPU_LOOP)
    window = grads(model)
    assert trainable == count_trainable_tokens(small) + count_trainable_tokens(large)

    joined = {k: torch.cat([small[k], large[k]]) for k in small}
    full = cross_entropy_loss(model, joined, trainable_labels(joined), count_trainable_tokens(joined))
    full.backward()
    reference = grads(model)
    torch.testing.assert_close(loss, full.detach(), rtol=1e-5, atol=0)
    for name in reference:
        torch.testing.assert_close(window[name], reference[name], rtol=1e-5, atol=1e-9)

    # the per-micro-batch mean (the bug this guards against) gives a clearly different gradient
    for part in (small, large):
        (cross_entropy_loss(model, part, trainable_labels(part), count_trainable_tokens(part)) / 2).backward()
    per_micro = grads(model)
    assert any(not torch.allclose(per_micro[n], reference[n], rtol=1e-2) for n in reference)


def test_first_token_of_each_packed_sample_is_never_a_target():
    ids = torch.arange(3, 10).unsqueeze(0)
    b = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3]])}
    targets = losses.shift_targets(trainable_labels(b))
    assert targets.tolist() == [[4, 5, IGNORE_INDEX, 7, 8, 9, IGNORE_INDEX]]
    assert count_trainable_tokens(b) == 5


def fake_cce(calls: list) -> types.ModuleType:
    """A stand-in for cut_cross_entropy with the real call signature (checked below), in plain torch."""

    def linear_cross_entropy(
        e,
        c,
        targets,
        ignore_index=-100,
        softcap=None,
        reduction="mean",
        shift=False,
        filter_eps="high",
        impl="cce",
    ):
        calls.append({"e": e.shape, "c": c.shape, "impl": impl, "reduction": reduction})
        logits = (e @ c.T).float()
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            targets.flatten(),
            ignore_index=ignore_index,
            reduction=reduction,
        )

    return types.SimpleNamespace(linear_cross_entropy=linear_cross_entropy)


def test_stand_in_has_the_real_signature():
    real = pytest.importorskip("cut_cross_entropy").linear_cross_entropy
    fake = fake_cce([]).linear_cross_entropy
    assert list(inspect.signature(fake).parameters) == list(inspect.signature(real).parameters)


def test_cut_cross_entropy_uses_hidden_states_and_head_weight(monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", fake_cce(calls))
    model, b = lora_model(), batch(6, seed=3)
    head_calls = []
    model.get_output_embeddings().register_forward_hook(lambda *a: head_calls.append(1))
    n = count_trainable_tokens(b)
    cce = losses.build_loss("cut_cross_entropy", liger=False, cce_impl="cce_exact")(
        model, b, trainable_labels(b), n
    )
    assert head_calls == []  # the full logits were never computed
    assert calls == [{"e": (20, 32), "c": (128, 32), "impl": "cce_exact", "reduction": "sum"}]
    torch.testing.assert_close(cce, cross_entropy_loss(model, b, trainable_labels(b), n), rtol=1e-5, atol=0)


def test_liger_is_applied_to_the_instance_and_its_loss_is_normalised(monkeypatch):
    applied = {}
    package = types.ModuleType("liger_kernel")
    integration = types.ModuleType("liger_kernel.transformers")
    integration._apply_liger_kernel_to_instance = lambda **kw: applied.update(kw)
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", integration)
    model = tiny_model("llama")
    losses.apply_liger(model, layers=False)
    assert applied["model"] is model and applied["fused_linear_cross_entropy"] is True
    assert not any(applied[k] for k in ("rms_norm", "rope", "swiglu", "geglu"))

    # Unpatched, the model's own loss takes the same num_items_in_batch contract the Liger forward does.
    model, b = lora_model(), batch(5, seed=4)
    n = 3 * count_trainable_tokens(b)
    torch.testing.assert_close(
        losses.liger_loss(model, b, trainable_labels(b), n),
        cross_entropy_loss(model, b, trainable_labels(b), n),
        rtol=1e-5,
        atol=0,
    )


def test_missing_packages_raise_config_errors(monkeypatch):
    from loralei.errors import ConfigError

    monkeypatch.setitem(sys.modules, "cut_cross_entropy", None)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    with pytest.raises(ConfigError, match=r"pip install 'loralei\[cce\]'"):
        losses.build_loss("cut_cross_entropy", liger=False)
    with pytest.raises(ConfigError, match=r"pip install 'loralei\[liger\]'"):
        losses.apply_liger(tiny_model("llama"), layers=True)


def test_real_cut_cross_entropy_matches_cross_entropy():
    pytest.importorskip("cut_cross_entropy")
    model, b = lora_model(), batch(6, seed=5)
    n = count_trainable_tokens(b)
    # "torch_compile" is the package's CPU-capable implementation; "cce" needs a CUDA GPU.
    cce = losses.build_loss("cut_cross_entropy", liger=False, cce_impl="torch_compile")
    expected = cross_entropy_loss(model, b, trainable_labels(b), n)
    torch.testing.assert_close(cce(model, b, trainable_labels(b), n), expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("liger", [False, True])
def test_linear_cross_entropy_matches_cross_entropy_loss_and_grads(liger):
    model, b = lora_model(), batch(6, seed=6)
    n, labels = count_trainable_tokens(b), trainable_labels(b)
    lce = losses.build_loss("linear_cross_entropy", liger=liger)  # with Liger on, its norms only: this loss
    assert lce is losses.linear_cross_entropy_loss
    lce(model, b, labels, n).backward()
    ours = grads(model)
    expected = cross_entropy_loss(model, b, labels, n)
    expected.backward()
    theirs = grads(model)
    torch.testing.assert_close(lce(model, b, labels, n), expected, rtol=1e-5, atol=0)
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", ["linear_cross_entropy", "cut_cross_entropy"])
def test_the_head_losses_score_only_the_rows_a_batch_lists_as_trained(monkeypatch, name):
    """An eager step's batch lists its trained positions (``with_trained_rows``, on the host): the losses that
    apply the head themselves score those rows alone (prompt tokens and padding skipped), with the loss and LoRA
    gradients of every row scored."""
    calls: list = []
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", fake_cce(calls))
    real = losses.linear_cross_entropy

    def counting(hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        calls.append({"e": hidden.shape})
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(losses, "linear_cross_entropy", counting)
    model, b = lora_model(), batch(6, seed=7)
    b["attention_mask"][1, :3] = 0  # left padding, no label there either
    loss_fn = losses.build_loss(name, liger=False, cce_impl="cce_exact")
    n, labels = count_trainable_tokens(b), trainable_labels(b)
    listed = losses.with_trained_rows(b)
    # position t is trained when token t + 1 is: tokens 4-9 of each row
    assert listed[losses.TRAINED_ROWS].tolist() == [3, 4, 5, 6, 7, 8, 13, 14, 15, 16, 17, 18]
    every = loss_fn(model, b, labels, n)
    every.backward()
    every_grads = grads(model)
    few = loss_fn(model, listed, labels, n)
    few.backward()
    few_grads = grads(model)
    assert [call["e"][0] for call in calls] == [20, n]
    torch.testing.assert_close(few, every, rtol=1e-6, atol=0)
    for name_, grad in every_grads.items():
        torch.testing.assert_close(few_grads[name_], grad, rtol=1e-5, atol=1e-8, msg=name_)


def test_an_eager_step_and_evaluation_list_the_trained_rows_for_the_loss() -> None:
    seen: list = []

    def loss_fn(model, b, labels, n) -> torch.Tensor:
        seen.append(b[losses.TRAINED_ROWS].tolist())
        return cross_entropy_loss(model, b, labels, n)

    model, b = lora_model(), batch(4, seed=0)
    _forward_backward(Trainables(model, optimizer=None, scheduler=None), [b], loss_fn, CPU_LOOP)
    evaluate(model, [b], loss_fn, torch.device("cpu"))
    assert seen == [[5, 6, 7, 8, 15, 16, 17, 18]] * 2


def test_linear_cross_entropy_refuses_a_head_it_cannot_apply():
    from loralei.errors import ConfigError

    model, b = lora_model(), batch(6, seed=7)
    model.config.output_router_logits = True
    with pytest.raises(ConfigError, match="load-balancing"):
        losses.linear_cross_entropy_loss(model, b, trainable_labels(b), 1)
    model.config.output_router_logits = False
    model.lm_head = torch.nn.Sequential(model.lm_head)
    with pytest.raises(ConfigError, match=r"plain nn\.Linear head, but this model.s head is Sequential"):
        losses.linear_cross_entropy_loss(model, b, trainable_labels(b), 1)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("input_ids", 128, "input_ids: token id 128 is outside the model's vocabulary [0, 128); check that"),
        (
            "input_ids",
            -100,
            "input_ids: token id -100 is outside the model's vocabulary [0, 128); check that",
        ),
        (
            "labels",
            300,
            "labels: token id 300 is outside the model's vocabulary [0, 128) and is not the ignore",
        ),
        (
            "labels",
            -5,
            "labels: token id -5 is outside the model's vocabulary [0, 128) and is not the ignore",
        ),
    ],
)
def test_token_ids_are_checked_on_the_host_before_the_device_sees_them(field, value, message) -> None:
    b = batch(4, seed=0)
    check_token_ids(b, 128)  # ids in range and ignored labels pass
    b[field][1, 3] = value
    with pytest.raises(DataError, match=re.escape(message)):
        check_token_ids(b, 128)


def test_the_loop_checks_every_micro_batch_of_a_window() -> None:
    model, bad = lora_model(), batch(4, seed=1)
    bad["labels"][0, -1] = 128
    settings = LoopSettings(1, 2, None, 1, None, None, 3, torch.device("cpu"), vocab_size=128)
    objs = Trainables(model, optimizer=None, scheduler=None)
    with pytest.raises(DataError, match="labels: token id 128"):
        _forward_backward(objs, [batch(4, seed=0), bad], cross_entropy_loss, settings)
    assert grads(model) == {}  # nothing ran before the check


def test_evaluation_checks_its_batches_too() -> None:
    bad = batch(4, seed=1)
    bad["input_ids"][0, 0] = 500
    with pytest.raises(DataError, match="input_ids: token id 500"):
        evaluate(lora_model(), [bad], cross_entropy_loss, torch.device("cpu"), vocab_size=128)


def test_evaluation_runs_fillers_up_to_every_ranks_count_and_does_not_count_them() -> None:
    """A rank whose last global batch was empty runs the filler as often as it lacks batches (FSDP2's gathers
    wait for every rank's forward); the loss is this rank's batches' alone."""
    model, ran = lora_model(), []

    def loss_fn(*args: object) -> torch.Tensor:
        ran.append("filler" if torch.equal(args[1]["input_ids"], filler["input_ids"]) else "mine")
        return cross_entropy_loss(*args)

    mine, filler = batch(4, seed=0), batch(2, seed=3)
    alone = evaluate(model, [mine], cross_entropy_loss, torch.device("cpu"))
    evened = evaluate(model, [mine], loss_fn, torch.device("cpu"), even=EvenRuns(3, lambda: filler))
    assert ran == ["mine", "filler", "filler"] and evened == alone
    ran.clear()
    evaluate(model, [mine] * 3, loss_fn, torch.device("cpu"), even=EvenRuns(3, lambda: filler))
    assert ran == ["mine"] * 3
