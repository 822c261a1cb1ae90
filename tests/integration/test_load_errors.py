"""A failed retrieve is reported, by the worker client, for the blocks it writes and no other.

vLLM recomputes every block reported as a load error, and rewinds every running request
that holds one; a block the retrieve skips (shared with the engine's prefix cache) or only
lists past its end may belong to other requests, so reporting it would be wrong.
"""

import torch

from kvdepot.protocol import NO_BLOCK

CHUNK = 64  # the server fixture's chunk size; engines use 16-token blocks: 4 per chunk
BLOCK = 16
TOKENS = list(range(3000, 3000 + 2 * CHUNK))


def test_failed_retrieve_reports_only_the_blocks_it_writes(engines):
    engine = engines()
    engine.fill(seed=5)
    # Nothing is stored, so the retrieve fails. Its range spans 8 blocks: the first 5 are
    # the engine's prefix-cache hit (skipped), and 2 more ids are listed past its end.
    dst = list(range(8, 18))
    before = engine.read_blocks(dst)
    errors = engine.retrieve("r", TOKENS, dst, 0, 2 * CHUNK, skip=5 * BLOCK)
    assert errors == set(dst[5:8])
    assert all(torch.equal(a, b) for a, b in zip(before, engine.read_blocks(dst), strict=True))


def test_failed_retrieve_ending_inside_a_chunk_with_two_groups(engines):
    engine = engines(groups=2)
    # All but the prompt's last token; the window group holds its last 5 blocks only and
    # the first block of each group is shared with the prefix cache.
    full = list(range(0, 9))
    window = [NO_BLOCK] * 3 + list(range(19, 25))
    errors = engine.retrieve("r", TOKENS, [full, window], 0, 2 * CHUNK - 1, skip=BLOCK)
    assert errors == set(full[1:8]) | set(window[3:8])
