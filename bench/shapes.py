"""One registry of shapes, used by the benchmarks and the tests (tokamax's arg_specs idea)."""

from __future__ import annotations

# (rows, width) of the activations the row-wise ops see: a 16K-token batch of a 4096-wide model.
HEADLINE_ROWS = (16384, 4096)
# Small enough for interpret mode on a CPU, odd enough to exercise partial blocks.
SMOKE_ROWS = (300, 1000)

# Shapes the tests draw from: partial row blocks, widths that are not multiples of any block,
# one row, one column, and a row too wide for one register pass (the chunked Triton path).
ODD_ROWS = (
    (1, 1),
    (3, 7),
    (37, 200),
    (64, 256),
    (130, 129),
    (8, 20000),
)
# Leading dimensions the ops must flatten and restore.
BATCHED = ((2, 3, 40), (2, 1, 5, 24))
