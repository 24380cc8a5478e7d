"""``loralei-generate``: answer prompts with a base model and a trained adapter, greedily.

Usage::

    loralei-generate outputs/run/adapter --prompt "Summarise: ..." [--prompt ...] [--compare-base]
    echo "one prompt per line" | loralei-generate outputs/run/adapter

The base model is the one the adapter records (``base_model_name_or_path``, written by the runner and by
``save_pretrained``) unless ``--base`` names another. Each prompt is one user turn rendered with the tokenizer's
chat template and its generation prompt; ``--raw`` feeds it as plain text instead (for base models trained on
completions). ``--compare-base`` answers every prompt with the base model first, then with the adapter.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import NATIVE_CONFIG, load_pretrained, read_json
from .errors import ConfigError, LoraleiError
from .hub import check_source, offline
from .peft_format import PEFT_CONFIG
from .quiet import import_quietly


def base_model_of(adapter: Path) -> str:
    """The base model an adapter directory records (native or PEFT format).

    Raises:
        ConfigError: the directory does not exist, is not an adapter, or records no base model.
        CheckpointError: its config file is not readable JSON.
    """
    if not adapter.is_dir():
        raise ConfigError(
            f"adapter: {str(adapter)!r} is not a directory; pass the adapter directory a run wrote"
        )
    for name in (NATIVE_CONFIG, PEFT_CONFIG):
        if (adapter / name).is_file():
            base = read_json(adapter / name).get("base_model_name_or_path")
            if base:
                return base
            raise ConfigError(
                f"adapter: {adapter / name} records no base model; name it with --base MODEL_DIR_OR_HUB_ID"
            )
    raise ConfigError(
        f"adapter: {str(adapter)!r} holds no {NATIVE_CONFIG} or {PEFT_CONFIG}; pass the adapter directory a "
        "run wrote (e.g. OUTPUT_DIR/adapter)"
    )


def load_base(name: str, dtype: str, device: torch.device) -> tuple[nn.Module, Any]:
    """The base causal LM and its tokenizer, in eval mode on ``device``.

    Raises:
        ConfigError: Transformers cannot load the model or tokenizer from ``name``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import_quietly("transformers.modeling_utils")  # it imports TorchAO, whose load messages are noise here
    cached_only = check_source("--base", name)
    try:
        with offline(cached_only):
            tokenizer = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--base: cannot load {name!r} ({exc}); pass a local model directory with --base"
        ) from exc
    return model.to(device).eval(), tokenizer


def encode(tokenizer: Any, prompt: str, raw: bool) -> torch.Tensor:
    """The prompt's token ids (1 × n): one user turn with the chat template's generation prompt, or the plain
    text with ``raw``.

    Raises:
        ConfigError: the tokenizer has no chat template and ``raw`` is off.
    """
    if raw:
        return tokenizer(prompt, return_tensors="pt").input_ids
    if not tokenizer.chat_template:
        raise ConfigError(
            "the tokenizer has no chat template to render the prompt with; pass --raw to feed prompts as plain text"
        )
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    return ids["input_ids"]


@torch.no_grad()
def answer(model: nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int, raw: bool = False) -> str:
    """The model's greedy continuation of ``prompt``, decoded without special tokens."""
    ids = encode(tokenizer, prompt, raw).to(next(model.parameters()).device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loralei-generate", description=__doc__.splitlines()[0].split(": ", 1)[1]
    )
    parser.add_argument("adapter", type=Path, help="an adapter directory (native or PEFT format)")
    parser.add_argument("--base", help="the base model (default: the one the adapter records)")
    parser.add_argument(
        "--prompt", action="append", default=None, help="a prompt (repeatable; default: stdin lines)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--compare-base", action="store_true", help="answer with the base model too")
    parser.add_argument("--raw", action="store_true", help="feed prompts as plain text, not a chat turn")
    parser.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16, ...")
    return parser


def _prompts(given: list[str] | None) -> list[str]:
    prompts = given if given is not None else [line.strip() for line in sys.stdin if line.strip()]
    if not prompts:
        raise ConfigError("no prompts: pass --prompt TEXT (repeatable) or prompts on stdin, one per line")
    return prompts


def _shown(text: str) -> str:
    return text if text else "(nothing: the model ended its turn at once)"


def run(args: argparse.Namespace) -> list[dict[str, str]]:
    """Answers every prompt (with the base model first when ``compare_base``) and prints them as it goes."""
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: {args.max_new_tokens} must be at least 1")
    prompts = _prompts(args.prompt)
    base = args.base or base_model_of(args.adapter)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_base(base, args.dtype, device)
    rows = [{"prompt": p} for p in prompts]
    if args.compare_base:
        for row in rows:
            row["base"] = answer(model, tokenizer, row["prompt"], args.max_new_tokens, args.raw)
    load_pretrained(model, args.adapter)
    for row in rows:
        row["adapter"] = answer(model, tokenizer, row["prompt"], args.max_new_tokens, args.raw)
        print(f"prompt:  {row['prompt']}")
        if "base" in row:
            print(f"  base:    {_shown(row['base'])}")
        print(f"  adapter: {_shown(row['adapter'])}")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loralei-generate``; returns 0, or 2 for a bad argument, adapter or model."""
    try:
        run(_parser().parse_args(argv))
    except LoraleiError as exc:
        print(f"loralei-generate: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
