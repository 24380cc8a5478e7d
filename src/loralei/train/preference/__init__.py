"""Preference objectives (``training.objective: dpo | orpo``): per-pair log-probabilities from the chunked head,
the DPO and ORPO losses, the reference policy (the adapter off, or a frozen adapter), and TRL's metrics."""
