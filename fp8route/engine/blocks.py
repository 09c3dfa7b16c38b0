"""Which KV blocks are free, which are shared, and which hold a prefix worth keeping.

A block that a sequence has filled completely is keyed by its content: (the key id of the block
before it, its tokens). Two prompts that start alike reach the same keys block by block, so the
second one's matching blocks are shared (reference-counted, read-only: a sequence only ever
writes past its full blocks) and their prefill is skipped. The key holds the tokens themselves,
so a match is exact, never a hash collision; packed as int32 bytes, not a tuple of ints, which
would keep a finished prompt's int objects alive and cost a cached block about 1 KB of host
memory instead of about 0.4 KB (docs/serve.md). When the last sequence using a cached block frees
it, the block stays cached but evictable; new allocations take never-cached blocks first, then
evict the least recently freed cached ones (a sequence's tail before its head).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

Key = tuple[int, bytes]  # (key id of the previous block, -1 for the first; this block's tokens as int32)
ROOT = -1
SCRATCH_BLOCK = 0  # never handed out: padded rows of a decode graph read and write only there


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass
class PrefixStats:
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, found cached

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def _packed(tokens: Sequence[int]) -> bytes:
    return array("i", tokens).tobytes()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.refs = [0] * num_blocks
        self.key_of: list[Key | None] = [None] * num_blocks
        self.id_of = [ROOT] * num_blocks  # a cached block's key id (what its successor's key names)
        self.cached: dict[Key, int] = {}
        self.fresh: deque[int] = deque(b for b in range(num_blocks) if b != SCRATCH_BLOCK)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, cached; oldest first
        self._next_id = 0
        self.stats = PrefixStats()

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take now (never used, or cached with no user)."""
        return len(self.fresh) + len(self.evictable)

    @property
    def used_blocks(self) -> int:
        return self.usable_blocks - self.free_blocks

    def match_prefix(self, tokens: Sequence[int], limit: int) -> tuple[list[int], int]:
        """The cached blocks that hold tokens' first full blocks, at most limit tokens' worth, taken
        (their references counted); and the key id of the last one (ROOT if none)."""
        parent, blocks = ROOT, []
        if self.enable_prefix_caching:
            size = self.block_size
            for start in range(0, limit - size + 1, size):
                block = self.cached.get((parent, _packed(tokens[start : start + size])))
                if block is None:
                    break
                self._take(block)
                blocks.append(block)
                parent = self.id_of[block]
        return blocks, parent

    def allocate(self, count: int) -> list[int] | None:
        """count blocks for one sequence's new tokens, or None (nothing taken) if the pool has too few."""
        if count > self.free_blocks:
            return None
        out = []
        for _ in range(count):
            if self.fresh:
                block = self.fresh.popleft()
            else:
                block, _ = self.evictable.popitem(last=False)
                self._forget(block)
            self.refs[block] = 1
            out.append(block)
        return out

    def cache_full_block(self, block: int, parent: int, tokens: Sequence[int]) -> int:
        """Register a block a sequence has just filled (its tokens, after the block keyed parent);
        returns its key id, the parent of the next. A block whose content is cached already (another
        sequence computed it at the same time) stays uncached, under the existing key's id."""
        if not self.enable_prefix_caching:
            return ROOT
        key = (parent, _packed(tokens))
        existing = self.cached.get(key)
        if existing is not None:
            return self.id_of[existing]
        self.cached[key] = block
        self.key_of[block] = key
        self.id_of[block] = self._next_id
        self._next_id += 1
        return self.id_of[block]

    def free(self, blocks: Sequence[int]) -> None:
        """A sequence's blocks, in order; the tail is made evictable first."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            assert self.refs[block] >= 0, f"block {block} freed more often than taken"
            if self.refs[block] == 0:
                if self.key_of[block] is not None:
                    self.evictable[block] = None
                else:
                    self.fresh.append(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (nothing may be in use): a benchmark's load starts cold."""
        assert self.used_blocks == 0, "reset_prefix_cache while blocks are in use"
        for block in self.evictable:
            self._forget(block)
            self.fresh.append(block)
        self.evictable.clear()
        self.stats = PrefixStats()

    def _take(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.evictable[block]
        self.refs[block] += 1

    def _forget(self, block: int) -> None:
        key = self.key_of[block]
        if key is not None and self.cached.get(key) == block:
            del self.cached[key]
        self.key_of[block] = None
        self.id_of[block] = ROOT

    def check_empty(self) -> str | None:
        """None when no block is in use (every sequence has freed its blocks), else what leaked."""
        used = [b for b, r in enumerate(self.refs) if r]
        if used or self.free_blocks != self.usable_blocks:
            free = f"{self.free_blocks} of {self.usable_blocks} free"
            return f"{len(used)} block(s) still referenced (e.g. {used[:5]}); {free}"
        return None
