"""``loralei-generate``: the base model and a trained adapter answer prompts greedily through the chat template;
``--eval`` scores them against a file of chat rows; bad arguments get errors that name the fix. Uses the
quickstart's shipped tiny model and a random adapter."""

from __future__ import annotations

import io
import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loralei import LoRAConfig, inject_lora, load_pretrained, save_pretrained
from loralei.generate import answer, main

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "examples" / "quickstart" / "model"


def _base() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(BASE).eval()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random (non-zero) adapter on the quickstart model; it records the model's directory as its base."""
    torch.manual_seed(0)
    model = inject_lora(_base(), LoRAConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.5)
    return save_pretrained(model, tmp_path_factory.mktemp("gen") / "adapter")


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    status = main(argv)
    out = capsys.readouterr()
    return status, out.out, out.err


def _copy(adapter: Path, tmp_path: Path) -> Path:
    """A copy of the adapter directory, to spoil."""
    copy = tmp_path / "adapter"
    copy.mkdir()
    for f in adapter.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    return copy


def _lines(out: str, key: str) -> list[str]:
    return re.findall(rf"^[ ]*{key}:[ ]*(.*)$", out, flags=re.M)


def test_answers_with_the_base_and_the_adapter(adapter: Path, capsys: pytest.CaptureFixture) -> None:
    prompts = ["upper: lamps", "upper: quiet"]
    argv = [str(adapter), "--compare-base", "--max-new-tokens", "6"]
    status, out, err = _run([*argv, "--prompt", prompts[0], "--prompt", prompts[1]], capsys)
    assert status == 0, err
    assert _lines(out, "prompt") == prompts
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    want_base = [answer(_base(), tokenizer, p, 6) for p in prompts]
    trained = inject_lora(_base(), LoRAConfig(r=4, target_modules="all-linear"))
    load_pretrained(trained, adapter)
    want_adapter = [answer(trained, tokenizer, p, 6) for p in prompts]
    empty = "(nothing: the model ended its turn at once)"  # how an empty answer is shown
    assert _lines(out, "base") == [answer or empty for answer in want_base]
    assert _lines(out, "adapter") == [answer or empty for answer in want_adapter]
    assert want_adapter != want_base  # the adapter is loaded, not ignored


def test_prompts_from_stdin(
    adapter: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("upper: lamps\n\nupper: zebra\n"))
    status, out, err = _run([str(adapter), "--max-new-tokens", "3"], capsys)
    assert status == 0, err
    assert _lines(out, "prompt") == ["upper: lamps", "upper: zebra"] and not _lines(out, "base")


def test_raw_prompts_skip_the_chat_template(adapter: Path, capsys: pytest.CaptureFixture) -> None:
    status, out, err = _run([str(adapter), "--raw", "--prompt", "abc", "--max-new-tokens", "3"], capsys)
    assert status == 0, err
    assert len(_lines(out, "adapter")) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{tmp}/nope", "--prompt", "x"], "adapter: '{tmp}/nope' is not a directory"),
        (["{tmp}", "--prompt", "x"], "holds no loralei_config.json or adapter_config.json"),
        (["{adapter}", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens: 0 must be at least 1"),
        (["{adapter}", "--prompt", "x", "--base", "{tmp}/missing"], "--base: no such file or directory"),
    ],
)
def test_bad_arguments_are_named(
    adapter: Path, tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str], message: str
) -> None:
    fill = {"tmp": str(tmp_path), "adapter": str(adapter)}
    status, _, err = _run([a.format(**fill) for a in argv], capsys)
    assert status == 2 and message.format(**fill) in err, err


def test_an_adapter_without_a_recorded_base_asks_for_one(adapter: Path, tmp_path: Path, capsys) -> None:
    copy = _copy(adapter, tmp_path)
    meta = json.loads((copy / "loralei_config.json").read_text()) | {"base_model_name_or_path": None}
    (copy / "loralei_config.json").write_text(json.dumps(meta))
    status, _, err = _run([str(copy), "--prompt", "x"], capsys)
    assert status == 2 and "records no base model; name it with --base" in err, err


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _turns(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in pairs]


def test_eval_marks_each_answer_and_scores_them(adapter: Path, tmp_path: Path, capsys) -> None:
    """Each row's turns before its last message are the prompt, that message the expected answer; the score counts
    exact matches (surrounding whitespace aside), for the adapter and, with --compare-base, the base model."""
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    trained = inject_lora(_base(), LoRAConfig(r=4, target_modules="all-linear"))
    load_pretrained(trained, adapter)
    one = _turns(("user", "upper: lamps"))
    chat = _turns(("system", "be brief"), ("user", "upper: quiet"), ("assistant", "QUIET"), ("user", "again"))
    right = [answer(trained, tokenizer, turns, 6) for turns in (one, chat)]
    assert right[0] != right[1]  # so that a row scored against the wrong prompt would fail
    rows = [
        {"messages": [*one, {"role": "assistant", "content": f" {right[0]}\n"}]},
        {"messages": [*chat, {"role": "assistant", "content": right[1]}]},
        {"messages": [*one, {"role": "assistant", "content": right[0] + "!"}]},
    ]
    path = _jsonl(tmp_path / "eval.jsonl", [rows[0], "", rows[1], rows[2]])
    status, out, err = _run(
        [str(adapter), "--eval", str(path), "--max-new-tokens", "6", "--compare-base"], capsys
    )
    assert status == 0, err
    assert _lines(out, "prompt") == [
        "upper: lamps",
        "be brief | upper: quiet | QUIET | again",
        "upper: lamps",
    ]
    shown = [a or "(nothing: the model ended its turn at once)" for a in right]
    assert _lines(out, "adapter") == [
        f"{shown[0]}  (right)",
        f"{shown[1]}  (right)",
        f"{shown[0]}  (wrong: expected {right[0] + '!'!r})",
    ]
    base = [answer(_base(), tokenizer, turns, 6) for turns in (one, chat, one)]
    base_right = sum(b == r["messages"][-1]["content"].strip() for b, r in zip(base, rows, strict=True))
    last = out.strip().splitlines()[-1]
    assert (
        last
        == f"exact match on {path}: the adapter 2/3 (67%), the base model {base_right}/3 ({base_right / 3:.0%})"
    )


