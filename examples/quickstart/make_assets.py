"""Builds the quickstart assets: a character-level tokenizer with a ChatML template, a tiny random-weight Qwen3
model, a chat dataset whose task is writing a five-letter string in capitals, 30 held-out rows of the same task on
English words, and a pretokenized Parquet copy of the training rows; and a tiny random-weight Qwen3-MoE model with
the same tokenizer, for the MoE quickstart.

Everything is made locally (nothing downloaded) and deterministically from ``--seed``:

    python examples/quickstart/make_assets.py   # rewrites examples/quickstart/, quickstart-moe/ and data/

Outputs:
    examples/quickstart/model/      config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
                                    chat_template.jinja (AutoModelForCausalLM / AutoTokenizer load this dir)
    examples/quickstart/data.jsonl  {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]} rows
    examples/quickstart/heldout.jsonl   rows of the same form on words no training row holds
    examples/quickstart/preferences.jsonl   {"prompt", "chosen", "rejected"} pairs (capitals chosen, unchanged
                                    letters rejected), for the preference quickstart
    examples/quickstart/kto.jsonl   {"prompt", "completion", "label"} rows, each on its own string (capitals
                                    desirable, unchanged letters not), for the KTO quickstart
    examples/data/upper_pretokenized.parquet   input_ids / attention_mask / labels of the training rows
    examples/quickstart-moe/model/  the Qwen3-MoE model (8 experts, top-2) and the same tokenizer files
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3MoeConfig

HERE = Path(__file__).resolve().parent
PAD, START, END, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"
SPECIALS = [PAD, START, END, UNK]
# ChatML, written plainly (no {% generation %} blocks): loralei finds the assistant spans itself.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LETTERS = string.ascii_lowercase
# One length for every word: each capital is then the letter a fixed distance back in the prompt, which attention
# heads learn to find in a minute. With lengths 4-6 that distance varies from row to row, and after a minute few
# answers come out exactly right (as with reversing the letters, a harder task still).
WORD_LENGTH = 5
# Common English words, never in the training rows (which are random letters): readable at a glance, and unseen.
# fmt: off
HELD_OUT_WORDS = [
    "apple", "beach", "chair", "dream", "eagle", "flame", "grape", "house", "jelly", "knife",
    "lemon", "mouse", "night", "ocean", "piano", "queen", "river", "snake", "tiger", "uncle",
    "voice", "water", "yacht", "zebra", "bread", "cloud", "dance", "earth", "field", "ghost",
]
# fmt: on
EMBEDDING_STD = 0.3
# pairs in preferences.jsonl, the DPO / ORPO quickstart's data (examples/quickstart-dpo.yaml)
PREFERENCE_PAIRS = 300
# unpaired rows in kto.jsonl, the KTO quickstart's data (examples/quickstart-kto.yaml)
KTO_ROWS = 600
# Qwen3 normalises each head's queries and keys (q_norm, k_norm), whose weights stay frozen. At their usual 1 an
# attention logit cannot exceed sqrt(head_dim) = 4, too flat to pick one letter out of the prompt; 2.5 lets the
# adapted projections make attention as sharp as the task needs.
QK_NORM_WEIGHT = 2.5
MODEL_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 3,
    # 8 heads rather than 4: with 4, some seeds never learn to copy the letters within the quickstart's steps.
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": 256,
}
# The MoE model: attention of 4 heads, 2 layers, and in each a sparse block of 8 experts (top-2 routing) with
# 3-D expert banks gate_up_proj (8×64×64) and down_proj (8×64×32); about 130k parameters, a ~0.5 MB file.
MOE_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "intermediate_size": 128,  # of dense MLP layers; with mlp_only_layers=[] every layer is sparse
    "norm_topk_prob": True,
}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level WordLevel tokenizer over printable ASCII plus the ChatML special tokens."""
    chars = ["\n", " ", *(chr(c) for c in range(33, 127))]
    vocab = {token: i for i, token in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=END,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int, *, moe: bool = False) -> torch.nn.Module:
    """A random-weight Qwen3 causal LM sized for a 2-core CPU; with ``moe``, a Qwen3-MoE one."""
    vocab_size = 8 * -(-len(tokenizer) // 8)  # rounded up to a multiple of 8
    config_class, shape = (Qwen3MoeConfig, MOE_SHAPE) if moe else (Qwen3Config, MODEL_SHAPE)
    config = config_class(
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **shape,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # The tied embedding doubles as the frozen output head: with the usual std 0.02 its logits stay within about
    # +-1 whatever the LoRA layers do, so the loss could barely fall. A larger scale lets predictions be confident.
    torch.nn.init.normal_(model.get_input_embeddings().weight, std=EMBEDDING_STD)
    for layer in model.model.layers:
        torch.nn.init.constant_(layer.self_attn.q_norm.weight, QK_NORM_WEIGHT)
        torch.nn.init.constant_(layer.self_attn.k_norm.weight, QK_NORM_WEIGHT)
    return model


def task_row(word: str) -> dict:
    """The chat row asking to write ``word`` in capitals, with the answer."""
    return {
        "messages": [
            {"role": "user", "content": f"upper: {word}"},
            {"role": "assistant", "content": word.upper()},
        ]
    }


def build_rows(n: int, seed: int) -> list[dict]:
    """Rows of ``n`` distinct random five-letter strings, none of them a held-out word."""
    rng = random.Random(seed)
    words: dict[str, None] = {}  # insertion-ordered, without repeats
    while len(words) < n:
        word = "".join(rng.choices(LETTERS, k=WORD_LENGTH))
        if word not in HELD_OUT_WORDS:
            words[word] = None
    return [task_row(word) for word in words]


def preference_row(word: str) -> dict:
    """A preference pair in TRL's conversational format: the chosen answer follows the capitals rule, the rejected
    one copies the letters unchanged."""
    return {
        "prompt": [{"role": "user", "content": f"upper: {word}"}],
        "chosen": [{"role": "assistant", "content": word.upper()}],
        "rejected": [{"role": "assistant", "content": word}],
    }


def build_preferences(n: int, seed: int) -> list[dict]:
    """``n`` preference pairs on random five-letter strings (their own draw: ``data.jsonl`` stays as it is)."""
    return [
        preference_row(row["messages"][0]["content"].removeprefix("upper: "))
        for row in build_rows(n, seed + 1)
    ]


def build_kto_rows(n: int, seed: int) -> list[dict]:
    """``n`` unpaired rows in TRL's conversational format on random five-letter strings (their own draw), each
    answered in capitals (label true) or copied unchanged (false), alternately."""
    rows = []
    for k, row in enumerate(build_rows(n, seed + 2)):
        word = row["messages"][0]["content"].removeprefix("upper: ")
        desirable = k % 2 == 0
        completion = [{"role": "assistant", "content": word.upper() if desirable else word}]
        rows.append({"prompt": row["messages"][:1], "completion": completion, "label": desirable})
    return rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    """One JSON row per line."""
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_parquet(tokenizer: PreTrainedTokenizerFast, rows: list[dict], path: Path) -> None:
    """Stores the rows pretokenized (loss on the assistant answer and its end token only)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = {"input_ids": [], "attention_mask": [], "labels": []}
    for row in rows:
        full = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        prompt = tokenizer.apply_chat_template(
            row["messages"][:1], add_generation_prompt=True, tokenize=False
        )
        answer = row["messages"][1]["content"] + END
        tail = full[len(prompt) + len(answer) :]  # the newline after the end token: not trained
        ids = [tokenizer(part, add_special_tokens=False)["input_ids"] for part in (prompt, answer, tail)]
        records["input_ids"].append(ids[0] + ids[1] + ids[2])
        records["attention_mask"].append([1] * sum(map(len, ids)))
        records["labels"].append([-100] * len(ids[0]) + ids[1] + [-100] * len(ids[2]))
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(records), path)


def main() -> None:
    """Writes every asset (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=1200)
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--parquet", type=Path, default=HERE.parent / "data" / "upper_pretokenized.parquet")
    parser.add_argument("--moe-out", type=Path, default=HERE.parent / "quickstart-moe")
    args = parser.parse_args()

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.seed)
    model_dir = args.out / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rows = build_rows(args.rows, args.seed)
    write_jsonl(rows, args.out / "data.jsonl")
    write_jsonl([task_row(word) for word in HELD_OUT_WORDS], args.out / "heldout.jsonl")
    write_parquet(tokenizer, rows, args.parquet)
    write_jsonl(build_preferences(PREFERENCE_PAIRS, args.seed), args.out / "preferences.jsonl")
    write_jsonl(build_kto_rows(KTO_ROWS, args.seed), args.out / "kto.jsonl")
    params = sum(p.numel() for p in model.parameters())
    print(
        f"wrote {model_dir} ({params:,} parameters), {len(rows)} rows, {len(HELD_OUT_WORDS)} held-out rows, "
        f"{args.parquet}"
    )

    moe = build_model(tokenizer, args.seed, moe=True)
    moe_dir = args.moe_out / "model"
    moe.save_pretrained(moe_dir)
    tokenizer.save_pretrained(moe_dir)
    params = sum(p.numel() for p in moe.parameters())
    print(f"wrote {moe_dir} ({params:,} parameters; the MoE quickstart trains on the same data.jsonl)")


if __name__ == "__main__":
    main()
