"""prepare_sft_dataset end to end on small local files of every row format."""

from __future__ import annotations

import copy

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_helpers import chat, trained_text

from loralei.train.data import DataError, prepare_sft_dataset


def test_drops_are_counted_in_one_summary_line(tokenizer, write_jsonl) -> None:
    rows = [
        chat("reverse: abc", "cba"),
        chat("reverse: abcd", "dcba"),
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "no answer"}]},
        chat("reverse: " + "a" * 60, "a" * 60),
    ]
    ds = prepare_sft_dataset(tokenizer, path=write_jsonl(rows), max_seq_length=64, packing=False)
    s = ds.summary
    assert (s.rows_read, s.rows_kept, s.truncated) == (6, 2, 0)
    assert s.dropped == {"empty": 1, "malformed": 1, "no trainable token": 1, "too long": 1}
    assert [trained_text(tokenizer, ds[i]) for i in range(len(ds))] == ["cba<|im_end|>", "dcba<|im_end|>"]
    assert s.tokens == sum(len(ds[i]["input_ids"]) for i in range(2))
    assert s.trainable_tokens == len("cba") + len("dcba") + 2
    line = str(s)
    assert "\n" not in line
    assert "6 rows read, 2 kept, 4 dropped (" in line
    assert "1 too long" in line and "1 malformed" in line and "1 no trainable token" in line


def test_widest_row_is_the_longest_sample_or_the_fullest_packed_row(tokenizer, write_jsonl) -> None:
    """What the runner pads every batch to when CUDA graphs replay its batches (one width for the graphs)."""
    rows = [chat("reverse: " + "ab" * n, "ba" * n) for n in (1, 2, 6, 3, 4)]
    ds = prepare_sft_dataset(tokenizer, path=write_jsonl(rows), max_seq_length=80, packing=False)
    assert ds.rows_per_item == 1 and len(ds) == 5
    assert ds.widest_row() == max(len(ds[i]["input_ids"]) for i in range(len(ds)))
    packed = prepare_sft_dataset(tokenizer, path=write_jsonl(rows), max_seq_length=80, packing=True)
    assert 1 < len(packed) < len(ds)
    assert packed.widest_row() == max(len(packed[i]["input_ids"]) for i in range(len(packed)))


def test_truncate_keeps_long_rows(tokenizer, write_jsonl) -> None:
    rows = [chat("reverse: abc", "cba"), chat("reverse: abcdefgh", "hgfedcba")]
    ds = prepare_sft_dataset(
        tokenizer, path=write_jsonl(rows), max_seq_length=40, packing=False, truncate=True
    )
    assert ds.summary.rows_kept == 2 and ds.summary.truncated == 1
    assert max(len(ds[i]["input_ids"]) for i in range(2)) == 40
    assert "1 truncated to 40" in str(ds.summary)


def test_all_rows_dropped_is_an_error(tokenizer, write_jsonl) -> None:
    path = write_jsonl([chat("reverse: abcdefgh", "hgfedcba")] * 3)
    with pytest.raises(DataError, match=r"all 3 rows .* were dropped \(3 too long\)"):
        prepare_sft_dataset(tokenizer, path=path, max_seq_length=16, packing=False)


@pytest.mark.parametrize("bad", [1, 0, -5, 2.5, True, None])
def test_max_seq_length_below_two_is_an_error(tokenizer, write_jsonl, bad) -> None:
    path = write_jsonl([chat("a", "b")])
    with pytest.raises(DataError, match=r"training\.max_seq_length: must be an integer >= 2"):
        prepare_sft_dataset(tokenizer, path=path, max_seq_length=bad, packing=False)


def test_missing_file_and_missing_field(tokenizer, write_jsonl, tmp_path) -> None:
    with pytest.raises(DataError, match=r"data\.path: no such file or directory: '.*nope\.jsonl'"):
        prepare_sft_dataset(tokenizer, path=str(tmp_path / "nope.jsonl"), max_seq_length=32, packing=False)
    path = write_jsonl([chat("a", "b")])
    with pytest.raises(
        DataError, match=r"data\.messages_field: column 'msgs' .* available columns: messages"
    ):
        prepare_sft_dataset(tokenizer, path=path, max_seq_length=32, packing=False, messages_field="msgs")


