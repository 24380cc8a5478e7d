"""Tokenization in worker processes: the same bytes as one process, nothing heavy imported, clean stops."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_helpers import REPO, chat
from tqdm import tqdm

from loralei.train.data import DataError, prepare_sft_dataset
from loralei.train.data import tokens as tokens_module
from loralei.train.data import workers as workers_module


def _chat_rows(count: int) -> list[dict]:
    rows = []
    for k in range(count):
        word = "abcdefghij"[: 1 + k % 10] * (1 + k % 3)
        rows.append(chat(f"reverse: {word}", word[::-1]))
        if k % 17 == 0:
            rows.append({"messages": [{"role": "robot", "content": "x"}]})  # malformed
        if k % 23 == 0:
            rows.append({"messages": []})  # empty
    return rows


@pytest.fixture
def parallel_at_any_size(monkeypatch):
    """Workers even for a few hundred rows: a small sample, and no minimum time to make them worth it."""
    monkeypatch.setattr(tokens_module, "SAMPLE_ROWS", 50)
    monkeypatch.setattr(tokens_module, "MIN_PARALLEL_SECONDS", 0.0)


def _entry(cache: Path) -> Path:
    (entry,) = [p for p in (cache / "tokens").iterdir() if not p.name.startswith(".")]
    return entry


def _prepare_in(cache: Path, monkeypatch, tokenizer, path: str, num_proc: int, **kw):
    monkeypatch.setenv("LORALEI_CACHE_DIR", str(cache))
    return prepare_sft_dataset(
        tokenizer, path=path, max_seq_length=64, packing=False, num_proc=num_proc, **kw
    )


def _pretokenized(tmp_path: Path) -> str:
    rng = np.random.default_rng(0)
    ids = [rng.integers(4, 99, size=int(n)).tolist() for n in rng.integers(1, 40, size=300)]
    labels = [[-100 if j % 3 else t for j, t in enumerate(row)] for row in ids]
    path = tmp_path / "tok.parquet"
    pq.write_table(pa.table({"input_ids": ids, "labels": labels}), path)
    return str(path)


@pytest.mark.parametrize("data", ["chat", "pretokenized"])
def test_workers_write_the_same_bytes_as_one_process(
    tokenizer, write_jsonl, tmp_path, monkeypatch, parallel_at_any_size, data
) -> None:
    path = write_jsonl(_chat_rows(300)) if data == "chat" else _pretokenized(tmp_path)
    spawned = []
    original = workers_module.run_workers
    monkeypatch.setattr(tokens_module, "run_workers", lambda *a: spawned.append(a[1]) or original(*a))
    one = _prepare_in(tmp_path / "one", monkeypatch, tokenizer, path, 1)
    assert spawned == []
    two = _prepare_in(tmp_path / "two", monkeypatch, tokenizer, path, 2)
    assert spawned == [2]
    files = sorted(p.name for p in _entry(tmp_path / "one").glob("*.npy"))
    arrays = ["counts.npy", "ids.npy", "offsets.npy", "reasons.npy", "trained.npy"]
    assert files == sorted(arrays + (["labels.npy"] if data == "pretokenized" else []))
    assert sorted(p.name for p in _entry(tmp_path / "two").iterdir()) == sorted([*files, "meta.json"])
    for name in files:
        assert (_entry(tmp_path / "one") / name).read_bytes() == (
            _entry(tmp_path / "two") / name
        ).read_bytes()
    assert str(one.summary) == str(two.summary)
    if data == "chat":
        assert (one.summary.dropped["malformed"], one.summary.dropped["empty"]) == (18, 14)


def test_workers_import_no_torch_transformers_or_datasets() -> None:
    probe = "import json, loralei.train.data.shard\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    out = subprocess.run(
        [sys.executable, "-c", workers_module.STUB_PACKAGES + probe, str(workers_module.PACKAGE_DIR)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    loaded = set(json.loads(out))
    assert {"numpy", "pyarrow", "jinja2"} <= loaded
    assert not loaded & {"torch", "transformers", "datasets", "triton"}


def test_a_failing_worker_is_one_line_naming_the_setting(
    tokenizer, write_jsonl, tmp_path, monkeypatch, parallel_at_any_size
) -> None:
    def broken_save(job, path: Path) -> None:
        path.write_text(json.dumps({**job.__dict__, "rows": str(tmp_path / "gone.arrow")}))

    monkeypatch.setattr(tokens_module.EncodeJob, "save", broken_save)
    with pytest.raises(
        DataError, match=r"^training\.preprocessing_num_workers: tokenization worker \d failed \("
    ):
        _prepare_in(tmp_path / "cache", monkeypatch, tokenizer, write_jsonl(_chat_rows(300)), 2)
    assert not [p for p in (tmp_path / "cache" / "tokens").iterdir()]  # nothing half written is kept


def test_interrupted_workers_are_stopped_and_nothing_is_cached(
    tokenizer, write_jsonl, tmp_path, monkeypatch, parallel_at_any_size
) -> None:
    started = []

    class Popen(subprocess.Popen):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)

    class Interrupted(tqdm):
        def update(self, n: float = 1) -> None:
            raise KeyboardInterrupt

    bar = workers_module.progress.bar

    def interrupted_while_the_workers_run(*args, **kwargs):
        return (Interrupted if kwargs["desc"].startswith("tokenizing (") else bar)(*args, **kwargs)

    monkeypatch.setattr(workers_module.subprocess, "Popen", Popen)
    monkeypatch.setattr(workers_module.progress, "bar", interrupted_while_the_workers_run)
    with pytest.raises(KeyboardInterrupt):
        _prepare_in(tmp_path / "cache", monkeypatch, tokenizer, write_jsonl(_chat_rows(3000)), 2)
    assert len(started) == 2 and all(p.returncode is not None for p in started)
    assert not [p for p in (tmp_path / "cache" / "tokens").iterdir()]


CTRL_C_SCRIPT = """
import sys
from transformers import AutoTokenizer
from loralei.train.data import prepare_sft_dataset
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
prepare_sft_dataset(tokenizer, path=sys.argv[2], max_seq_length=4096, packing=True)
"""


def test_ctrl_c_during_tokenization_stops_everything_with_one_traceback(tmp_path, write_jsonl) -> None:
    long_reply = "abcdefghijklmnopqrstuvwxyz " * 60
    path = write_jsonl([chat(f"say {k}", long_reply) for k in range(20_000)])
    cache = tmp_path / "cache"
    env = {**os.environ, "LORALEI_CACHE_DIR": str(cache), "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    script = [sys.executable, "-c", CTRL_C_SCRIPT, str(REPO / "examples/quickstart/model"), path]
    # Ctrl-C's default action in the child, as in a terminal, however this suite was started: a shell starts a
    # background job (`make test &`) with SIGINT ignored, which the child would inherit
    proc = subprocess.Popen(
        script,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not list(cache.glob("tokens/.tmp-*/worker-*.log")):
        assert proc.poll() is None and time.monotonic() < deadline, "the workers never started"
        time.sleep(0.1)
    workers = {pid: _started(pid) for pid in _children(proc.pid)}
    os.killpg(
        proc.pid, signal.SIGINT
    )  # what the terminal does: the foreground group (the workers have their own)
    stderr = proc.communicate(timeout=60)[1]
    assert proc.returncode != 0
    assert stderr.count("Traceback") == 1 and stderr.rstrip().endswith("KeyboardInterrupt")
    # gone by the time the main process has exited (it kills and reaps them; left running, they would die
    # later, of the closed pipe); a pid is matched with its start time, since another process may reuse it
    assert workers and not [pid for pid, start in workers.items() if _running(pid, start)]
    assert not list((cache / "tokens").iterdir())


def test_ctrl_c_received_by_another_thread_while_workers_start_leaves_none_running(
    tmp_path, monkeypatch
) -> None:
    """The kernel may hand the process's SIGINT to any thread (pyarrow's, the tokenizers'); Python then raises in
    the main thread wherever it is. Raised inside ``Popen`` after the fork, it would leave that worker running:
    the start waits for the block to end, and every worker started is killed and reaped."""
    monkeypatch.setattr(workers_module, "worker_command", lambda *_: [sys.executable, "-c", "input()"])
    listener = threading.Thread(target=threading.Event().wait, args=(30,), daemon=True)
    listener.start()
    started: list[subprocess.Popen] = []
    popen = subprocess.Popen

    def start(*args, **kwargs) -> subprocess.Popen:
        started.append(popen(*args, **kwargs))
        if len(started) == 1:
            signal.pthread_kill(listener.ident, signal.SIGINT)
            time.sleep(0.5)  # where the interrupt lands, before run_workers holds the process
        return started[-1]

    monkeypatch.setattr(workers_module.subprocess, "Popen", start)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            workers_module.run_workers(tmp_path / "job.json", 2, 10, tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(started) == 2 and all(proc.returncode is not None for proc in started)


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None without that process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot): with the pid, it names one process even after the
    pid is given to another."""
    fields = _stat_fields(pid)
    return None if fields is None else fields[19]


