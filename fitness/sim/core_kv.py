"""The KV block pool with prefix caching (``fitness.sim.kv_cache``), in numba for the compiled core.

Same semantics, same order of every allocation and eviction, other containers:

* ``tab``: an open-addressing hash table on one int64 array, a row per cached (hashed)
  block: (key, reference count, position in the LRU ring or -1). Not numba's typed dict:
  a compiled function that takes a typed dict pays ~250 ns a call even when it never
  touches it, which made the dict the core's main cost. Keys are never negative (their
  low two bits say group prompt, user prompt, request output or anonymous); -1 marks an
  empty row, -2 a deleted one. The table holds at most one key per block of the pool and has at least
  twice as many rows, so probes stay short; deleted rows are swept when they pile up.
* the LRU free queue: a ring of keys in insertion order (``lru_keys``); a hashed key taken
  back out of the queue (a prefix hit) leaves a stale ring entry that popping skips (its
  row no longer points at that position). Anonymous blocks (key & 3 == 3) are never looked
  up, so they leave the queue only from its head; they are counted in ``st[ANON_FREE]``,
  the hashed ones in ``st[LRU_HASHED]``. The ring is compacted in place when it fills (it
  never holds more live keys than the pool has blocks);
* each request's blocks: a row of ``blk`` in a pool of slots (``nblk`` blocks used),
  only while it holds any (running or finishing: at most ``max_num_seqs`` at once).

``st`` holds the integer state (indices below).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from fitness.sim.kv_cache import BLOCK, request_key

FRESH, NEXT_ANON, LRU_HEAD, LRU_TAIL, FREE_TOP, ANON_FREE, LRU_HASHED, TAB_USED = range(8)
N_KV_STATE = 8
EMPTY, DELETED = -1, -2
KEY, REF, POS = 0, 1, 2
_GOLDEN = np.uint64(11400714819323198485)  # 2**64 / golden ratio: Fibonacci hashing


@njit(cache=True)
def new_table(kv_blocks):
    """An empty table for a pool of KV_BLOCKS blocks (a power of two, over twice as many rows)."""
    rows = 16
    while rows < 2 * kv_blocks + 16:
        rows *= 2
    tab = np.zeros((rows, 3), dtype=np.int64)
    tab[:, KEY] = EMPTY
    return tab


@njit(cache=True)
def find(tab, key):
    """Row of KEY, or -1."""
    mask = tab.shape[0] - 1
    i = np.int64((np.uint64(key) * _GOLDEN) >> np.uint64(32)) & mask
    while True:
        k = tab[i, KEY]
        if k == key:
            return i
        if k == EMPTY:
            return -1
        i = (i + 1) & mask


@njit(cache=True)
def _sweep(tab):
    """Rehash in place without the deleted rows."""
    live = tab[tab[:, KEY] >= 0].copy()
    tab[:] = 0
    tab[:, KEY] = EMPTY
    mask = tab.shape[0] - 1
    for row in range(live.shape[0]):
        i = np.int64((np.uint64(live[row, KEY]) * _GOLDEN) >> np.uint64(32)) & mask
        while tab[i, KEY] != EMPTY:
            i = (i + 1) & mask
        tab[i] = live[row]
    return live.shape[0]


@njit(cache=True)
def insert(tab, st, key):
    """Add KEY (absent) with one reference and no LRU position; its row."""
    if 4 * (st[TAB_USED] + 1) > 3 * tab.shape[0]:
        st[TAB_USED] = _sweep(tab)
    mask = tab.shape[0] - 1
    i = np.int64((np.uint64(key) * _GOLDEN) >> np.uint64(32)) & mask
    while tab[i, KEY] >= 0:  # deleted rows are reused only by a sweep: a probe chain stays whole
        i = (i + 1) & mask
    if tab[i, KEY] == EMPTY:
        st[TAB_USED] += 1
    tab[i, KEY], tab[i, REF], tab[i, POS] = key, 1, -1
    return i


@njit(cache=True)
def ref_count(tab, key):
    """KEY's reference count, -1 if it is not cached."""
    i = find(tab, key)
    return tab[i, REF] if i >= 0 else -1


@njit(cache=True)
def lru_compact(st, tab, lru_keys):
    w = 0
    for s in range(st[LRU_HEAD], st[LRU_TAIL]):
        key = lru_keys[s]
        if key & 3 == 3:
            lru_keys[w] = key
            w += 1
        else:
            i = find(tab, key)
            if i >= 0 and tab[i, POS] == s:
                lru_keys[w] = key
                tab[i, POS] = w
                w += 1
    st[LRU_HEAD] = 0
    st[LRU_TAIL] = w
    return w


