"""The one tolerance table of the test suite (DESIGN.md, Numerics). A flat dict, nothing else."""

TOLERANCES = {
    "fp32_rel": 1e-5,  # fused vs plain/twin in fp32: max |a - b| / max |b|
    "low_precision_vs_plain": 2.0,  # bf16/fp16: fused error vs fp64 <= this x the plain error vs fp64
}
