"""Building a run from its config: model preparation wiring, step counts, output-dir rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import loralei
from loralei.config import LoRAConfig
from loralei.errors import ConfigError, InjectionError
from loralei.inject import lora_expert_modules, lora_modules
from loralei.train import build
from loralei.train.output_dir import claim, plan_output_dir
from loralei.train.schema import validate_config
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def cfg_with(tmp_path=None, **training):
    raw = {
        "model": {"name_or_path": "m"},
        "data": {"path": "d"},
        "lora": {"r": 2},
        "training": training,
        "output_dir": str(tmp_path or "out"),
    }
    return validate_config(raw)


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        (True, {"qkv": True, "shared_input_groups": "auto"}),
        (False, {"qkv": False, "shared_input_groups": None}),
        (
            [{"parent_name": "self_attn", "projection_names": ["q_proj", "k_proj"]}],
            {
                "qkv": True,
                "shared_input_groups": [
                    {"parent_name": "self_attn", "projection_names": ["q_proj", "k_proj"]}
                ],
            },
        ),
    ],
)
def test_fused_kernel_options_reach_apply_fused_kernels(monkeypatch, option, expected):
    calls = []
    monkeypatch.setattr(
        loralei, "apply_fused_kernels", lambda model, **kw: calls.append(kw) or "report", raising=False
    )
    notes = build.prepare_model(
        tiny_model("llama"), cfg_with(fused_shared_input_lora=option), torch.device("cpu")
    )
    assert calls == [{"mlp": True, "o": True, **expected}] and "report" in notes


def test_prepare_model_wires_checkpointing_compile_and_frozen_head(monkeypatch):
    model = tiny_model("llama")
    compiled = []
    for layer in model.model.layers:
        monkeypatch.setattr(layer, "compile", lambda: compiled.append(True), raising=False)
    cfg = cfg_with(gradient_checkpointing=True, torch_compile=True, fused_lora=False)
    notes = build.prepare_model(model, cfg, torch.device("cpu"))
    assert model.is_gradient_checkpointing and compiled == [True, True]  # the name Transformers 5.0+ all have
    assert "2 decoder layers compiled one by one with torch.compile" in notes
    assert model.config.use_cache is False
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)


def test_total_steps():
    assert build.total_steps(cfg_with(max_steps=7), batches_per_epoch=100) == 7
    assert build.total_steps(cfg_with(num_epochs=2, gradient_accumulation_steps=4), batches_per_epoch=10) == 5
    assert build.total_steps(cfg_with(num_epochs=0.5), batches_per_epoch=3) == 2


def test_resolve_dtype():
    assert build.resolve_dtype("bfloat16") is torch.bfloat16
    assert build.resolve_dtype("auto") in (torch.float32, torch.bfloat16)


def test_unrelated_files_in_the_output_dir_are_left_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    assert plan_output_dir(cfg_with(tmp_path)).action == "fresh"
    (tmp_path / "log.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="already holds an unfinished run with no checkpoint"):
        plan_output_dir(cfg_with(tmp_path))
    overwrite = validate_config(
        {**cfg_with(tmp_path).model_dump(exclude={"lora"}), "overwrite_output_dir": True}
    )
    held, _ = claim(overwrite, plan_output_dir(overwrite))
    held.progressed()
    assert (tmp_path / "notes.txt").read_text() == "mine" and not (tmp_path / "log.jsonl").exists()


def test_tokenizer_errors_name_the_key_that_gave_the_source(tmp_path):
    empty = str(tmp_path)  # a local directory without tokenizer files: fails without any download
    raw = {"model": {"name_or_path": empty}, "data": {"path": "d"}, "output_dir": str(tmp_path / "o")}
    with pytest.raises(ConfigError, match=r"^model\.name_or_path: cannot load a tokenizer"):
        build.load_tokenizer(validate_config(raw))
    raw["model"]["tokenizer"] = empty
    with pytest.raises(ConfigError, match=r"^model\.tokenizer: cannot load a tokenizer"):
        build.load_tokenizer(validate_config(raw))


MOE_MODEL = Path(__file__).resolve().parents[2] / "examples" / "quickstart-moe" / "model"
EXPERT_BANKS = ["experts.gate_up_proj", "experts.down_proj"]


def moe_cfg(**lora):
    raw = {"model": {"name_or_path": str(MOE_MODEL)}, "data": {"path": "d"}, "lora": lora, "output_dir": "o"}
    return validate_config(raw)


def moe_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MOE_MODEL, dtype=torch.float32)


@pytest.mark.parametrize(
    ("lora", "line"),
    [
        (
            {"target_parameters": ["experts.gate_proj"]},
            "lora.target_parameters: entry 'experts.gate_proj' matches no expert bank "
            '(did you mean "experts.gate_up_proj"?)',
        ),
        (
            {"target_parameters": ["self_attn.q_proj.weight"]},
            "lora.target_parameters: entry 'self_attn.q_proj.weight' selects "
            "'model.layers.0.self_attn.q_proj.weight' (shape (64, 64) in a Linear), which is not a 3-D expert bank",
        ),
        (
            {"target_modules": ["q_proj", "v_porj"], "target_parameters": EXPERT_BANKS},
            "lora.target_modules: entry 'v_porj' matches no module (did you mean \"v_proj\"?)",
        ),
    ],
)
def test_target_errors_name_the_yaml_field_and_change_nothing(lora, line):
    model = moe_model()
    with pytest.raises(InjectionError) as info:
        build.prepare_model(model, moe_cfg(**lora), torch.device("cpu"))
    assert str(info.value).startswith(line), str(info.value)
    assert not list(lora_modules(model)) and not list(lora_expert_modules(model))
    assert all(p.requires_grad for p in model.parameters())


def test_target_parameters_on_a_dense_model_say_it_has_no_experts():
    cfg = cfg_with()
    cfg = cfg.model_copy(update={"lora": LoRAConfig(target_parameters=EXPERT_BANKS)})
    with pytest.raises(
        InjectionError, match=r"^lora\.target_parameters: entry 'experts\.gate_up_proj' .*no MoE"
    ):
        build.prepare_model(tiny_model("llama"), cfg, torch.device("cpu"))


def test_prepare_model_adapts_attention_and_expert_banks():
    model = moe_model()
    lora = {
        "r": 4,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "target_parameters": EXPERT_BANKS,
    }
    build.prepare_model(model, moe_cfg(**lora), torch.device("cpu"))
    assert (
        build.adapter_coverage(model)
        == "8 linear modules and 4 expert banks (2 experts modules of 8 experts)"
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "model.layers.1.mlp.experts.lora_A.gate_up_proj" in trainable
    assert all(".lora_" in n for n in trainable)  # the router and every bank stay frozen


def _lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpointing", [False, True, "offload"])
def test_the_embeddings_output_needs_no_gradient(checkpointing):
    """The runner drops inject_lora's input-gradient hooks and those Transformers' checkpointing switch adds: the
    first layer's input gradient, which nothing reads, is not formed, and no checkpoint here needs its input to
    require a gradient (with the hooks the backward held the embeddings' output to its end)."""
    model = tiny_model("llama")
    build.prepare_model(model, cfg_with(gradient_checkpointing=checkpointing), torch.device("cpu"))
    ids = torch.arange(6).view(1, 6)
    assert not model.get_input_embeddings()(ids).requires_grad
    assert not model.get_input_embeddings()._forward_hooks
    assert not loralei.inject.injection_record(model).added_input_grad_hooks
    loralei.inject.remove_injection_record(model)  # after a drop, undoing the injection removes nothing twice
    assert loralei.inject.injection_record(model) is None


def test_input_gradient_hooks_the_model_had_before_stay() -> None:
    """Hooks that were there before the injection are the caller's: checkpointing drops only those it added."""
    model = tiny_model("llama")
    model.enable_input_require_grads()
    theirs = model._require_grads_hooks
    build.prepare_model(model, cfg_with(gradient_checkpointing="offload"), torch.device("cpu"))
    assert model._require_grads_hooks is theirs and model._require_grads_hook is theirs[0]
    assert len(model.get_input_embeddings()._forward_hooks) == len(theirs)
    assert model.get_input_embeddings()(torch.arange(6).view(1, 6)).requires_grad


@pytest.mark.parametrize("checkpointing", [False, True, "offload"])
def test_dropping_the_input_gradient_hooks_leaves_every_lora_gradient_as_it_was(checkpointing):
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = tiny_model("llama")
        build.prepare_model(model, cfg_with(gradient_checkpointing=checkpointing), torch.device("cpu"))
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0, 0.1)  # B = 0 at init would leave A's gradient zero
        models.append(model)
    models[1].enable_input_require_grads()  # the reference forms the first layer's input gradient too
    got, want = (_lora_grads(m) for m in models)
    assert got.keys() == want.keys() and want
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)