@njit(cache=True)
def lru_push(key, row, st, tab, lru_keys):
    """KEY (in table row ROW, or an anonymous block) joins the free queue's tail."""
    t = st[LRU_TAIL]
    if t == len(lru_keys):
        t = lru_compact(st, tab, lru_keys)
    lru_keys[t] = key
    if key & 3 == 3:
        st[ANON_FREE] += 1
    else:
        tab[row, POS] = t
        st[LRU_HASHED] += 1
    st[LRU_TAIL] = t + 1


@njit(cache=True)
def lru_pop_oldest(st, tab, lru_keys):
    """Take the free queue's oldest block; a hashed one leaves the cache."""
    h = st[LRU_HEAD]
    while True:
        key = lru_keys[h]
        h += 1
        if key & 3 == 3:
            st[ANON_FREE] -= 1
            st[LRU_HEAD] = h
            return
        i = find(tab, key)
        if i >= 0 and tab[i, POS] == h - 1:
            tab[i, KEY], tab[i, POS] = DELETED, -1
            st[LRU_HASHED] -= 1
            st[LRU_HEAD] = h
            return


@njit(cache=True)
def kv_free(st):
    return st[FRESH] + st[ANON_FREE] + st[LRU_HASHED]


@njit(cache=True)
def take(k, slot, blk, nblk, st, tab, lru_keys):
    """Allocate K blocks (evicting cached ones oldest first), appended to SLOT's row as anon ids."""
    fresh = st[FRESH]
    if fresh >= k:
        st[FRESH] = fresh - k
    else:
        st[FRESH] = 0
        for _ in range(k - fresh):
            lru_pop_oldest(st, tab, lru_keys)
    start = st[NEXT_ANON]
    st[NEXT_ANON] = start + 4 * k
    m = nblk[slot]
    for i in range(k):
        blk[slot, m + i] = start + 4 * i
    if k > 0:
        nblk[slot] = m + k


@njit(cache=True)
def release(slot, blk, nblk, st, tab, lru_keys, free_slots):
    """Free SLOT's blocks, tail first (vLLM frees in reverse order), and the slot."""
    for j in range(nblk[slot] - 1, -1, -1):
        key = blk[slot, j]
        if key & 3 == 3:
            lru_push(key, -1, st, tab, lru_keys)
        else:
            i = find(tab, key)
            c = tab[i, REF] - 1
            tab[i, REF] = c
            if c == 0:
                lru_push(key, i, st, tab, lru_keys)
    nblk[slot] = 0
    free_slots[st[FREE_TOP]] = slot
    st[FREE_TOP] += 1


@njit(cache=True)
def new_slot(st, free_slots):
    top = st[FREE_TOP]
    if top == 0:
        raise RuntimeError("simulator invariant: more requests hold KV blocks than max_num_seqs")
    st[FREE_TOP] = top - 1
    return free_slots[top - 1]


@njit(cache=True)
def lookup(keys, n_keys, max_hit, tab):
    """Longest cached chain of KEYS[:min(n_keys, max_hit)]: (blocks hit, of which in the free queue)."""
    h = hf = 0
    for i in range(min(n_keys, max_hit)):
        c = ref_count(tab, keys[i])
        if c < 0:
            break
        h += 1
        if c == 0:
            hf += 1
    return h, hf


@njit(cache=True)
def acquire(keys, h, st, tab):
    for i in range(h):
        row = find(tab, keys[i])
        c = tab[row, REF]
        if c == 0:  # out of the free queue (its ring entry goes stale)
            tab[row, POS] = -1
            st[LRU_HASHED] -= 1
        tab[row, REF] = c + 1


@njit(cache=True)
def register_prompt(slot, blk, user_keys, u, n_user_keys, c0, c1, st, tab):
    """Hash user U's prompt blocks that become full when computed tokens go from C0 to C1."""
    for j in range(c0 // BLOCK, min(c1 // BLOCK, n_user_keys)):
        key = user_keys[u, j]
        if find(tab, key) < 0:  # else a copy is cached already; this block stays unhashed
            insert(tab, st, key)
            blk[slot, j] = key


@njit(cache=True)
def preempt_release(r, slot, comp, hend, stride, blk, nblk, st, tab, lru_keys, free_slots):
    """Free a preempted request's blocks; its full output blocks get hashes so a recompute can hit them."""
    for j in range(hend // BLOCK, min(comp // BLOCK, nblk[slot])):
        if blk[slot, j] & 3 == 3:
            key = request_key(r, j, stride)
            if find(tab, key) < 0:
                insert(tab, st, key)
                blk[slot, j] = key
    release(slot, blk, nblk, st, tab, lru_keys, free_slots)


@njit(cache=True)
def held_blocks(tab):
    n = 0
    for i in range(tab.shape[0]):
        if tab[i, KEY] >= 0 and tab[i, REF] > 0:
            n += 1
    return n
