"""Numerics: mixed precision, exact chunked cross-entropy over large vocabularies, and
autograd functions whose backward is written by hand."""

# train.precision (engine/numerics/precision.py); fp8: float8 Linear layers (float8.py)
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
# How to install torchao, which fp8 needs (pyproject.toml's extra `fp8`).
FP8_INSTALL = "pip install 'cumulus[fp8]' (or pip install -e '.[fp8]' in a checkout)"
