"""torch.compile on a fused tiny model: no graph break from loralei's ops, same loss and gradients as eager."""

from __future__ import annotations

import torch

from loralei import LoRAConfig, apply_fused_kernels, inject_lora
from tiny_models import tiny_batch, tiny_model
from tolerances import FP32_REL, rel_err


def _loss_and_grads(forward, model: torch.nn.Module, batch: dict) -> list[torch.Tensor]:
    loss = forward(**batch).loss
    return [loss.detach(), *torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])]


def _fused_model() -> tuple[torch.nn.Module, dict, list[torch.Tensor], str]:
    """A one-layer fused model, a batch, the unfused model's loss and gradients on it, and the fusion report."""
    torch._dynamo.reset()
    model = inject_lora(
        tiny_model("llama", num_hidden_layers=1), LoRAConfig(r=4, init_lora_weights=False)
    ).train()
    # inject_lora's embedding-output requires_grad_ hook (for reentrant checkpointing) is itself a graph break
    model.disable_input_require_grads()
    batch = tiny_batch()
    eager = _loss_and_grads(model, model, batch)
    return model, batch, eager, str(apply_fused_kernels(model))


def test_compiled_fused_model_matches_eager() -> None:
    model, batch, eager, report = _fused_model()
    assert report.count("gated MLP") == 1 and report.count("shared-input group") == 1
    # fullgraph=True: any graph break (e.g. an op Dynamo cannot trace) is an error; aot_eager runs Dynamo and
    # AOTAutograd (where custom ops and their backward are traced) without the slow C++ codegen of Inductor.
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    fused = _loss_and_grads(compiled, model, batch)
    assert max(rel_err(f, e) for f, e in zip(fused, eager, strict=True)) <= FP32_REL


def test_compiled_shared_input_groups_run_their_op_once() -> None:
    """Traced, a group still computes its members' outputs in one op: the graph calls loralei::lora_group once
    (q/k/v) and loralei::lora_w once (o; the gated MLP is its own traced node), not lora_w for each of q, k and
    v; the compiled frame ends holding nothing; loss and gradients as eager."""
    model, batch, eager, _ = _fused_model()
    calls: list[str] = []

    def recording(gm: torch.fx.GraphModule, _inputs) -> torch.fx.GraphModule:
        calls.extend(str(n.target) for n in gm.graph.nodes if str(n.target).startswith("loralei."))
        return gm

    fused = _loss_and_grads(torch.compile(model, backend=recording, fullgraph=True), model, batch)
    assert sorted(calls) == ["loralei.lora_group.default", "loralei.lora_w.default"], calls
    groups = [m.group for m in model.modules() if getattr(m, "group", None) is not None]
    assert groups and all(g._input is None and not g._held for g in groups)
    assert max(rel_err(f, e) for f, e in zip(fused, eager, strict=True)) <= FP32_REL
