"""The block manager: allocation, sharing by content, LRU eviction, and nothing leaked."""

import pytest

from fp8route.engine.blocks import ROOT, SCRATCH_BLOCK, BlockManager


def fill(manager: BlockManager, tokens: list[int]) -> list[int]:
    """Allocate and register full blocks for tokens, as a sequence that computed them would."""
    size = manager.block_size
    blocks = manager.allocate(len(tokens) // size)
    assert blocks is not None
    parent = ROOT
    for i, block in enumerate(blocks):
        parent = manager.cache_full_block(block, parent, tokens[i * size : (i + 1) * size])
    return blocks


def test_scratch_is_never_handed_out_and_a_short_pool_gives_nothing():
    manager = BlockManager(5, 4)
    taken = manager.allocate(4)
    assert taken is not None and SCRATCH_BLOCK not in taken
    assert manager.allocate(1) is None and manager.free_blocks == 0
    manager.free(taken)
    assert manager.check_empty() is None and manager.allocate(5) is None  # all or nothing


def test_a_prefix_is_shared_exactly_and_only_its_full_blocks():
    manager = BlockManager(16, 4)
    first = fill(manager, list(range(12)))
    blocks, parent = manager.match_prefix([*range(8), 99, 99, 99, 99, 5], limit=12)
    assert blocks == first[:2] and parent != ROOT
    assert [manager.refs[b] for b in first] == [2, 2, 1]
    # A different first block shares nothing even if later tokens agree (keys chain from the start).
    assert manager.match_prefix([7, 7, 7, 7, *range(4, 12)], limit=12) == ([], ROOT)
    # limit keeps at least the last token for the sequence to compute.
    assert manager.match_prefix(list(range(12)), limit=11)[0] == first[:2]
    manager.free(first[:2])
    manager.free(first[:2])
    manager.free(first)
    assert manager.check_empty() is None


def test_freed_cached_blocks_are_evicted_last_used_last_and_tail_first():
    manager = BlockManager(7, 2)  # 6 usable
    a = fill(manager, [1, 1, 2, 2, 3, 3])
    manager.free(a)
    assert manager.free_blocks == 6 and manager.match_prefix([1, 1, 2, 2, 3, 3, 0], 6)[0] == a
    manager.free(a)
    b = manager.allocate(4)  # three fresh blocks, then the LRU cached one: a's tail
    assert b is not None and a[2] in b and a[0] not in b and a[1] not in b
    assert manager.match_prefix([1, 1, 2, 2, 3, 3], 6)[0] == a[:2]  # the head survived
    manager.free(a[:2])
    manager.free(b)
    assert manager.check_empty() is None


def test_the_same_content_registered_twice_keeps_one_entry():
    manager = BlockManager(8, 2)
    a = fill(manager, [4, 4, 5, 5])
    b = fill(manager, [4, 4, 5, 5])
    assert manager.match_prefix([4, 4, 5, 5, 6], 4)[0] == a
    manager.free(a)
    manager.free(a)
    manager.free(b)
    assert manager.check_empty() is None


def test_prefix_caching_off_shares_nothing():
    manager = BlockManager(8, 2, enable_prefix_caching=False)
    a = fill(manager, [1, 2, 3, 4])
    assert manager.match_prefix([1, 2, 3, 4, 5], 4) == ([], ROOT)
    manager.free(a)
    assert manager.check_empty() is None


def test_freeing_twice_is_caught():
    manager = BlockManager(4, 2)
    a = manager.allocate(1)
    manager.free(a)
    with pytest.raises(AssertionError, match="freed more often than taken"):
        manager.free(a)


def test_the_cache_holds_at_most_one_key_a_block_however_often_the_pool_is_recycled():
    """The host memory of the prefix cache is bounded by the pool: keys of evicted blocks go with them
    (an engine's RSS under a load of unique prompts climbs to this ceiling, then stays)."""
    import gc
    import random
    import tracemalloc

    manager, rng, size = BlockManager(801, 16), random.Random(0), 16

    def sequence() -> None:
        blocks = manager.allocate(40)
        assert blocks is not None
        parent = ROOT
        for block in blocks:
            parent = manager.cache_full_block(block, parent, [rng.randrange(1 << 17) for _ in range(size)])
        manager.free(blocks)

    tracemalloc.start()
    try:
        for _ in range(40):  # the pool filled twice over: every block cached, later ones evicting
            sequence()
        gc.collect()
        filled = tracemalloc.get_traced_memory()[0]
        for _ in range(200):  # ten times over
            sequence()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - filled
    finally:
        tracemalloc.stop()
    assert len(manager.cached) == len(manager.evictable) == 800
    assert grown < 20 * 800, f"the cache grew {grown} bytes while recycling a full pool"
