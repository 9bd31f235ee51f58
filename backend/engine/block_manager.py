"""Paged KV block allocation with ref counts and a prefix cache (pure Python).

Every block is in exactly one of three states:

    free         ref == 0, no hash        in ``_free`` (FIFO)
    cached-free  ref == 0, hash known     in ``_evictable`` (LRU order, oldest first)
    in use       ref >= 1                 in one or more sequences' block tables

The prefix cache maps the chained hash of a *fully computed* block to that block:

    root  = sha256(salt)                      salt = (cache_salt, revision, tokenizer, template)
    h[i]  = sha256(h[i-1] || tokens of block i)

so a hit on block i implies the whole prefix up to and including block i matches, and two
salts can never share a block. Hashes are only registered for blocks whose K/V has been
written (``commit``), and a sequence aborted mid-prefill un-registers the blocks only it
held (``free(..., uncache=True)``).

Forking (``n`` > 1: one prefill, several choices). ``fork`` gives a child the parent's
whole block table, every block's ref count + 1, the partially filled last block included.
A block is written only at positions >= the writer's ``num_computed_tokens``, and the only
shared block that can lie there is such a forked last block: cached prefix blocks are full
and fully computed. So ``ensure`` copies on write: a sequence about to write into a block
that others hold takes a fresh block instead and queues the copy ``(src, dst)``
(``take_copies``), which the engine runs before the model writes anything. The last holder
writes in place. ``src`` stays valid until then: it had another holder, and a block freed
and taken again in the same step is first written by the model, after the copies.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from .sequence import Sequence


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # admissions that looked the prefix cache up
    hits: int = 0  # of those, admissions that reused at least one block
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # tokens whose prefill was skipped (prefill tokens saved)
    evictions: int = 0


def hash_root(salt: bytes) -> bytes:
    return hashlib.sha256(b"sluice-prefix-v1\x00" + salt).digest()


def hash_block(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    """Owns the mapping from sequences to physical KV blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) not yet run
        self.stats = PrefixCacheStats()

    # ---- capacity -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take now (free plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ---------------------------------------------------------------
    def _update_hashes(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` to every full block of its known tokens."""
        bs = self.block_size
        full = seq.num_tokens // bs
        hashes = seq.block_hashes
        parent = hashes[-1] if hashes else hash_root(seq.cache_salt)
        for i in range(len(hashes), full):
            parent = hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs])
            hashes.append(parent)

    def lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks that can serve the leading tokens of a sequence with no blocks.

        Never covers the last token: it must be computed to produce the next logits.
        Takes nothing; ``allocate`` does.
        """
        if not self.enable_prefix_cache or seq.block_table:
            return []
        self._update_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for h in seq.block_hashes[:max_blocks]:
            block = self._hash_to_block.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def commit(self, seq: Sequence) -> None:
        """Register the hashes of blocks that are now fully computed."""
        if not self.enable_prefix_cache:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_committed_blocks:
            return
        self._update_hashes(seq)
        for i in range(seq.num_committed_blocks, full):
            h = seq.block_hashes[i]
            block = seq.block_table[i]
            if self._block_hash[block] is None and h not in self._hash_to_block:
                self._block_hash[block] = h
                self._hash_to_block[h] = block
            # else: the same content was computed twice concurrently; keep the first copy
        seq.num_committed_blocks = full

    # ---- allocation -----------------------------------------------------------------
    def allocate(self, seq: Sequence, cached: list[int], num_tokens: int,
                 reserve: int = 0) -> bool:
        """Give a block-less sequence the ``cached`` prefix blocks plus fresh blocks so that
        it can hold ``num_tokens`` tokens, leaving at least ``reserve`` blocks free.
        All or nothing."""
        if seq.block_table:
            raise RuntimeError(f"{seq.request_id} already holds blocks; use ensure()")
        new = self.blocks_needed(num_tokens) - len(cached)
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)
        if new + revived > self.num_free_blocks - reserve:
            return False
        for b in cached:
            if self.ref_counts[b] == 0:
                del self._evictable[b]
            self.ref_counts[b] += 1
        seq.block_table = list(cached)
        seq.num_committed_blocks = len(cached)
        seq.num_computed_tokens = len(cached) * self.block_size
        for _ in range(max(new, 0)):
            seq.block_table.append(self._pop_free())
        if self.enable_prefix_cache:
            self.stats.queries += 1
            self.stats.query_tokens += seq.num_tokens
            if cached:
                self.stats.hits += 1
                self.stats.hit_tokens += seq.num_computed_tokens
        return True

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow a running sequence's block table to hold ``num_tokens``, copying on write
        a shared block it is about to write into. All or nothing."""
        table = seq.block_table
        new = max(self.blocks_needed(num_tokens) - len(table), 0)
        first = seq.num_computed_tokens // self.block_size  # the first block written now
        # shared blocks it writes into: the first, and (a step of drafts writes several)
        # any after it
        shared = [i for i in range(first, len(table)) if self.ref_counts[table[i]] > 1]
        if new + len(shared) > self.num_free_blocks:
            return False
        for i in shared:
            src = table[i]
            table[i] = self._pop_free()
            self.ref_counts[src] -= 1  # still >= 1: someone else holds it
            self._copies.append((src, table[i]))
        for _ in range(new):
            table.append(self._pop_free())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let a block-less ``child`` share all of ``parent``'s blocks and computed tokens
        (the child's tokens must extend the parent's computed ones)."""
        if child.block_table:
            raise RuntimeError(f"{child.request_id} already holds blocks")
        for b in parent.block_table:
            self.ref_counts[b] += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_committed_blocks = parent.num_committed_blocks

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write block copies queued since the last call, in order."""
        copies, self._copies = self._copies, []
        return copies

    def free(self, seq: Sequence, uncache: bool = False) -> None:
        """Drop a sequence's references. Blocks reaching ref 0 stay reusable through the
        prefix cache unless ``uncache`` (a request aborted mid-prefill)."""
        # Reverse order: tail blocks become least recently used, so a shared prefix
        # outlives the suffixes that hang off it.
        for block in reversed(seq.block_table):
            ref = self.ref_counts[block] - 1
            if ref < 0:
                raise RuntimeError(f"block {block} freed more often than taken")
            self.ref_counts[block] = ref
            if ref:
                continue
            h = self._block_hash[block]
            if h is not None and not uncache:
                self._evictable[block] = None
            else:
                if h is not None:
                    self._unregister(block)
                self._free.append(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        seq.num_draft_computed_tokens = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks of a running sequence past those ``num_tokens`` need (the
        positions reserved for rejected drafts, ``Scheduler.accept``). They were taken for
        this sequence alone and hold nothing cached."""
        keep = max(self.blocks_needed(num_tokens), seq.num_committed_blocks)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            ref = self.ref_counts[block] - 1
            if ref < 0:
                raise RuntimeError(f"block {block} freed more often than taken")
            self.ref_counts[block] = ref
            if ref == 0:
                if self._block_hash[block] is not None:
                    self._unregister(block)
                self._free.append(block)

    def _pop_free(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._unregister(block)
            self.stats.evictions += 1
        self.ref_counts[block] = 1
        return block

    def _unregister(self, block: int) -> None:
        h = self._block_hash[block]
        if h is not None:
            self._block_hash[block] = None
            if self._hash_to_block.get(h) == block:
                del self._hash_to_block[h]

    # ---- introspection (tests, state endpoint) ---------------------------------------
    def block_hash(self, block: int) -> bytes | None:
        return self._block_hash[block]

    def check_invariants(self) -> None:
        """Raise AssertionError if the free lists and ref counts disagree."""
        free = set(self._free)
        evictable = set(self._evictable)
        if len(free) != len(self._free) or free & evictable:
            raise AssertionError("a block is listed twice in the free pools")
        for b in range(self.num_blocks):
            ref = self.ref_counts[b]
            if ref < 0:
                raise AssertionError(f"block {b} has negative ref count {ref}")
            if ref == 0 and b not in free and b not in evictable:
                raise AssertionError(f"block {b} leaked: ref 0 but in no free pool")
            if ref > 0 and (b in free or b in evictable):
                raise AssertionError(f"block {b} in use but listed free")
            if b in evictable and self._block_hash[b] is None:
                raise AssertionError(f"evictable block {b} has no hash")
        for h, b in self._hash_to_block.items():
            if self._block_hash[b] != h:
                raise AssertionError(f"hash index points at block {b} with another hash")
