"""A tour of the loralei API on a tiny random-weight Llama (CPU, seconds): inject, train, save, load, merge.

Run: `make demo` (or `.venv/bin/python examples/api_tour.py`).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from loralei import (
    LoRAConfig,
    disable_lora,
    inject_lora,
    load_pretrained,
    merge_and_unload_lora,
    merge_lora,
    save_pretrained,
    unmerge_lora,
)


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    # The task: continue a fixed cyclic pattern of tokens; the base model has never seen it.
    ids = (torch.arange(32).repeat(8, 1) * 3 + torch.arange(8)[:, None]) % 61 + 3
    batch = {"input_ids": ids, "labels": ids}

    model = tiny_llama()
    config = LoRAConfig(
        r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    inject_lora(model, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    model.train()
    for step in range(40):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == 39:
            print(f"step {step:2d}  loss {loss.item():.3f}")
    model.eval()
    logits = model(**batch).logits

    with tempfile.TemporaryDirectory() as tmp:
        native, peft_dir = Path(tmp) / "adapter", Path(tmp) / "adapter-peft"
        save_pretrained(model, native)
        save_pretrained(model, peft_dir, format="peft")
        for path in (native, peft_dir):
            reloaded = load_pretrained(tiny_llama(), path).eval()
            diff = (reloaded(**batch).logits - logits).abs().max().item()
            print(
                f"reloaded {path.name:13s} max |Δlogits| = {diff:.2e}   files: {sorted(p.name for p in path.iterdir())}"
            )

    with disable_lora(model):
        print(f"base model loss (adapter disabled): {model(**batch).loss.item():.3f}")
    before = model.model.layers[0].self_attn.q_proj.weight.clone()
    merge_lora(model)
    print(f"merged loss: {model(**batch).loss.item():.3f}")
    unmerge_lora(model)
    print(
        f"unmerge restores weights bit for bit: {torch.equal(before, model.model.layers[0].self_attn.q_proj.weight)}"
    )
    plain = merge_and_unload_lora(model)
    print(
        f"merge_and_unload -> {type(plain.model.layers[0].self_attn.q_proj).__name__}, loss {plain(**batch).loss.item():.3f}"
    )


if __name__ == "__main__":
    main()
