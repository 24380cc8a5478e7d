"""bench_train_step's peft-gptq row: PEFT LoRA on the GPTQ copy of the shape's checkpoint. The plumbing (a child
that imports gptqmodel first, a checkpoint-loading row) is checked everywhere; the model itself only where
gptqmodel and optimum are installed (the GPU run carries them as wheels; CI has neither)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_bench_train_step import run_gpu_calls

from checkpoint_quant import gptq_reference

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train_step.py"


def _load_bench():
    """The benchmark script as a module; it puts its folder (bench_rows, gptq_checkpoint) on sys.path."""
    spec = importlib.util.spec_from_file_location("bench_train_step", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_peft_gptq_runs_in_a_child_that_imports_gptqmodel_first() -> None:
    bench = _load_bench()
    args = bench.parse_args(["--tiny", "--rows", "peft-bf16-adapters", "peft-gptq"])
    assert bench.child_groups(args) == {"gptqmodel": ["peft-gptq"]}
    with pytest.raises(SystemExit):  # it loads a checkpoint: not an interleaved row
        bench.parse_args(["--tiny", "--interleave", "--rows", "peft-bf16-adapters", "peft-gptq"])


def test_peft_gptq_trains_lora_on_gptqmodel_layers_of_the_gptq_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every target projection is PEFT's GPTQ LoRA layer around a gptqmodel quantized linear read from the GPTQ copy
    written beside the checkpoint; that linear computes x @ W^T with the copy's dequantized W, and one backward
    reaches every LoRA factor (layer 0's through the later layers' quantized linears)."""
    pytest.importorskip("optimum")
    quant_linear = pytest.importorskip("gptqmodel.nn_modules.qlinear").BaseQuantLinear
    from peft.tuners.lora.gptq import GPTQLoraLinear

    monkeypatch.setattr(
        torch._dynamo.config, "disable", True
    )  # gptqmodel compiles its dequantization: minutes on CPU
    _load_bench()
    rows = importlib.import_module("bench_rows")
    cpu, checkpoint = torch.device("cpu"), tmp_path / "ckpt"
    rows.save_checkpoint("tiny", checkpoint, cpu, torch.float32)
    model = rows.prepared_model("tiny", "peft-gptq", False, False, cpu, torch.float32, checkpoint)

    layers = {n: m for n, m in model.named_modules() if isinstance(m, GPTQLoraLinear)}
    assert len(layers) == 2 * len(rows.TARGETS)
    assert all(isinstance(m.get_base_layer(), quant_linear) for m in layers.values())
    name = "model.layers.0.mlp.down_proj"
    packed = load_file(next((tmp_path / "ckpt-gptq").glob("*.safetensors")))
    parts = {p: packed[f"{name}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx")}
    weight = gptq_reference(parts, 1, torch.float16).float()  # gptqmodel dequantizes in the scales' fp16
    x = torch.randn(3, weight.shape[1])
    base = next(m for n, m in layers.items() if n.endswith(name)).get_base_layer()
    torch.testing.assert_close(base(x), x @ weight.t(), rtol=1e-6, atol=1e-6)

    for module in layers.values():  # nonzero B, so that A's gradients are nonzero too
        torch.nn.init.normal_(module.lora_B["default"].weight)
    ids = torch.randint(0, 256, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert len(grads) == 4 * len(rows.TARGETS)
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_run_gpu_gptq_bar_times_peft_on_the_runners_gptq_copy(tmp_path: Path) -> None:
    """run_gpu.sh's gptq-bar: the runner on NF4 and on the GPTQ copy, off and offloaded, then PEFT on that copy
    (bench_train_step derives CHECKPOINT-gptq from the same $ckpt), checkpointing off and on (python3 stubbed)."""
    calls = run_gpu_calls(tmp_path, "gptq-bar")
    runner, peft = calls[:4], calls[4:]
    assert [c[1] for c in runner] == ["benchmarks/bench_runner.py"] * 4
    assert [("--gptq" in c, c[c.index("--checkpointing") + 1]) for c in runner] == [
        (False, "off"),
        (True, "off"),
        (False, "offload"),
        (True, "offload"),
    ]
    assert len(peft) == 1 and peft[0][1] == "benchmarks/bench_train_step.py"
    flag = {
        k: peft[0][peft[0].index(k) + 1]
        for k in ("--shape", "--rows", "--checkpointing", "--steps", "--warmup")
    }
    assert flag == {
        "--shape": "llama3-8b",
        "--rows": "peft-gptq",
        "--checkpointing": "both",
        "--steps": "5",
        "--warmup": "2",
    }
    ckpt = {c[c.index("--model-dir") + 1] for c in runner} | {peft[0][peft[0].index("--checkpoint-dir") + 1]}
    assert ckpt == {"/tmp/bench-ckpt-llama3-8b"}


def test_run_gpu_builds_the_carried_pypcre_sdist_into_the_site(tmp_path: Path) -> None:
    """With .whl/src/ holding pypcre's sdist and a setuptools wheel, run_gpu.sh installs the wheels, then builds
    pypcre offline without build isolation against the carried setuptools and installs it beside them."""
    (tmp_path / ".whl" / "src").mkdir(parents=True)
    for name in (
        "optimum-2.3.0-py3-none-any.whl",
        "src/pypcre-0.6.4.tar.gz",
        "src/setuptools-80.9.0-py3-none-any.whl",
    ):
        (tmp_path / ".whl" / name).write_bytes(b"")
    pips = [c[3:] for c in run_gpu_calls(tmp_path, "no-such-part") if c[1:3] == ["-m", "pip"]]
    assert [(c[0], c[-1]) for c in pips] == [
        ("install", ".whl/optimum-2.3.0-py3-none-any.whl"),
        ("install", ".whl/src/setuptools-80.9.0-py3-none-any.whl"),
        ("wheel", ".whl/src/pypcre-0.6.4.tar.gz"),
        ("install", "/tmp/pcre-wheel/pypcre-*.whl"),
    ]
    assert {"--no-index", "--no-build-isolation"} <= set(pips[2])
    assert all(c[c.index("--target") + 1] == "/tmp/site" for c in (pips[0], pips[3]))
