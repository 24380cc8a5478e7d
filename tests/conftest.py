import sys
from pathlib import Path

# Test helpers (tiny_models, tolerances) live beside the tests and are imported as plain modules.
sys.path.insert(0, str(Path(__file__).parent))
