"""Missing models and datasets fail in seconds with the fix: a local-looking path that does not exist at once, a
hub id while the hub is unreachable unless the local cache holds it; the runner, ``validate`` and
``loralei-generate`` check before loading."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

from loralei import hub
from loralei.errors import ConfigError
from loralei.train.data.errors import DataError
from loralei.train.loading import load_config
from loralei.train.run import validate

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The hub unreachable and an empty local cache (returned, to fill)."""
    monkeypatch.setattr(hub, "hub_unreachable", lambda: "HF_HUB_OFFLINE is set")
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def _cache(cache: Path, repo: str, repo_type: str = "model") -> None:
    """A cached snapshot of ``repo``, laid out as huggingface_hub's cache keeps it."""
    folder = cache / f"{repo_type}s--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")


@pytest.mark.parametrize("name", ["./models/nope", "/no/such/dir", "~/nope-dir", "examples/nope"])
def test_a_missing_local_path_fails_at_once(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(hub, "hub_unreachable", lambda: pytest.fail("no network question for a path"))
    with pytest.raises(ConfigError, match=rf"model.name_or_path: no such file or directory: '{name}'"):
        hub.check_source("model.name_or_path", name)


def test_an_unreachable_hub_names_the_local_fix(offline: Path) -> None:
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        hub.check_source("model.name_or_path", "nope")
    assert time.monotonic() - start < 5
    message = str(err.value)
    assert "'nope' is not a local path" in message and "HF_HUB_OFFLINE is set" in message
    assert "hf download nope --local-dir DIR" in message and "set model.name_or_path: DIR" in message


def test_a_cached_hub_id_still_loads_offline(offline: Path) -> None:
    _cache(offline, "org/model")
    _cache(offline, "org/data", "dataset")
    assert hub.check_source("model.name_or_path", "org/model")  # True: load it in offline mode
    assert hub.check_source("data.path", "org/data", "dataset")
    with pytest.raises(ConfigError, match="--repo-type dataset"):
        hub.check_source("data.path", "org/model", "dataset")


def test_a_reachable_hub_is_left_to_the_loaders(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub, "hub_unreachable", lambda: None)
    assert not hub.check_source("model.name_or_path", "org/model")


def test_offline_mode_holds_inside_the_block_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with hub.offline(True):
        assert constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE
    assert not constants.HF_HUB_OFFLINE and not datasets.config.HF_HUB_OFFLINE
    with hub.offline(False):
        assert not constants.HF_HUB_OFFLINE


def test_the_runner_loads_a_cached_model_in_offline_mode(
    offline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the hub unreachable, Transformers loads a cached model without asking the hub (no retries)."""
    import transformers

    from loralei.train import build

    _cache(offline, "org/model")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    seen = []
    for auto in (transformers.AutoConfig, transformers.AutoModelForCausalLM):  # the config, then the weights
        monkeypatch.setattr(auto, "from_pretrained", lambda *a, **k: seen.append(constants.HF_HUB_OFFLINE))
    cfg = load_config(QUICKSTART, ["model.name_or_path=org/model"])
    build.load_model(cfg, torch.device("cpu"))
    assert seen == [True, True] and not constants.HF_HUB_OFFLINE


def test_why_the_hub_is_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    hub.hub_unreachable.cache_clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub.hub_unreachable() == "HF_HUB_OFFLINE is set"
    hub.hub_unreachable.cache_clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def down(*_args, **_kwargs):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", down)
    assert "gave no answer: Name or service not known" in hub.hub_unreachable()
    hub.hub_unreachable.cache_clear()

    def answers(*_args, **_kwargs):
        raise urllib.error.HTTPError(constants.ENDPOINT, 404, "not found", {}, None)

    monkeypatch.setattr(urllib.request, "urlopen", answers)
    assert hub.hub_unreachable() is None
    hub.hub_unreachable.cache_clear()


@pytest.mark.parametrize(
    ("override", "error", "message"),
    [
        ("model.name_or_path=nope", ConfigError, "model.name_or_path: 'nope' is not a local path"),
        ("model.name_or_path=./models/nope", ConfigError, "model.name_or_path: no such file or directory"),
        ("data.path=someone/data", DataError, "data.path: 'someone/data' is not a local path"),
    ],
)
def test_validate_fails_fast(
    offline: Path, monkeypatch: pytest.MonkeyPatch, override, error, message
) -> None:
    monkeypatch.chdir(ROOT)
    start = time.monotonic()
    with pytest.raises(error, match=message):
        validate(load_config(str(QUICKSTART), [override]))
    assert time.monotonic() - start < 10