def test_no_chat_template_is_an_error(tokenizer, write_jsonl) -> None:
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(DataError, match=r"data\.chat_template"):
        prepare_sft_dataset(bare, path=write_jsonl([chat("a", "b")]), max_seq_length=32, packing=False)


def test_split_slicing_and_sharegpt(tokenizer, write_jsonl) -> None:
    rows = [
        {"conversations": [{"from": "human", "value": f"reverse: {w}"}, {"from": "gpt", "value": w[::-1]}]}
        for w in ("ab", "abc", "abcd")
    ]
    ds = prepare_sft_dataset(
        tokenizer, path=write_jsonl(rows), split="train[:2]", max_seq_length=64, packing=False
    )
    assert ds.summary.rows_read == 2
    assert trained_text(tokenizer, ds[1]) == "cba<|im_end|>"


def test_sharegpt_and_role_content_rows_in_one_file(tokenizer, write_jsonl) -> None:
    # datasets stores messages whose keys vary from row to row as JSON text (its Json type); they are decoded
    rows = [
        {"messages": [{"from": "human", "value": "reverse: ab"}, {"from": "gpt", "value": "ba"}]},
        chat("reverse: abc", "cba"),
    ]
    ds = prepare_sft_dataset(tokenizer, path=write_jsonl(rows), max_seq_length=64, packing=False)
    assert [trained_text(tokenizer, ds[i]) for i in range(2)] == ["ba<|im_end|>", "cba<|im_end|>"]


def test_instruction_format_uses_the_chat_template(tokenizer, write_jsonl) -> None:
    rows = [
        {"instruction": "reverse", "input": "abc", "output": "cba"},
        {"instruction": "say hi", "output": "hi"},
    ]
    ds = prepare_sft_dataset(tokenizer, path=write_jsonl(rows), max_seq_length=64, packing=False)
    assert tokenizer.decode(ds[0]["input_ids"]).startswith("<|im_start|>user\nreverse\n\nabc<|im_end|>")
    assert [trained_text(tokenizer, ds[i]) for i in range(2)] == ["cba<|im_end|>", "hi<|im_end|>"]


def test_prompt_completion_trains_the_completion_and_eos(tokenizer, write_jsonl) -> None:
    path = write_jsonl([{"prompt": "abc -> ", "completion": "cba"}])
    ds = prepare_sft_dataset(tokenizer, path=path, max_seq_length=64, packing=False)
    assert tokenizer.decode(ds[0]["input_ids"]) == "abc -> cba<|im_end|>"
    assert trained_text(tokenizer, ds[0]) == "cba<|im_end|>"


