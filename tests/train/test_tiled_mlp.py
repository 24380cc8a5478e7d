"""``training.tiled_mlp``: the MLP over sequence tiles gives the untiled loss and gradients (fused and plain MLPs,
MoE blocks, every checkpointing mode), no MLP call sees more than one tile, and the config says when it runs."""

from __future__ import annotations

import pytest
import torch
from test_build import cfg_with
from test_run import losses, make_cfg, run

from loralei.errors import ConfigError
from loralei.train import build, tiled_mlp
from loralei.train.schema import validate_config
from tiny_models import tiny_model, tiny_moe_model

TILE = 8  # tokens per tile in these tests (a real run's tiles are hidden_size long)
LENGTH = 37  # five tiles, the last one short


def _loss_and_grads(
    family: str, tiled: bool, checkpointing: bool | str, fused: bool, monkeypatch, tile_tokens=None
):
    """One forward and backward of the tiny model with LoRA on every projection (and expert banks);
    ``tile_tokens`` replaces the tiles' size function (called on the model before its MLPs are tiled)."""
    monkeypatch.setattr(tiled_mlp, "tile_tokens", tile_tokens or (lambda model: TILE))
    torch.manual_seed(0)
    moe = family == "qwen3_moe"
    model = tiny_moe_model() if moe else tiny_model(family)
    cfg = cfg_with(gradient_checkpointing=checkpointing, fused_lora=fused, tiled_mlp=tiled)
    lora = {"r": 4, "lora_dropout": 0.0}
    if moe:
        lora |= {
            "target_modules": ["q_proj", "v_proj"],
            "target_parameters": ["experts.gate_up_proj", "experts.down_proj"],
        }
    cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update=lora)})
    notes = build.prepare_model(model, cfg, torch.device("cpu"))
    model.train()
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.1)  # B = 0 at init would leave A's gradient zero
    ids = torch.randint(3, 120, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, notes


@pytest.mark.parametrize("checkpointing", [False, True, "offload"])
@pytest.mark.parametrize(
    ("family", "fused"), [("llama", True), ("llama", False), ("qwen3", True), ("qwen3_moe", True)]
)
def test_tiled_equals_untiled(
    family: str, fused: bool, checkpointing, monkeypatch: pytest.MonkeyPatch
) -> None:
    want_loss, want, _ = _loss_and_grads(family, False, checkpointing, fused, monkeypatch)
    seen: list[int] = []
    run_tiles = tiled_mlp._run_tiles

    def spy(forward, spans, x):  # every MLP call inside sees one tile
        return run_tiles(lambda t: seen.append(t.shape[-2]) or forward(t), spans, x)

    monkeypatch.setattr(tiled_mlp, "_run_tiles", spy)
    got_loss, got, notes = _loss_and_grads(family, True, checkpointing, fused, monkeypatch)
    assert "training.tiled_mlp: true: 2 MLPs run in tiles of 8 tokens" in notes
    # each MLP runs its tiles once outside the backward: a checkpoint's recomputation leaves the output unfilled
    assert seen and max(seen) <= TILE and sum(seen) == 2 * LENGTH
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert got.keys() == want.keys() and want
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("checkpointing", [False, "offload"])
def test_the_backward_runs_of_the_tiles_skip_the_down_projection(checkpointing, monkeypatch) -> None:
    """Only the tile's graph is wanted in the backward: the fused MLP leaves its down projection's output
    unfilled there, so the down GEMMs run once per tile, in the forward; loss and gradients stay bit-identical
    to a backward that runs the tiles in full."""
    from loralei.ops import lora_mlp, recompute

    tiles_per_row = -(-LENGTH // TILE)
    layers = 2

    def counted() -> tuple[torch.Tensor, dict, list[int]]:
        calls = [0, 0]  # down outputs computed, deferred ones filled later
        output, defer = lora_mlp.lora_output, recompute.defer

        def spy(*args, **kwargs):
            calls[0] += 1
            return output(*args, **kwargs)

        def deferred(out, fill):
            return defer(out, lambda: calls.__setitem__(1, calls[1] + 1) or fill())

        with monkeypatch.context() as m:
            m.setattr(lora_mlp, "lora_output", spy)
            m.setattr(recompute, "defer", deferred)
            loss, grads, _ = _loss_and_grads("llama", True, checkpointing, True, monkeypatch)
        return loss, grads, calls

    got_loss, got, (outputs, fills) = counted()
    assert fills == 0 and outputs == layers * tiles_per_row  # the forward's tiles only
    # the reference: the backward's tile runs outside any recomputation (as before the skip)
    monkeypatch.setattr(tiled_mlp, "_tile_graph", lambda mlp, forward, xt: torch.enable_grad()(forward)(xt))
    want_loss, want, (outputs, _) = counted()
    assert outputs == 2 * layers * tiles_per_row
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    assert got.keys() == want.keys() and want
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)


def test_a_tile_whose_unfilled_output_a_later_op_saved_runs_again_in_full(monkeypatch) -> None:
    """An MLP that multiplies the fused op's output by a trainable gain saves that output: its first tile in
    the backward runs again in full, its later tiles in full at once, and every gradient (the gain's reads the
    output) is the same as with the backward's tiles run in full."""

    def with_gain() -> tuple[torch.Tensor, dict, int, set]:
        gains, calls = set(), []

        def gained(model: torch.nn.Module) -> int:  # before the tiles wrap each MLP's forward
            for mlp in tiled_mlp.mlp_modules(model):
                inner = vars(mlp).get("forward") or type(mlp).forward.__get__(mlp)
                gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, model.config.hidden_size))
                mlp.register_parameter("gain", gain)
                mlp.forward = lambda x, inner=inner, gain=gain: calls.append(1) or inner(x) * gain
                gains.add(mlp)
            return TILE

        tiled_mlp._READ_AFTER.clear()
        loss, grads, _ = _loss_and_grads("llama", True, False, True, monkeypatch, tile_tokens=gained)
        return loss, grads, len(calls), gains

    got_loss, got, runs, mlps = with_gain()
    tiles_per_row = -(-LENGTH // TILE)
    # forward: every tile; backward: the first tile twice (deferred, then in full), the others once, in full
    assert runs == len(mlps) * (2 * tiles_per_row + 1)
    assert set(tiled_mlp._READ_AFTER) == mlps
    monkeypatch.setattr(tiled_mlp, "_tile_graph", lambda mlp, forward, xt: torch.enable_grad()(forward)(xt))
    want_loss, want, runs, _ = with_gain()
    assert runs == len(mlps) * 2 * tiles_per_row
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    assert got.keys() == want.keys() and any(name.endswith("gain") for name in want)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)


