"""The staged load's move alone: 512 staged blocks of 32 layers (1 GiB, an 8,192-token hit
of a Llama-3.1-8B-shaped model in vLLM's flash-attention layout) copied into random KV
cache blocks, as `staging.move_plan` copies them (whole 64-bit words of whole blocks) and
along the block axis of the `bfloat16` tensors (its fallback), beside one plain device
copy of 1 GiB. Checks both write the same bytes. Needs a CUDA device:

    python scripts/staged_move.py
"""

from __future__ import annotations

import torch

from kvdepot.integrations.vllm.staging import mirror_caches, move_blocks, move_plan

LAYERS, CACHE_BLOCKS, STAGED_BLOCKS, BLOCK_SIZE = 32, 16000, 512
REPEATS = 8


def gpu_ms(copy: object) -> float:
    """Median GPU time of `copy()` over REPEATS runs, in ms."""
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy()  # type: ignore[operator]
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    device = torch.device("cuda")
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(
        (2, CACHE_BLOCKS, BLOCK_SIZE, 8, 128), dtype=torch.bfloat16, device=device)
        for i in range(LAYERS)}
    _, pairs = mirror_caches(caches, BLOCK_SIZE, STAGED_BLOCKS)
    for _, staged, _ in pairs:
        staged.normal_()
    plan = move_plan(pairs)
    blocks = torch.randperm(CACHE_BLOCKS)[:STAGED_BLOCKS].tolist()
    for name, moves in (("along the block axis", pairs), ("whole words (move_plan)", plan)):
        ms = gpu_ms(lambda moves=moves: move_blocks(moves, 0, blocks))
        print(f"move of 1 GiB, {name}: {ms:.3f} ms")
    along_axis = [cache.clone() for cache, _, _ in pairs]
    for cache, _, _ in pairs:
        cache.zero_()
    move_blocks(plan, 0, blocks)
    same = all(torch.equal(a, cache) for a, (cache, _, _) in zip(along_axis, pairs, strict=True))
    print(f"both write the same bytes: {same}")
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    print(f"one plain 1 GiB device copy: {gpu_ms(lambda: target.copy_(source)):.3f} ms")


if __name__ == "__main__":
    main()
