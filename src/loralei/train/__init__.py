"""The YAML fine-tuning runner: schema, data, loop, optimizers, checkpoints, logging.

Heavy parts (data, optimizers, the loop) are imported from their modules; this package only re-exports the
config entry points.
"""

from .loading import load_config
from .schema import RunConfig

__all__ = ["RunConfig", "load_config"]
