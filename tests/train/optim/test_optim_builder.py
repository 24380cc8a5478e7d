import pytest
import torch

from loralei import ConfigError, LoRAConfig, count_parameters, inject_lora, lora_modules
from loralei.train.optim import OPTIMIZERS, PoLoRA, SkipStepAdamW, build_optimizer
from tiny_models import tiny_batch, tiny_model, tiny_moe_model
from tolerances import assert_fp32_close


def _lora_model(**config) -> torch.nn.Module:
    return inject_lora(tiny_model("llama"), LoRAConfig(r=4, lora_alpha=8, **config))


def _ids(params: list[torch.Tensor]) -> set[int]:
    return {id(p) for p in params}


def _optimized(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def test_adamw_is_torch_adamw_over_the_trainable_parameters_only() -> None:
    model = _lora_model()
    opt = build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.01, kwargs={"amsgrad": True})
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert group["foreach"] is True  # CPU parameters: the multi-tensor path, not the CUDA-only fused one
    assert group["amsgrad"] is True
    assert group["weight_decay"] == 0.01
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert _ids(_optimized(opt)) == _ids(trainable)
    assert sum(p.numel() for p in _optimized(opt)) == count_parameters(model).trainable


def test_skipstepadamw_takes_its_options_from_kwargs() -> None:
    opt = build_optimizer(
        _lora_model(), "skipstepadamw", lr=1e-3, kwargs={"sigma": 4.0, "window": 32, "warmup": 8}
    )
    assert isinstance(opt, SkipStepAdamW)
    assert (opt.sigma, opt.window, opt.warmup) == (4.0, 32, 8)


@pytest.mark.parametrize("use_rslora", [False, True])
def test_polora_pairs_every_lora_module_with_its_scale(use_rslora: bool) -> None:
    model = _lora_model(use_rslora=use_rslora)
    model.model.norm.weight.requires_grad_(True)  # a trainable non-LoRA parameter
    opt = build_optimizer(model, "polora", lr=1e-3, kwargs={"scale_invariant": True})
    assert isinstance(opt, PoLoRA)
    paired, plain = opt.param_groups
    modules = [module for _, module in lora_modules(model)]
    expected = [t for m in modules for t in (m.lora_A.weight, m.lora_B.weight)]
    assert [id(p) for p in paired["params"]] == [id(p) for p in expected]
    assert paired["scale"] == modules[0].scale == (8 / 2 if use_rslora else 8 / 4)
    assert paired["scale_invariant"] is True
    assert [id(p) for p in plain["params"]] == [id(model.model.norm.weight)]
    assert not plain["paired"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_trains_a_tiny_model(name: str) -> None:
    model = _lora_model(init_lora_weights="gaussian")
    model.train()
    opt = build_optimizer(model, name, lr=1e-2)
    batch = tiny_batch()
    losses = []
    for _ in range(8):
        loss = model(**batch).loss
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < losses[0] - 0.05


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("adamww", {}, 'optimizer.name: unknown optimizer .*did you mean "adamw"'),
        (
            "skipstepadamw",
            {"kwargs": {"sigam": 3.0}},
            'optimizer.kwargs.sigam: unknown option.*did you mean "sigma"',
        ),
        ("polora", {"kwargs": {"sigma": 3.0}}, "optimizer.kwargs.sigma: unknown option for 'polora'"),
        (
            "skipstepadamw",
            {"kwargs": {"sigma": -1}},
            r"optimizer.kwargs.sigma: must be a number in \(0, inf\]",
        ),
        ("polora", {"kwargs": {"mode": "adam"}}, 'optimizer.kwargs.mode: must be one of adamw, sgd.*"adamw"'),
        ("adamw", {"kwargs": {"amsgrad": "yes"}}, "optimizer.kwargs.amsgrad: must be true or false"),
        ("adamw", {"lr": -1.0}, "optimizer.lr: must be a number"),
        ("polora", {"betas": (0.9, 1.5)}, "optimizer.betas: must be two numbers in"),
    ],
)
def test_bad_settings_name_the_field(name: str, options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_optimizer(_lora_model(), name, **({"lr": 1e-3} | options))


def test_all_unknown_kwargs_are_reported_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        build_optimizer(_lora_model(), "polora", lr=1e-3, kwargs={"detla": 1e-6, "mod": "sgd"})
    assert "optimizer.kwargs.detla" in str(err.value)
    assert "optimizer.kwargs.mod" in str(err.value)


def test_polora_without_lora_and_a_frozen_model_are_clear_errors() -> None:
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match=r'optimizer.name: "polora" .*no trainable LoRA modules'):
        build_optimizer(model, "polora", lr=1e-3)
    model.requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        build_optimizer(model, "adamw", lr=1e-3)


