"""Preference objectives (``training.objective: dpo | orpo | cpo | simpo | kto``): per-pair log-probabilities from
the chunked head, the DPO, ORPO, CPO / SimPO and KTO losses, the reference policy (the adapter off, or a frozen
adapter), and TRL's metrics."""
