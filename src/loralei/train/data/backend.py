"""The tokenizer as plain data: what tokenization workers rebuild it from, and what the token cache is keyed on.

A Transformers fast tokenizer is a ``tokenizers.Tokenizer`` (its ``backend_tokenizer``) plus settings that Transformers
applies around each call: no truncation or padding unless asked, and ``split_special_tokens``. ``TokenizerSpec``
holds the serialized backend and those settings, so a worker process rebuilds the same tokenizer with the
``tokenizers`` package alone, and ``digest`` says whether two tokenizers encode alike.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class TokenizerSpec:
    """A fast tokenizer's state.

    Attributes:
        serialized: ``backend_tokenizer.to_str()``.
        split_special_tokens: encode special-token strings found in text as plain text.
        eos_token_id: appended to plain-text rows (None when the tokenizer has none).
        vocab_size: ``len(tokenizer)``; pretokenized ids at or above it are outside the vocabulary.
        special_tokens: the tokenizer's special tokens map (chat templates read these).
    """

    serialized: str
    split_special_tokens: bool
    eos_token_id: int | None
    vocab_size: int
    special_tokens: dict[str, Any]

    @classmethod
    def of(cls, tokenizer: Any) -> TokenizerSpec | None:
        """The spec of a Transformers tokenizer, or None when it has no fast (``tokenizers``) backend."""
        backend = (
            getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        )
        if backend is None:
            return None
        return cls(
            serialized=backend.to_str(),
            split_special_tokens=bool(getattr(tokenizer, "split_special_tokens", False)),
            eos_token_id=tokenizer.eos_token_id,
            vocab_size=len(tokenizer),
            special_tokens=dict(tokenizer.special_tokens_map),
        )

    def build(self) -> Any:
        """A ``tokenizers.Tokenizer`` that encodes as the Transformers tokenizer does with ``tokenizer(text)``."""
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(self.serialized)
        tok.no_truncation()
        tok.no_padding()
        tok.encode_special_tokens = self.split_special_tokens
        return tok

    def digest(self) -> str:
        """A hash of everything here: equal digests encode every text to the same tokens."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        """The spec as a JSON-able dict (``TokenizerSpec(**d)`` rebuilds it)."""
        return asdict(self)


class SlowTokenizer:
    """A tokenizer without a fast backend behind the ``encode`` calls of ``tokenizers.Tokenizer`` that row encoding
    uses: ids only (no character offsets, so no chat formats), in this process only, never cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> _Ids:
        """The ids of ``text``, as an object with ``.ids``."""
        return _Ids(list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]))


@dataclass(frozen=True)
class _Ids:
    ids: list[int]

    def __len__(self) -> int:
        return len(self.ids)
