"""``training.report_to: [tensorboard]`` writes the logged metrics as TensorBoard scalars in
``<output_dir>/tensorboard``, read back here with TensorBoard's own event reader; a resumed run keeps one value
per step; without the package the config check names the extra."""

from __future__ import annotations

import importlib.util
import time

import pytest
from test_run import losses, make_cfg, run

from loralei.errors import ConfigError
from loralei.train import build
from loralei.train.metrics import read_log

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def _scalars(out, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every event of ``tag``, in the order TensorBoard reads them."""
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_metrics_are_written_as_scalars(tmp_path) -> None:
    out = tmp_path / "run"
    run(make_cfg(out, training={"report_to": ["tensorboard"]}))
    logged = {r["step"]: r for r in read_log(out) if "loss" in r}
    for tag in ("loss", "lr", "tokens_per_s"):
        scalars = _scalars(out, tag)
        assert [step for step, _ in scalars] == list(logged), tag
        assert [value for _, value in scalars] == pytest.approx(
            [r[tag] for r in logged.values()], rel=1e-6
        ), tag


def _wait_for_the_next_second() -> None:
    """TensorBoard reads a folder's event files in name order, and names them by the writer's second, then host,
    pid and a per-process counter: two writers of one process in one second sort backwards where the counter
    passes 9 to 10, and the reader then applies the resumed run's purge before the first run's events. A user
    resumes in a new process, later; this test runs both in one, so it starts the second in a later second."""
    start = int(time.time())
    while int(time.time()) == start:
        time.sleep(0.01)


def test_a_resumed_run_has_one_value_per_step(tmp_path) -> None:
    out = tmp_path / "run"
    training = {"report_to": "tensorboard", "save_steps": 3}

    def stop_after_step_4(state) -> None:
        if state.global_step == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(make_cfg(out, training=training), callbacks=[stop_after_step_4])
    _wait_for_the_next_second()
    run(make_cfg(out, training={**training, "resume_from_checkpoint": True}))
    scalars = _scalars(out, "loss")  # the first run's step 4, after the checkpoint, is dropped
    assert [step for step, _ in scalars] == [1, 2, 3, 4, 5, 6]
    assert [value for _, value in scalars] == pytest.approx(losses(out))


def test_a_missing_package_names_the_extra(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard" else real(n, *a)
    )
    with pytest.raises(
        ConfigError,
        match=r"training.report_to: tensorboard needs the 'tensorboard' package.*loralei\[tensorboard\]",
    ):
        build.check_optional_dependencies(make_cfg(tmp_path, training={"report_to": ["tensorboard"]}))
