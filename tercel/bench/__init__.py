"""`tercel bench`: offline sweeps through the Python API and a load generator for OpenAI-compatible servers."""

# the sweep's choices, here so the command line's --help needs no torch import (offline.py imports torch)
ALGORITHMS = ("NONE", "NGRAM", "EAGLE", "EAGLE3", "DFLASH", "DDTREE")
DEFAULT_CONCURRENCY = (1, 4, 16, 64, 128, 256)