def _flex_config():
    return validate_config(
        {
            "model": {"name_or_path": "m", "attn_implementation": "flex_attention"},
            "data": {"path": "d"},
            "output_dir": "o",
        }
    )


def test_flex_attention_on_the_cpu_is_refused_before_training() -> None:
    """PyTorch runs flex attention's backward on CUDA only: a CPU run is told so, not failed inside torch."""
    with pytest.raises(ConfigError, match=r"model.attn_implementation: flex_attention trains on CUDA only"):
        build.prepare_model(tiny_model("llama", head_dim=16), _flex_config(), torch.device("cpu"))


def test_flex_attention_with_heads_narrower_than_its_kernels_take_is_refused() -> None:
    """PyTorch's flex kernels take heads of 16 dims or more (narrower ones fail inside inductor on CUDA)."""
    model = tiny_model("llama")  # heads of 32 / 4 = 8 dims
    with pytest.raises(
        ConfigError, match=r"at least 16 dims .* this model's have 8; set model.attn_implementation: sdpa"
    ):
        build.prepare_model(model, _flex_config(), torch.device("cuda"))


def _small_host(monkeypatch, gib: float) -> None:
    from loralei.train import kept_attention

    monkeypatch.setattr(kept_attention, "host_memory", lambda: int(gib * 2**30))


