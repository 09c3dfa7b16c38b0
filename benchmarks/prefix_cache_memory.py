"""The host memory the prefix cache holds: a BlockManager of --blocks blocks filled once with
sequences of distinct token ids (fresh int objects, as a prompt unpickled off the engine process's
pipe gives), then recycled several times over (every allocation evicting cached blocks). The heap
(tracemalloc) after each round: it grows while blocks are cached for the first time, to about
0.4 KB a block, then stays flat: the ceiling an engine's RSS climbs to under a load without shared
prefixes.

    python benchmarks/prefix_cache_memory.py [--blocks 57556] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import pickle
import random
import tracemalloc

from fp8route.engine.blocks import ROOT, BlockManager

BLOCK_SIZE, SEQ_BLOCKS, VOCAB = 16, 80, 128256


def run_sequence(manager: BlockManager, rng: random.Random) -> None:
    """One sequence of SEQ_BLOCKS full blocks: allocated, each cached as it fills, then freed."""
    n = min(SEQ_BLOCKS, manager.free_blocks)
    ids = pickle.loads(pickle.dumps([rng.randrange(VOCAB) for _ in range(n * BLOCK_SIZE)]))
    blocks = manager.allocate(n)
    assert blocks is not None
    parent = ROOT
    for i, block in enumerate(blocks):
        parent = manager.cache_full_block(block, parent, ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
    manager.free(blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=57556, help="the pool's blocks (default: the H200 8B server's)")
    ap.add_argument("--rounds", type=int, default=3, help="times the pool is recycled after the first fill")
    args = ap.parse_args()
    rng = random.Random(0)
    tracemalloc.start()
    gc.collect()
    manager = BlockManager(args.blocks + 1, BLOCK_SIZE)  # + the scratch block
    base = tracemalloc.get_traced_memory()[0]
    while manager.fresh:
        run_sequence(manager, rng)
    for round_ in range(args.rounds + 1):
        if round_:
            for _ in range(args.blocks // SEQ_BLOCKS):
                run_sequence(manager, rng)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        print(
            f"pool recycled {round_}x after the first fill: {len(manager.cached)} blocks cached, "
            f"{held / 2**20:.1f} MiB held, {held / len(manager.cached):.0f} B a block",
            flush=True,
        )


if __name__ == "__main__":
    main()
