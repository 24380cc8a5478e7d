"""Third-party noise is silenced at its source and nowhere else: TorchAO's load messages and torch's pytree Enum
deprecation around the imports that load TorchAO, one warning message around one call."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from loralei.quiet import IMPORT_LOGGERS, ignoring_warning, quiet_import_logs

ROOT = Path(__file__).resolve().parents[1]
needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="TorchAO not installed"
)


def run_fresh(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (TorchAO speaks only the first time it is imported)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)


@needs_torchao
def test_quantized_bases_import_torchao_only_when_packing_and_quietly():
    code = "import sys, logging\nimport loralei.modules.quantized\nassert 'torchao' not in sys.modules\n"
    code += "from loralei.modules.quantized.nf4 import torchao_nf4\ntorchao_nf4()\nassert 'torchao' in sys.modules\n"
    code += f"print([logging.getLogger(n).level for n in {IMPORT_LOGGERS!r}])"
    done = run_fresh(code)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.strip() == "[0, 0]"  # the loggers' levels are put back


@needs_torchao
def test_transformers_modeling_code_loads_torchao_quietly():
    done = run_fresh("import sys\nimport loralei.fusion\nassert 'torchao' in sys.modules")
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_quiet_import_logs_mutes_only_inside_and_restores_levels(caplog):
    logger = logging.getLogger(IMPORT_LOGGERS[0])
    logger.setLevel(logging.INFO)
    try:
        with quiet_import_logs():
            assert logger.level == logging.ERROR
            logger.warning("muted")
        assert logger.level == logging.INFO
        logger.warning("heard")
    finally:
        logger.setLevel(logging.NOTSET)
    assert [record.getMessage() for record in caplog.records] == ["heard"]


def test_ignoring_warning_ignores_that_message_only(recwarn):
    with ignoring_warning("torch.distributed is disabled"):
        warnings.warn(
            "torch.distributed is disabled, unavailable or uninitialized, ...", UserWarning, stacklevel=1
        )
        warnings.warn("something else", UserWarning, stacklevel=1)
    warnings.warn("torch.distributed is disabled again", UserWarning, stacklevel=1)
    assert [str(w.message) for w in recwarn] == ["something else", "torch.distributed is disabled again"]