def test_the_backward_runs_each_tile_again_and_never_the_whole_sequence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The node keeps only its input: the backward's second run goes tile by tile too."""
    mlp = torch.nn.Sequential(torch.nn.Linear(6, 20), torch.nn.SiLU(), torch.nn.Linear(20, 6))
    x = torch.randn(2, LENGTH, 6, requires_grad=True)
    want = mlp(x)
    want.sum().backward()
    want_grads = [x.grad.clone(), *(p.grad.clone() for p in mlp.parameters())]
    x.grad = None
    mlp.zero_grad()
    rows: list[int] = []
    inner = mlp.forward
    got = tiled_mlp.tiled_forward(mlp, lambda t: rows.append(t.shape[-2]) or inner(t), TILE, x)
    got.sum().backward()
    assert rows == [8, 8, 8, 8, 5] * 2  # forward, then the backward's run, tile by tile
    # fp32 tolerance, as for the gradients: a BLAS may block a tile's rows otherwise than the whole sequence's
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip([x.grad, *(p.grad for p in mlp.parameters())], want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_run_with_tiles_trains_as_one_without(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiled_mlp, "tile_tokens", lambda model: 4)
    runs = {}
    for tiled in (False, True):
        out = tmp_path / f"tiled-{tiled}"
        lora = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}
        run(make_cfg(out, training={"tiled_mlp": tiled}, lora=lora))
        runs[tiled] = losses(out)
    torch.testing.assert_close(runs[True], runs[False], rtol=1e-5, atol=1e-6)


def _raw(**training) -> dict:
    return {"model": {"name_or_path": "m"}, "data": {"path": "d"}, "training": training, "output_dir": "out"}


@pytest.mark.parametrize(
    ("training", "lora", "message"),
    [
        ({"torch_compile": True}, {}, "training.tiled_mlp: true cannot run here: torch_compile compiles"),
        (
            {},
            {"lora_dropout": 0.1},
            "training.tiled_mlp: true cannot run here: lora.lora_dropout 0.1 would draw",
        ),
    ],
)
def test_true_that_cannot_run_is_an_error(training: dict, lora: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate_config(_raw(tiled_mlp=True, **training) | {"lora": {"r": 2, **lora}})


@pytest.mark.parametrize(
    ("length", "dropout", "note"),
    [
        (4096, 0.0, None),
        (
            32768,
            0.0,
            "training.tiled_mlp: auto -> on (rows of up to 32768 tokens): 2 MLPs run in tiles of 256 tokens",
        ),
        (65536, 0.05, "training.tiled_mlp: auto -> off: lora.lora_dropout 0.05 would draw other masks"),
    ],
)
def test_auto_tiles_long_rows_and_says_so(length: int, dropout: float, note: str | None) -> None:
    model = tiny_model("llama")
    cfg = validate_config(_raw(max_seq_length=length) | {"lora": {"r": 2, "lora_dropout": dropout}})
    notes = [n for n in build.prepare_model(model, cfg, torch.device("cpu")) if n and "tiled_mlp" in n]
    assert (notes[0] if notes else None) == note or notes[0].startswith(note)