def test_plain_text_from_csv_trains_every_token(tokenizer, tmp_path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("body,id\nhello there,1\n,2\n")
    ds = prepare_sft_dataset(tokenizer, path=str(path), max_seq_length=64, packing=False, text_field="body")
    assert ds.summary.dropped == {"empty": 1}
    # The first token is never a target; everything after it is, up to the appended eos.
    assert trained_text(tokenizer, ds[0]) == "ello there<|im_end|>"


def test_pretokenized_parquet_is_used_as_is(tokenizer, tmp_path) -> None:
    path = tmp_path / "tok.parquet"
    table = {
        "input_ids": [[5, 6, 7, 8, 0, 0], [5, 6, 7], [5, 999]],
        "attention_mask": [[1, 1, 1, 1, 0, 0], [1, 1, 1], [1, 1]],
        "labels": [[-100, -100, 7, 8, -100, -100], [5, 6, 7], [5, 999]],
    }
    pq.write_table(pa.table(table), path)
    ds = prepare_sft_dataset(tokenizer, path=str(path), max_seq_length=8, packing=False)
    assert ds.summary.dropped == {"token id outside the vocabulary": 1}
    assert ds[0] == {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}
    assert ds[1] == {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}


def test_packed_items_restart_positions_and_hold_every_row_once(tokenizer, write_jsonl) -> None:
    words = ["ab", "abcdef", "abc", "abcdefgh", "a", "abcd", "abcdefg"]
    ds = prepare_sft_dataset(
        tokenizer, path=write_jsonl([chat(w, w[::-1]) for w in words]), max_seq_length=80, packing=True
    )
    assert ds.packed and len(ds) == ds.summary.packed_sequences < len(words)
    answers = []
    for i in range(len(ds)):
        item = ds[i]
        assert len(item["input_ids"]) == len(item["labels"]) == len(item["position_ids"]) <= 80
        starts = [j for j, p in enumerate(item["position_ids"]) if p == 0]
        assert item["position_ids"] == [
            j - max(s for s in starts if s <= j) for j in range(len(item["input_ids"]))
        ]
        answers += trained_text(tokenizer, item).split("§")
    assert sorted(answers) == sorted(w[::-1] + "<|im_end|>" for w in words)
    assert 0.5 < ds.summary.fill_ratio <= 1.0
    assert f"packed into {len(ds)} sequences of <= 80 tokens" in str(ds.summary)


def test_num_proc_gives_the_same_samples(tokenizer, write_jsonl) -> None:
    path = write_jsonl([chat(f"reverse: {'ab' * k}", "ba" * k) for k in range(1, 9)])
    one = prepare_sft_dataset(tokenizer, path=path, max_seq_length=64, packing=False)
    two = prepare_sft_dataset(tokenizer, path=path, max_seq_length=64, packing=False, num_proc=2)
    assert [one[i] for i in range(len(one))] == [two[i] for i in range(len(two))]


def test_conversational_prompt_completion(tokenizer, write_jsonl) -> None:
    row = {
        "prompt": [{"role": "user", "content": "reverse: abc"}],
        "completion": [{"role": "assistant", "content": "cba"}],
    }
    ds = prepare_sft_dataset(tokenizer, path=write_jsonl([row]), max_seq_length=64, packing=False)
    assert tokenizer.decode(ds[0]["input_ids"]).startswith("<|im_start|>user\nreverse: abc<|im_end|>")
    assert trained_text(tokenizer, ds[0]) == "cba<|im_end|>"


def test_a_multi_turn_prompts_answers_are_context_not_trained(tokenizer, write_jsonl) -> None:
    """Only the completion's assistant turns are trained (TRL's completion_only_loss); a prompt that holds earlier
    turns keeps their answers untrained, and a completion without an assistant turn leaves nothing to train."""
    row = {
        "prompt": [
            {"role": "user", "content": "reverse: ab"},
            {"role": "assistant", "content": "ba"},
            {"role": "user", "content": "reverse: abc"},
        ],
        "completion": [{"role": "assistant", "content": "cba"}],
    }
    empty = {"prompt": row["prompt"][:2], "completion": [{"role": "user", "content": "thanks"}]}
    ds = prepare_sft_dataset(tokenizer, path=write_jsonl([row, empty]), max_seq_length=96, packing=False)
    assert "<|im_start|>assistant\nba<|im_end|>" in tokenizer.decode(ds[0]["input_ids"])
    assert trained_text(tokenizer, ds[0]) == "cba<|im_end|>"
    assert len(ds) == 1 and ds.summary.dropped == {"no trainable token": 1}


def test_evaluation_errors_name_the_eval_keys(tokenizer, write_jsonl, tmp_path) -> None:
    from loralei.train.build_data import build_data
    from loralei.train.schema import validate_config

    path = write_jsonl([chat("a", "b")] * 4)

    def cfg(**data):
        raw = {"model": {"name_or_path": "m"}, "data": {"path": path, **data}, "output_dir": str(tmp_path)}
        return validate_config({**raw, "training": {"max_seq_length": 64}})

    with pytest.raises(DataError, match=r"^data\.eval_split: 'validation' cannot be read"):
        build_data(cfg(eval_split="validation"), tokenizer)
    with pytest.raises(DataError, match=r"^data\.eval_path: no such file or directory: '.*nope\.jsonl'"):
        build_data(cfg(eval_path=str(tmp_path / "nope.jsonl"), eval_split="train"), tokenizer)
    train_set, eval_set, _ = build_data(cfg(eval_split="train[:2]"), tokenizer)
    assert (len(train_set), len(eval_set)) == (4, 2)
