"""Silence what optional dependencies print at import that no user can act on.

torchao (the `fp8` extra, and imported by transformers' quantizers whenever it is installed)
prints, in every process that imports transformers:

- "Failed to load .../torchao/_C_mxfp8...so" and ".../_C_cutlass_90a.abi3.so": optional
  CUDA kernels built for another torch; float8 training (`train.precision=fp8`,
  `torchao.float8`) does not use them;
- two torch warnings that torchao's own Enums are registered with `register_constant`, a
  call torch 2.13 deprecates ("... is an Enum subclass and is now natively supported ...").

Each is dropped by a filter on the logger that emits it, matching only that message from
torchao; everything else these loggers say still reaches the console. Torch-free (logging
only): installing the filters imports nothing.
"""

from __future__ import annotations

import logging
import re

# torchao/__init__.py: logger.warning(f"Failed to load {file}: {e}") for its _C*.so files.
_TORCHAO_KERNELS = re.compile(r"Failed to load \S*torchao[/\\]_C[^/\\]*\.so: ")
# torch/utils/_pytree.py's deprecation of register_constant on an Enum subclass.
_ENUM_CONSTANT = "is an Enum subclass and is now natively supported"


def _not_torchao_kernel_load(record: logging.LogRecord) -> bool:
    return not _TORCHAO_KERNELS.match(record.getMessage())


def _not_torchao_enum_constant(record: logging.LogRecord) -> bool:
    """False only for the deprecation about one of torchao's own Enums."""
    if _ENUM_CONSTANT not in str(record.msg) or not record.args:
        return True
    cls = record.args[0] if isinstance(record.args, tuple) else record.args
    return not (isinstance(cls, type) and cls.__module__.split(".")[0] == "torchao")


def silence_dependency_noise() -> None:
    """Install the filters (idempotent); call before torchao or transformers is imported."""
    for name, keep in (
        ("torchao", _not_torchao_kernel_load),
        ("torch.utils._pytree", _not_torchao_enum_constant),
    ):
        logger = logging.getLogger(name)
        if keep not in logger.filters:
            logger.addFilter(keep)
