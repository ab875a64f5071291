"""How the CPU engine pads its batches, so a row's numbers do not depend on the rows beside it."""

from __future__ import annotations

import math

# A row's numbers must not depend on how many rows share its GEMM. In fp32 on one thread, AVX-512 MKL
# switches kernels below 16 rows; MKL's COMPATIBLE branch (numerics=reproducible) computes the last
# `rows % 4` rows with a separate tail kernel, and rows < 8 with another. So a decode batch keeps at least
# MIN_ROWS rows and a multiple of ROW_MULTIPLE, padded with "dead" rows
# (`pytest tests/unit/test_engine.py -k batching` checks a seeded request against other batch sizes).
MIN_ROWS = 16
ROW_MULTIPLE = 4


def padded_rows(live: int) -> int:
    """Rows of a decode batch with ``live`` live rows: at least MIN_ROWS, a multiple of ROW_MULTIPLE."""
    return -(-max(live, MIN_ROWS) // ROW_MULTIPLE) * ROW_MULTIPLE


def prompt_width(length: int, pad_multiple: int) -> int:
    """The padded prefill width of a prompt of ``length`` tokens: requests of one width share a cohort."""
    mult = math.lcm(pad_multiple, ROW_MULTIPLE)  # prefill GEMMs have (prompts x width) rows
    return -(-length // mult) * mult
