"""Start-up: ``import loralei``, ``loralei-finetune --help`` and config errors load neither torch, Transformers,
datasets nor TorchAO (each case runs in a fresh interpreter), while the public API still imports as before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import loralei

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "datasets", "torchao")
REPORT = f"\nimport sys\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))"


def heavy_modules_after(code: str) -> list[str]:
    """The heavy modules a fresh interpreter has loaded after running ``code``."""
    done = subprocess.run(
        [sys.executable, "-c", code + REPORT], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [m for m in done.stdout.rstrip("\n").split("\n")[-1].split(",") if m]


def test_importing_the_cli_loads_nothing_heavy():
    assert heavy_modules_after("import loralei.cli") == []


def test_help_loads_nothing_heavy():
    code = "import contextlib, io\nfrom loralei.cli import main\n"
    code += "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n    main(['--help'])"
    assert heavy_modules_after(code) == []


@pytest.mark.parametrize("command", [[], ["validate"]], ids=["train", "validate"])
def test_a_config_error_is_reported_before_anything_heavy_loads(tmp_path, command):
    path = tmp_path / "bad.yaml"
    config = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    config["training"]["batch_size"] = "abc"
    path.write_text(yaml.safe_dump(config))
    code = f"from loralei.cli import main\nassert main({[*command, str(path)]!r}) == 2"
    assert heavy_modules_after(code) == []


def test_config_schema_and_lora_config_load_without_torch():
    code = "from loralei import LoRAConfig\nfrom loralei.train import load_config\n"
    code += "LoRAConfig(r=8, quantize_base=True, quantization_device='cuda')\n"
    code += "load_config('examples/quickstart.yaml', ['training.max_steps=50'])"
    assert heavy_modules_after(code) == []


def test_the_public_api_imports_as_before():
    assert set(loralei.__all__) <= set(dir(loralei))
    for name in loralei.__all__:  # what `from loralei import *` and `from loralei import name` look up
        assert getattr(loralei, name).__name__ == name
    assert loralei.inject.inject_lora is loralei.inject_lora  # submodules load on first use too
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        loralei.nope  # noqa: B018
