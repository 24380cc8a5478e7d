"""DataSummary: what preparation kept, dropped, truncated and packed, printed as one line."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DataSummary:
    """Counts from ``prepare_sft_dataset``.

    Attributes:
        rows_read: rows in the loaded split.
        rows_kept: rows that became training samples.
        dropped: drop reason -> number of rows (e.g. ``{"too long": 3}``).
        truncated: kept rows that were cut to ``max_seq_length``.
        tokens: tokens in the kept samples.
        trainable_tokens: tokens with a loss (labels other than -100).
        max_seq_length: the length limit used.
        packed_sequences: number of packed sequences, 0 when packing is off.
        from_cache: the tokens were read from the token cache rather than tokenized now.
    """

    rows_read: int
    rows_kept: int
    dropped: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    tokens: int = 0
    trainable_tokens: int = 0
    max_seq_length: int = 0
    packed_sequences: int = 0
    from_cache: bool = False

    @property
    def fill_ratio(self) -> float | None:
        """Share of packed-sequence slots holding a token (None when not packed)."""
        if not self.packed_sequences:
            return None
        return self.tokens / (self.packed_sequences * self.max_seq_length)

    def __str__(self) -> str:
        n_dropped = sum(self.dropped.values())
        reasons = ", ".join(f"{n:,} {why}" for why, n in sorted(self.dropped.items(), key=lambda kv: -kv[1]))
        parts = [f"data: {self.rows_read:,} rows read, {self.rows_kept:,} kept"]
        parts.append(f"{n_dropped:,} dropped ({reasons})" if n_dropped else "0 dropped")
        parts.append(f"{self.truncated:,} truncated to {self.max_seq_length}")
        line = ", ".join(parts) + f"; {self.tokens:,} tokens, {self.trainable_tokens:,} trained"
        if self.fill_ratio is not None:
            line += (
                f"; packed into {self.packed_sequences:,} sequences of <= {self.max_seq_length} tokens "
                f"({self.fill_ratio:.1%} full)"
            )
        return line + ("; tokens from the cache" if self.from_cache else "")