@pytest.mark.parametrize("name", ["adamw", "skipstepadamw"])
def test_loraplus_gives_the_b_factors_a_larger_learning_rate(name) -> None:
    """LoRA+: B in its own group at ratio x lr; Adam's first step moves each parameter by its group's lr times
    the same normalised direction, so B moves ratio times as far as without LoRA+ and A as far."""

    def first_step(ratio):
        torch.manual_seed(0)
        model = _lora_model()
        for _, module in lora_modules(model):
            module.lora_B.weight.data.normal_(0, 0.1)
        opt = build_optimizer(model, name, lr=1e-3, loraplus_lr_ratio=ratio)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        model(**tiny_batch()).loss.backward()
        opt.step()
        return model, opt, {n: p.detach() - before[n] for n, p in model.named_parameters() if p.requires_grad}

    model, opt, moved = first_step(16.0)
    _, _, plain = first_step(None)
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 16e-3]
    b = {n for n, p in model.named_parameters() if id(p) in _ids(opt.param_groups[1]["params"])}
    assert b == {n for n in moved if "lora_B" in n} and b
    for n, delta in moved.items():
        scale = 16.0 if n in b else 1.0
        torch.testing.assert_close(delta, plain[n] * scale, rtol=1e-4, atol=1e-9, msg=n)


@pytest.mark.parametrize("mode", ["adamw", "sgd"])
def test_loraplus_with_polora_steps_b_at_the_ratio_after_preconditioning(mode) -> None:
    """PoLoRA preconditions each pair as before (the directions do not depend on the learning rates), then B
    steps at ratio x lr: on the first step (Adam: normalised direction; SGD: the direction itself) B moves ratio
    times as far as without LoRA+ and A as far."""
    lr = 1e-3 if mode == "adamw" else 1e-1

    def first_step(ratio):
        torch.manual_seed(0)
        model = _lora_model()
        for _, module in lora_modules(model):
            module.lora_B.weight.data.normal_(0, 0.1)
        opt = build_optimizer(model, "polora", lr=lr, loraplus_lr_ratio=ratio, kwargs={"mode": mode})
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        model(**tiny_batch()).loss.backward()
        opt.step()
        return opt, {n: p.detach() - before[n] for n, p in model.named_parameters() if p.requires_grad}

    opt, moved = first_step(16.0)
    _, plain = first_step(None)
    assert [(g["lr"], g["b_lr_ratio"]) for g in opt.param_groups] == [(lr, 16.0)]
    assert any("lora_B" in n for n in moved) and any("lora_A" in n for n in moved)
    for n, delta in moved.items():  # norm-wise: an element's step may be near the factor's FP32 rounding
        assert_fp32_close(delta, plain[n] * (16.0 if "lora_B" in n else 1.0), n, tolerance=1e-4)


def test_loraplus_with_polora_gives_unpaired_b_factors_their_own_group() -> None:
    model = inject_lora(
        tiny_moe_model(), LoRAConfig(r=4, target_modules=["q_proj"], target_parameters=["experts.down_proj"])
    )
    opt = build_optimizer(model, "polora", lr=1e-3, loraplus_lr_ratio=4.0)
    paired, plain, b = opt.param_groups
    assert paired["paired"] and paired["b_lr_ratio"] == 4.0
    assert not plain["paired"] and not b["paired"] and b["lr"] == 4e-3
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(".lora_B." in names[id(p)] for p in b["params"]) and b["params"]
    assert all(".lora_A." in names[id(p)] for p in plain["params"]) and plain["params"]
