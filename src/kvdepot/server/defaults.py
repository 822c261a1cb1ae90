"""Server defaults that the command line shows without importing the server (and torch)."""

from __future__ import annotations

import os

DEFAULT_TRANSFER_THREADS = min(4, len(os.sched_getaffinity(0)))
"""CPU engines' copies are memcpy on these threads, and more threads than cores only
contend: on the 2-core development VM four threads moved 10-15 % less than two. CUDA
copies wait on events instead, and GPU hosts have the cores for four."""
