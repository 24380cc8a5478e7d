"""Preference objectives (``training.objective: dpo | orpo | cpo | simpo``): per-pair log-probabilities from the
chunked head, the DPO, ORPO and CPO / SimPO losses, the reference policy (the adapter off, or a frozen adapter), and
TRL's metrics."""
