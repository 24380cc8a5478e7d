"""``loralei-generate``: answer prompts with a base model and a trained adapter, greedily.

Usage::

    loralei-generate outputs/run/adapter --prompt "Summarise: ..." [--prompt ...] [--compare-base]
    echo "one prompt per line" | loralei-generate outputs/run/adapter
    loralei-generate outputs/run/adapter --eval heldout.jsonl --compare-base

The base model is the one the adapter records (``base_model_name_or_path``, written by the runner and by
``save_pretrained``) unless ``--base`` names another. Each prompt is one user turn rendered with the tokenizer's
chat template and its generation prompt; ``--raw`` feeds it as plain text instead (for base models trained on
completions). ``--compare-base`` answers every prompt with the base model first, then with the adapter.
``--eval FILE`` takes its prompts from a JSONL file of chat rows instead (``{"messages": [...]}``, the format
``loralei-finetune`` trains on): each row's last message is the assistant's expected answer and the turns before
it are the prompt; every answer is marked right or wrong, and a last line gives the exact-match score.
"""

from __future__ import annotations

import argparse
import json
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

# A prompt: one user turn's text, or chat turns ({"role": ..., "content": ...}) that end before the answer.
Prompt = str | list[dict[str, str]]
EVAL_ROW = '{"messages": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": EXPECTED}]}'


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


def encode(tokenizer: Any, prompt: Prompt, raw: bool) -> torch.Tensor:
    """The prompt's token ids (1 × n): the chat turns (a string is one user turn) with the chat template's
    generation prompt, or the plain text with ``raw``.

    Raises:
        ConfigError: the tokenizer has no chat template and ``raw`` is off.
    """
    if raw:
        return tokenizer(prompt, return_tensors="pt").input_ids
    if not tokenizer.chat_template:
        raise ConfigError(
            "the tokenizer has no chat template to render the prompt with; pass --raw to feed prompts as plain text"
        )
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    ids = tokenizer.apply_chat_template(
        turns,
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    return ids["input_ids"]


@torch.no_grad()
def answer(model: nn.Module, tokenizer: Any, prompt: Prompt, max_new_tokens: int, raw: bool = False) -> str:
    """The model's greedy continuation of ``prompt`` (a user turn, or chat turns), decoded without special
    tokens."""
    ids = encode(tokenizer, prompt, raw).to(next(model.parameters()).device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def _is_turn(turn: Any) -> bool:
    return isinstance(turn, dict) and all(isinstance(turn.get(key), str) for key in ("role", "content"))


def _eval_row(line: str, where: str) -> tuple[list[dict[str, str]], str]:
    """One eval row's prompt turns and expected answer; ``where`` names the file and line for errors."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where} is not JSON ({exc.msg}); write one row per line: {EVAL_ROW}") from exc
    turns = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(turns, list) or not turns or not all(map(_is_turn, turns)):
        raise ConfigError(
            f'{where} has no "messages" list of turns with a string "role" and "content"; write {EVAL_ROW}'
        )
    if turns[-1]["role"] != "assistant":
        raise ConfigError(
            f"{where} ends with a {turns[-1]['role']!r} turn, not an assistant turn; end each row with the "
            "assistant's expected answer"
        )
    if len(turns) < 2:
        raise ConfigError(f"{where} holds only the expected answer; put the prompt's user turn before it")
    return turns[:-1], turns[-1]["content"]


def read_eval_rows(path: Path) -> list[tuple[list[dict[str, str]], str]]:
    """The rows of a JSONL file of chat rows: each row's turns before its last message (the prompt) and that
    message's content (the expected answer).

    Args:
        path: the file; blank lines are skipped.

    Returns:
        One (prompt turns, expected answer) pair per row, in file order.

    Raises:
        ConfigError: the file is missing, not UTF-8 or empty, a line is not a JSON row with a "messages" list of
            role/content turns, or a row does not end with an assistant turn that follows at least one other.
    """
    if not path.is_file():
        raise ConfigError(
            f"--eval: {str(path)!r} is not a file; pass a JSONL file with one row per line: {EVAL_ROW}"
        )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"--eval: {str(path)!r} is not UTF-8 text ({exc.reason}); pass a JSONL file"
        ) from exc
    rows = [
        _eval_row(line, f"--eval: {str(path)!r} line {n}") for n, line in enumerate(lines, 1) if line.strip()
    ]
    if not rows:
        raise ConfigError(f"--eval: {str(path)!r} holds no rows; write one row per line: {EVAL_ROW}")
    return rows


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loralei-generate", description=__doc__.splitlines()[0].split(": ", 1)[1]
    )
    parser.add_argument("adapter", type=Path, help="an adapter directory (native or PEFT format)")
    parser.add_argument("--base", help="the base model (default: the one the adapter records)")
    parser.add_argument(
        "--prompt", action="append", default=None, help="a prompt (repeatable; default: stdin lines)"
    )
    parser.add_argument(
        "--eval",
        type=Path,
        help="a JSONL file of chat rows to score: each row's last (assistant) message is the expected answer",
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


def _rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The prompts to answer: from --prompt or stdin, or each --eval row with its expected answer."""
    if args.eval is None:
        return [{"prompt": p} for p in _prompts(args.prompt)]
    if args.prompt is not None:
        raise ConfigError(
            f"--eval: {str(args.eval)!r} brings its own prompts; pass --prompt or --eval, not both"
        )
    if args.raw:
        raise ConfigError("--raw: --eval rows are chat turns, rendered with the chat template; drop --raw")
    return [{"prompt": turns, "expected": expected} for turns, expected in read_eval_rows(args.eval)]


def _shown(text: str) -> str:
    return text if text else "(nothing: the model ended its turn at once)"


def _print_row(row: dict[str, Any]) -> None:
    prompt = row["prompt"]
    print(f"prompt:  {prompt if isinstance(prompt, str) else ' | '.join(t['content'] for t in prompt)}")
    if "base" in row:
        print(f"  base:    {_shown(row['base'])}")
    mark = ""
    if "expected" in row:
        right = row["adapter"] == row["expected"].strip()
        mark = "  (right)" if right else f"  (wrong: expected {row['expected'].strip()!r})"
    print(f"  adapter: {_shown(row['adapter'])}{mark}")


def _score(rows: list[dict[str, Any]], key: str) -> str:
    right = sum(row[key] == row["expected"].strip() for row in rows)
    return f"{right}/{len(rows)} ({right / len(rows):.0%})"


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Answers every prompt (with the base model first when ``compare_base``) and prints them as it goes; with
    ``eval``, marks each answer and ends with the exact-match score."""
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: {args.max_new_tokens} must be at least 1")
    rows = _rows(args)
    base = args.base or base_model_of(args.adapter)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_base(base, args.dtype, device)
    if args.compare_base:
        for row in rows:
            row["base"] = answer(model, tokenizer, row["prompt"], args.max_new_tokens, args.raw)
    load_pretrained(model, args.adapter)
    for row in rows:
        row["adapter"] = answer(model, tokenizer, row["prompt"], args.max_new_tokens, args.raw)
        _print_row(row)
    if args.eval is not None:
        base_score = f", the base model {_score(rows, 'base')}" if args.compare_base else ""
        print(f"exact match on {args.eval}: the adapter {_score(rows, 'adapter')}{base_score}")
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
