import sys
from pathlib import Path

import pytest

# Test helpers (tiny_models, tolerances) live beside the tests and are imported as plain modules.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True, scope="session")
def _token_cache_in_tmp(tmp_path_factory):
    """Tests (and the runs they start) fill a token cache of their own, never the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORALEI_CACHE_DIR", str(tmp_path_factory.mktemp("loralei-cache")))
        yield
