"""SFT data pipeline: load rows, detect their format, apply the chat template and loss mask, pack, and batch."""

from .collate import PACKING_ISOLATION, block_causal_mask, check_packing_backend, make_collator
from .dataset import SFTDataset, prepare_sft_dataset
from .errors import DataError
from .pack import best_fit_decreasing
from .summary import DataSummary
from .template import IGNORE_INDEX, ChatEncoder

__all__ = [
    "IGNORE_INDEX",
    "PACKING_ISOLATION",
    "ChatEncoder",
    "DataError",
    "DataSummary",
    "SFTDataset",
    "best_fit_decreasing",
    "block_causal_mask",
    "check_packing_backend",
    "make_collator",
    "prepare_sft_dataset",
]