def _running(pid: int, started: str | None) -> bool:
    """Whether the process that had ``pid`` when it started at ``started`` is still there (a zombie counts: nobody
    reaped it)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[19] == started


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    stats = ((int(path.name), _stat_fields(int(path.name))) for path in Path("/proc").glob("[0-9]*"))
    return [child for child, fields in stats if fields is not None and int(fields[1]) == pid]


def test_the_number_of_workers(monkeypatch) -> None:
    monkeypatch.setattr(tokens_module, "usable_cores", lambda: 3)
    assert tokens_module.resolve_workers("auto") == tokens_module.resolve_workers(None) == 3
    assert tokens_module.resolve_workers(1) == 1
    for bad in (0, -2, "four", True):
        with pytest.raises(
            DataError, match=r"^training\.preprocessing_num_workers: must be auto or an integer"
        ):
            tokens_module.resolve_workers(bad)


def test_usable_cores_follow_the_affinity_and_a_container_quota(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    quota = tmp_path / "cpu.max"
    for text, cores in (
        ("max 100000\n", 64),
        ("200000 100000\n", 2),
        ("150000 100000\n", 2),
        ("1000 100000", 1),
    ):
        quota.write_text(text)
        assert tokens_module.usable_cores(quota) == cores
    assert tokens_module.usable_cores(tmp_path / "none") == 64


def test_the_config_defaults_to_auto_workers(tmp_path) -> None:
    from loralei.errors import ConfigError
    from loralei.train.schema import validate_config

    def cfg(**training):
        raw = {"model": {"name_or_path": "m"}, "data": {"path": "d.jsonl"}, "output_dir": str(tmp_path)}
        return validate_config({**raw, "training": training})

    assert cfg().training.preprocessing_num_workers == "auto"
    assert cfg(preprocessing_num_workers=3).training.preprocessing_num_workers == 3
    for bad in (0, "many"):
        with pytest.raises(ConfigError, match="preprocessing_num_workers"):
            cfg(preprocessing_num_workers=bad)
