"""Numerics: mixed precision, exact chunked cross-entropy over large vocabularies, and
autograd functions whose backward is written by hand."""

PRECISIONS = ("fp32", "bf16", "fp16")  # train.precision (engine/numerics/precision.py)
