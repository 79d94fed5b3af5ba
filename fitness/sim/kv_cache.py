"""The KV block pool with prefix caching (vLLM V1's BlockPool), on 16-token blocks.

A new request reuses the longest chain of full blocks of its prompt that is cached (a
group's system prompt; a repeating user's whole prompt), capped below its full length so
at least one token is computed. Blocks are registered as soon as they are scheduled full;
freed blocks stay cached in an LRU free queue (freed in reverse order, so a request's tail
is evicted first) until their space is allocated.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from numba import njit

from fitness.sim.loadgen import PromptShapes
from primitives.deployment import KV_BLOCK_TOKENS

BLOCK = KV_BLOCK_TOKENS


class PrefixKV:
    """Block pool with hashed full blocks and an LRU free queue (vLLM V1 BlockPool).

    A block is identified by a key: hashed blocks by their content key (an int whose two low
    bits give the kind: 0 group system prompt, 1 user prompt, 2 request-specific), blocks
    without a hash by a fresh id with low bits 3. ``ref`` holds the reference count of every
    cached (hashed) block; cached blocks with count 0 sit in the free queue, where allocation
    evicts them oldest first. Never-used blocks are just a count (they precede every freed
    block in vLLM's free queue).
    """

    __slots__ = ("fresh", "lru", "ref", "next_anon", "total")

    def __init__(self, total_blocks: int):
        self.total = total_blocks
        self.fresh = total_blocks
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.ref: dict[int, int] = {}
        self.next_anon = 3

    def free(self) -> int:
        return self.fresh + len(self.lru)

    def take(self, k: int) -> list[int]:
        """Allocate K blocks (evicting cached ones oldest first); returns their anon ids."""
        fresh = self.fresh
        if fresh >= k:
            self.fresh = fresh - k
        else:
            self.fresh = 0
            lru, ref = self.lru, self.ref
            for _ in range(k - fresh):
                key, _ = lru.popitem(last=False)
                if key & 3 != 3:
                    del ref[key]
        start = self.next_anon
        self.next_anon = start + 4 * k
        return list(range(start, start + 4 * k, 4))

    def lookup(self, keys: list[int], max_hit: int) -> tuple[int, int]:
        """Longest cached chain of KEYS (at most MAX_HIT): (blocks hit, of which in the free queue)."""
        ref = self.ref
        h = hf = 0
        for key in keys[:max_hit]:
            c = ref.get(key)
            if c is None:
                break
            h += 1
            if c == 0:
                hf += 1
        return h, hf

    def acquire(self, keys: list[int]) -> None:
        ref, lru = self.ref, self.lru
        for key in keys:
            c = ref[key]
            if c == 0:
                del lru[key]
            ref[key] = c + 1

    def release(self, blocks: list[int]) -> None:
        """Free a request's blocks, tail first (vLLM frees in reverse order)."""
        ref, lru = self.ref, self.lru
        for key in reversed(blocks):
            if key & 3 == 3:
                lru[key] = None
            else:
                c = ref[key] - 1
                ref[key] = c
                if c == 0:
                    lru[key] = None

    def held_blocks(self) -> int:
        """Cached blocks some request still holds."""
        return sum(1 for c in self.ref.values() if c > 0)


# ---------------------------------------------------------------------------
# Block keys: (owner * stride + block index) << 2 | kind


def key_stride(max_model_len: int) -> int:
    """Blocks per owner in the key space: more than any request can hold."""
    return max(512, max_model_len // BLOCK + 2)


def group_key(g: int, j: int, stride: int) -> int:
    return (g * stride + j) << 2


def user_key(u: int, j: int, stride: int) -> int:
    return ((u * stride + j) << 2) | 1


@njit(cache=True)  # also called by the compiled core (fitness.sim.core_kv)
def request_key(r: int, j: int, stride: int) -> int:
    return ((r * stride + j) << 2) | 2


def prompt_block_keys(shapes: PromptShapes, stride: int) -> list[list[int]]:
    """Each user's prompt block keys: group-shared while the block lies inside the group's
    system prompt, user-specific after; only full blocks are hashable."""
    user_keys: list[list[int]] = []
    for u in range(shapes.num_users):
        g = int(shapes.user_group[u])
        sys_len = int(shapes.group_system_len[g])
        nfull = int(shapes.user_prompt_len[u]) // BLOCK
        user_keys.append(
            [group_key(g, j, stride) if (j + 1) * BLOCK <= sys_len else user_key(u, j, stride) for j in range(nfull)]
        )
    return user_keys


def register_prompt(blocks: list[int], ukeys: list[int], c0: int, c1: int, kv: PrefixKV) -> None:
    """Hash the prompt blocks that become full when computed tokens go from C0 to C1."""
    ref = kv.ref
    for j in range(c0 // BLOCK, min(c1 // BLOCK, len(ukeys))):
        key = ukeys[j]
        if key not in ref:  # else a copy is cached already; this block stays unhashed
            ref[key] = 1
            blocks[j] = key


def preempt_release(r: int, comp: int, hend: int, kv: PrefixKV, blocks_of: dict, stride: int) -> None:
    """Free a preempted request's blocks; its full output blocks get hashes so a recompute can hit them."""
    blocks = blocks_of.pop(r)
    ref = kv.ref
    for j in range(hend // BLOCK, min(comp // BLOCK, len(blocks))):
        if blocks[j] & 3 == 3:
            key = request_key(r, j, stride)
            if key not in ref:
                ref[key] = 1
                blocks[j] = key
    kv.release(blocks)


def blocks_for(tokens: np.ndarray) -> np.ndarray:
    """Blocks that hold TOKENS tokens (ceil division)."""
    return (tokens + (BLOCK - 1)) >> 4 if BLOCK == 16 else -(-tokens // BLOCK)