def test_eval_without_compare_base_scores_the_adapter_alone(adapter: Path, tmp_path: Path, capsys) -> None:
    path = _jsonl(
        tmp_path / "eval.jsonl", [{"messages": _turns(("user", "upper: lamps"), ("assistant", "x"))}]
    )
    status, out, err = _run([str(adapter), "--eval", str(path), "--max-new-tokens", "3"], capsys)
    assert status == 0, err
    assert (
        not _lines(out, "base")
        and out.strip().splitlines()[-1] == f"exact match on {path}: the adapter 0/1 (0%)"
    )


ONE_ROW = 'one row per line: {"messages": [{"role": "user", "content": PROMPT}'
NOT_CHAT = '--eval: \'FILE\' line 1 has no "messages" list of turns with a string "role" and "content"'


@pytest.mark.parametrize(
    ("lines", "argv", "message"),
    [
        (None, [], "--eval: 'FILE' is not a file; pass a JSONL file with " + ONE_ROW),
        (["", "  "], [], "--eval: 'FILE' holds no rows; write " + ONE_ROW),
        (["{not json"], [], "--eval: 'FILE' line 1 is not JSON (Expecting property name"),
        (['{"text": "x"}'], [], NOT_CHAT),
        (['["upper: abcde", "ABCDE"]'], [], NOT_CHAT),
        (['{"messages": []}'], [], NOT_CHAT),
        (['{"messages": [{"role": "user"}]}'], [], NOT_CHAT),
        (
            ["", '{"messages": [{"role": "user", "content": "upper: abcde"}]}'],
            [],
            "--eval: 'FILE' line 2 ends with a 'user' turn, not an assistant turn; end each row with the "
            "assistant's expected answer",
        ),
        (
            ['{"messages": [{"role": "assistant", "content": "ABCDE"}]}'],
            [],
            "--eval: 'FILE' line 1 holds only the expected answer; put the prompt's user turn before it",
        ),
        ([], ["--prompt", "x"], "--eval: 'FILE' brings its own prompts; pass --prompt or --eval, not both"),
        ([], ["--raw"], "--raw: --eval rows are chat turns, rendered with the chat template; drop --raw"),
    ],
)
def test_bad_eval_files_are_named(
    adapter: Path, tmp_path: Path, capsys, lines: list[str] | None, argv: list[str], message: str
) -> None:
    path = tmp_path / "eval.jsonl"
    if lines is not None:
        path.write_text("".join(line + "\n" for line in lines))
    status, _, err = _run([str(adapter), "--eval", str(path), *argv], capsys)
    assert status == 2 and message.replace("FILE", str(path)) in err, err


def test_an_eval_file_that_is_not_text_is_named(adapter: Path, tmp_path: Path, capsys) -> None:
    path = tmp_path / "eval.jsonl"
    path.write_bytes(b"\xff\xfe\x00binary")
    status, _, err = _run([str(adapter), "--eval", str(path)], capsys)
    assert status == 2 and f"--eval: '{path}' is not UTF-8 text" in err and "pass a JSONL file" in err, err


def _quickstart_generate_args() -> list[str]:
    recipe = (ROOT / "Makefile").read_text().split("\nquickstart:")[1].split("\n\n")[0]
    command = next(line for line in recipe.replace("\\\n", " ").splitlines() if "loralei-generate" in line)
    return shlex.split(command.strip())


def test_the_quickstart_ends_with_held_out_prompts_on_its_adapter() -> None:
    """``make quickstart`` trains, then scores the base model's and the adapter's answers to the held-out rows,
    which share no prompt with the training data, from the adapter directory the quickstart config writes."""
    args = _quickstart_generate_args()
    held_out = ROOT / args[args.index("--eval") + 1]
    rows = [json.loads(line)["messages"] for line in held_out.open()]
    training = {
        json.loads(line)["messages"][0]["content"]
        for line in (ROOT / "examples/quickstart/data.jsonl").open()
    }
    assert len(rows) == 30 and not {row[0]["content"] for row in rows} & training
    assert "--compare-base" in args and "outputs/quickstart/adapter" in args


def test_the_base_model_answers_no_held_out_row(capsys) -> None:
    """The quickstart's score is the adapter's doing: the untrained model gets none of the held-out rows."""
    args = _quickstart_generate_args()
    held_out = ROOT / args[args.index("--eval") + 1]
    tokenizer, model = AutoTokenizer.from_pretrained(BASE), _base()
    max_new = int(args[args.index("--max-new-tokens") + 1])
    rows = [json.loads(line)["messages"] for line in held_out.open()]
    assert all(answer(model, tokenizer, row[:-1], max_new) != row[-1]["content"] for row in rows)


def test_a_corrupt_adapter_config_is_named(adapter: Path, tmp_path: Path, capsys) -> None:
    copy = _copy(adapter, tmp_path)
    (copy / "loralei_config.json").write_text("{not json")
    status, _, err = _run([str(copy), "--prompt", "x"], capsys)
    assert status == 2 and "is not readable JSON" in err and "the adapter is corrupt" in err, err