def test_offloaded_inputs_over_the_host_are_refused_with_the_sizes(monkeypatch) -> None:
    """A full batch's layer inputs, each as its pinned buffer, against 90 % of the host's memory: 32 layers of
    100K tokens x 4096 bf16 (781.25 MiB each, 782 MiB in pieces; one power-of-two allocation would take 1 GiB)
    fit 32 GiB, not 24."""
    from loralei.train.checkpointing import offload_inputs_problem

    _small_host(monkeypatch, 32)
    assert offload_inputs_problem(32, 100_000, 4096 * 2) is None
    _small_host(monkeypatch, 24)
    problem = offload_inputs_problem(32, 100_000, 4096 * 2)
    assert problem is not None and "a full batch of 100,000 tokens" in problem
    assert "32 x 782.00 MiB = 24.44 GiB there, more than 90% of the 24.00 GiB this process may use" in problem
    assert problem.endswith("or set gradient_checkpointing: true (the inputs stay on the GPU)")


def test_the_runner_refuses_them_before_the_weights_load(monkeypatch, tmp_path) -> None:
    """``load_model`` checks the config before any weight is read; on the CPU (plain host copies) and without
    offload there is nothing to check."""
    import transformers

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the check")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    _small_host(
        monkeypatch, 0.001
    )  # 1 MiB: the quickstart model's 3 layers of 64K tokens x 256 bytes take 48
    cfg = validate_config(
        {
            "model": {"name_or_path": "examples/quickstart/model", "dtype": "float32"},
            "data": {"path": "d"},
            "training": {"gradient_checkpointing": "offload", "max_seq_length": 65_536},
            "output_dir": str(tmp_path / "out"),
        }
    )
    with pytest.raises(
        ConfigError, match=r"training.gradient_checkpointing: offload keeps every decoder layer"
    ):
        build.load_model(cfg, torch.device("cuda"))
    for device, mode in [("cpu", "offload"), ("cuda", True)]:
        training = cfg.training.model_copy(update={"gradient_checkpointing": mode})
        other = cfg.model_copy(update={"training": training})
        with pytest.raises(AssertionError, match="the weights were loaded"):
            build.load_model(other, torch.device(device))


def test_more_ranks_per_sequence_than_heads_are_refused_before_the_weights_load(
    monkeypatch, tmp_path
) -> None:
    """The quickstart model has 8 attention heads: 9 ranks per sequence are refused from its config; 3 ranks (its
    heads split 3/3/2) pass the check."""
    import transformers

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the check")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    _small_host(monkeypatch, 0.001)
    raw = {
        "model": {"name_or_path": "examples/quickstart/model", "dtype": "float32"},
        "data": {"path": "d"},
        "training": {"sequence_parallel_size": 9, "packing": False, "max_seq_length": 65_536},
        "output_dir": str(tmp_path / "out"),
    }
    with pytest.raises(
        ConfigError, match=r"sequence_parallel_size: 9 is more ranks than this model's 8 attention"
    ):
        build.load_model(validate_config(raw), torch.device("cuda"))
    raw["training"] |= {"sequence_parallel_size": 3}
    with pytest.raises(AssertionError, match="the weights were loaded"):
        build.load_model(validate_config(raw), torch.device("cuda"))


def test_a_sequence_parallel_rank_counts_its_share_of_each_row(monkeypatch) -> None:
    """Split over 4 ranks, each rank offloads a quarter of each 64K-token row: 16K tokens of the quickstart's
    3 layers x 256 bytes (12 MiB) fit 16 MiB of host memory, the whole row (48 MiB) would not."""
    from transformers import AutoConfig

    _small_host(monkeypatch, 16 / 1024)
    config = AutoConfig.from_pretrained("examples/quickstart/model")
    raw = {
        "model": {"name_or_path": "m", "dtype": "float32"},
        "data": {"path": "d"},
        "training": {"gradient_checkpointing": "offload", "max_seq_length": 65_536},
        "output_dir": "o",
    }
    with pytest.raises(ConfigError, match=r"a full batch of 65,536 tokens"):
        build.check_config_fits(validate_config(raw), config, torch.float32, torch.device("cuda"))
    raw["training"] |= {"sequence_parallel_size": 4}
    build.check_config_fits(validate_config(raw), config, torch.float32, torch.device("cuda"))


def test_a_model_given_to_train_is_checked_before_the_output_dir_changes(monkeypatch, tmp_path) -> None:
    from runner_helpers import collate, token_dataset

    from loralei.train.run import train

    monkeypatch.setattr(build, "default_device", lambda: torch.device("cuda"))
    _small_host(monkeypatch, 0.001)
    cfg = cfg_with(tmp_path / "out", gradient_checkpointing="offload", max_seq_length=65_536, max_steps=1)
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"path": "in-memory"})})
    with pytest.raises(
        ConfigError, match=r"a full batch of 65,536 tokens .* takes 2 x 8.00 MiB = 16.00 MiB there"
    ):
        train(cfg, model=tiny_model("llama"), dataset=token_dataset(), collate_fn=collate)
    assert not (tmp_path / "out").exists()
