"""The paged response cache: a pool of fixed-size K/V pages per layer and a page table per
sample, so a rollout holds and reads K/V for the tokens it has generated, not for its budget.

Axis letters: the legend of ``rl_jax/__init__.py`` (G group slots, M samples per slot,
K kv heads, H head dim, R response cache length); here also Pg pool pages, S page size
(tokens per page), NP = R / S page-table entries per sample, nb the live pages a decode
program reads (a power-of-two bucket).

Layout. Each layer's pool holds keys [Pg,K,H,S] (length last, as the prompt cache keeps
them: both attention products are plain matmuls) and values [Pg,K,S,H]. Response token j of
sample (g, m) lives on page ``table[g,m,j // S]`` at offset ``j % S``; -1 marks an entry
with no page yet. Pages are taken on device when a token is written onto an entry that has
none (lowest free page ids first, samples in row-major order: a pure function of the token
counts, never of time) and given back by ``release`` when a slot's group leaves it. The
prompt stays once per slot in the prefix cache (``kv_cache``), so the group's samples share
it; page size = R (one page per sample) is the former worst-case slot layout.

Reference counts. ``refs`` int32 [D,Pl] counts the table entries naming each page (0 =
free): a taken page starts at 1, a fork adds one per entry it shares, ``release`` takes one
per entry it drops, so a page shared by several samples or slots goes back to the pool when
the last of them lets it go.

Forks (``fork``). A sample can start as a copy of another sample, of its own slot or of
another slot on the same pool shard, up to a token: the whole pages below that token are
shared (both table rows name them; a shared page is never written again, since tokens are
only appended), the partial last page is copied onto a fresh page (copy-on-write, done at
the fork). An identity table owns every page for good, so there a fork copies every page it
keeps.

Attention reads the first ``nb`` pages of every sample (``live_pages``), nb chosen by the
engine as a power of two covering the longest live response, so a decode step's work follows
the tokens generated and the number of compiled decode programs is logarithmic in R. The
pages are read page-major ([nb,G,M,..]): each page is one batch entry of the attention's
matmuls, so no page is copied into a joined cache. A pool of every sample's whole budget uses
``identity_table`` (page-major too) and is read in place, without a gather.

Shards. On a mesh whose batch axes split the G slots over D devices, the pool is split the
same way: shard d holds pages ``d·Pl .. (d+1)·Pl - 1`` (Pl = Pg / D pages per device) and
gives them only to the samples of its slots ``d·G/D .. (d+1)·G/D - 1``, so every read and
write of a decode step stays on the device that holds the slot (``by_shard``). The
reference counts are kept per shard (``refs`` [D,Pl]); page ids are global, so a table means
the same pages on one device and on D. D = 1 off a mesh.

A mesh whose ``sequence`` axis (the ``kv_length`` rule) has Q > 1 devices splits each slot
shard's pages Q ways as well (sequence-parallel rollouts): entry e of a sample's table takes
its page from shard ``d·Q + e mod Q`` (``entry_shard``), so a long response's pages are spread
round-robin over the Q devices and each holds 1/Q of them. The decode attends each device's
pages where they lie (``by_sequence`` gives each device its entries, compacted, and the
positions valid on them) and merges the Q partial softmaxes by log-sum-exp. The counts have
D·Q rows then, shard ``d·Q + q`` at row ``d·Q + q``.

On TPU the pool keeps the layout XLA:TPU gives it by default (``device_layout``): with H a
multiple of the 128 lanes and S below them, keys [Pg,K,H,S] are laid out with H minor, as
[Pg,K,S,H], the values' layout. The decode writes a token's K/V one [H] row per kv head
(``write``) and the paged kernel reads the key pages as [S,H] (``h_minor``), so neither
copies the pool into another layout.

Reference: Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving
with PagedAttention".
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Layout

import pallas_kernels
from rl_jax import sharding

__all__ = ["POOL_AXES", "allocate", "by_sequence", "by_shard", "contiguous", "copy_pages",
           "device_layout", "entry_shard", "fork", "free_pages", "grow", "grown_size", "h_minor",
           "hold", "identity_table", "in_place", "live_bucket", "live_pages", "local_ids",
           "next_token_pages", "own_entries", "pages_from_memory", "pages_needed", "regrown_ids",
           "release", "rows_by_sequence", "rows_from_sequence", "rows_need", "shard_of_slot",
           "shared_cache", "shared_entries", "shared_table", "slot_shards", "spread", "take_entry",
           "usage_counters", "write", "write_rows"]


def pages_from_memory(devices, fraction: float, page_bytes_: int) -> int | None:
  """Pages that ``fraction`` of the smallest free device memory among ``devices`` holds
  (``bytes_limit − bytes_in_use`` of ``Device.memory_stats()``, as vLLM's
  ``gpu_memory_utilization``); None where a device reports no capacity (CPU)."""
  free = []
  for d in devices:
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
      return None
    free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
  return int(fraction * min(free) // page_bytes_)


def pages_needed(tokens: int, page_size: int) -> int:
  """Pages that hold ``tokens`` response tokens (ceil division; 0 for none)."""
  return -(-int(tokens) // int(page_size))


def live_bucket(longest: int, page_size: int, entries: int, floor_tokens: int = 128) -> int:
  """Live-page bucket nb: the smallest power of two of pages covering ``longest`` tokens
  and at least ``floor_tokens`` (few, coarse programs for short rollouts), at most
  ``entries`` (= R / S)."""
  need = max(pages_needed(max(longest, floor_tokens), page_size), 1)
  nb = 1 << (need - 1).bit_length()
  return int(min(nb, entries))


# ------------------------------------------------------------ host-side scheduling (both engines)
def grown_size(size: int, free, want, most: int) -> int:
  """A growing pool's size: ``size`` pages (``free`` of them free) doubled until ``want``
  pages are free, at most ``most`` (every sample's whole budget); ``size`` if enough are.
  ``free`` and ``want`` are ints, or int arrays [D] per shard (each shard grows by the same
  pages: ``(new - size) / D``)."""
  free, want = np.atleast_1d(free), np.atleast_1d(want)
  D = free.shape[0]
  new = size
  while np.any(free + (new - size) // D < want) and new < most:
    new = min(2 * new, most)
  return new


def slot_shards(G: int, D: int) -> np.ndarray:
  """int [G]: the pool shard of each slot (slots ``d·G/D .. (d+1)·G/D - 1`` on shard d)."""
  return np.arange(G) // (G // D)


def next_token_pages(run: np.ndarray, length: np.ndarray, table: np.ndarray, S: int,
                     D: int = 1, seq: int = 1) -> np.ndarray:
  """Pages the running samples take at their next decode step, per pool shard (int [D·Q],
  Q = ``seq``: ``entry_shard``): those whose fed token's page-table entry has no page yet.
  ``run`` bool [G,M] (running samples), ``length`` int32 [G,M] (tokens so far), ``table``
  int32 [G,M,NP] (host copies)."""
  entry = np.minimum(np.maximum(length - 1, 0) // S, table.shape[-1] - 1)
  need = run & (np.take_along_axis(table, entry[..., None], -1)[..., 0] < 0)
  shard = slot_shards(table.shape[0], D)[:, None] * seq + entry % seq
  return np.bincount(shard[need], minlength=D * seq).astype(np.int64)


def spread(pages_: int, seq: int) -> int:
  """The most of ``pages_`` consecutive table entries that one of Q = ``seq`` sequence
  shards serves (``entry_shard``: entries go round-robin): ceil(pages / Q)."""
  return -(-int(pages_) // seq)


def shared_entries(table, run, most: int, xp=jnp):
  """Per slot, the leading table entries whose page every running sample of the slot names
  (the whole pages its forks share: a prompt on pages, a forked prefix), at most ``most``;
  0 for a slot with fewer than two running samples (nothing to read once for several).

  A decode reads these pages once per slot (``decode.paged_decode_attention``'s ``shared``)
  and each sample's own entries after them. ``table`` int [G,M,NP], ``run`` bool [G,M];
  ``xp``: ``jnp`` on device, ``np`` for the host's copies (the engine picks its buckets
  from the same count the decode step reads). Returns int32 [G]."""
  first = xp.argmax(run, axis=1)  # each slot's first running sample
  row = xp.take_along_axis(table, first[:, None, None], axis=1)  # [G,1,NP]
  same = xp.all((table == row) | ~run[..., None], axis=1) & (row[:, 0] >= 0)  # [G,NP]
  lead = xp.sum(xp.cumprod(same[:, :most].astype(xp.int32), axis=1), axis=1)
  return xp.where(xp.sum(run, axis=1) >= 2, lead, 0).astype(xp.int32)


def shared_table(table, run, shared: int):
  """The pages each slot's running samples all name, to be read once per slot.

  Args:
    table: int32 [G,M,NP]. run: bool [G,M], the samples that read. shared: ns, the most
      leading entries read once per slot (``shared_entries``).
  Returns:
    (own int32 [G]: the first entry each sample reads as its own (``shared_entries``);
    once int32 [G,1,ns]: the slot's first running sample's leading entries, -1 from
    ``own`` on).
  """
  own = shared_entries(table, run, shared)
  first = jnp.argmax(run, axis=1)[:, None, None]
  once = jnp.take_along_axis(table, first, axis=1)[:, :, :shared]
  return own, jnp.where(jnp.arange(shared) < own[:, None, None], once, -1)


def shared_cache(pool_k, pool_v, once, shards: int = 1):
  """The pages of ``once`` (int32 [G,1,ns], ``shared_table``) as one cache per slot, laid
  out as the slot's prompt cache: keys [G,K,H,ns·S], values [G,K,ns·S,H] (entries -1 read
  page 0: mask them). Gathered shard by shard (``live_pages``), so no page crosses
  devices."""
  k, v = live_pages(pool_k, pool_v, once, shards)  # [ns,G,1,K,H,S] / [ns,G,1,K,S,H]
  ns, G, _, K, H, S = k.shape
  k = jnp.moveaxis(k[:, :, 0], 0, 3).reshape(G, K, H, ns * S)  # [G,K,H,ns,S]
  v = jnp.moveaxis(v[:, :, 0], 0, 2).reshape(G, K, ns * S, H)  # [G,K,ns,S,H]
  return k, v


def own_entries(table, own, nb: int):
  """int32 [G,M,nb]: each sample's table entries own .. own+nb-1 (``own`` int [G], the
  first entry after its slot's shared ones: ``shared_table``), -1 past NP."""
  G, M, NP = table.shape
  entries = own[:, None, None] + jnp.arange(nb)  # [G,1,nb]
  at = jnp.broadcast_to(jnp.minimum(entries, NP - 1), (G, M, nb))
  return jnp.where(entries < NP, jnp.take_along_axis(table, at, axis=-1), -1)


def usage_counters(used: list[int], programs: set, pool_pages: int) -> dict[str, float]:
  """The page counters of one rollout call: pages in use after each decode call (``used``;
  mean and peak), the decode programs compiled so far (``programs``: (live bucket, shared
  bucket, pool size) triples) and the pool's size at the end."""
  return dict(kv_pages_used_peak=max(used, default=0),
              kv_pages_used_mean=float(np.mean(used)) if used else 0.0,
              decode_buckets=len(programs), kv_pages=int(pool_pages))


# ------------------------------------------------------------ device side
def _take(refs: jax.Array, want: jax.Array, shard: jax.Array):
  """Free page ids for the True entries of ``want`` (any shape), each from its ``shard``
  (int, broadcast to ``want``'s shape; ``refs`` int32 [D,Pl], a page free where 0), lowest
  ids first in row-major order within a shard; Pg = D·Pl where not wanted or where the shard
  ran out. Page ids are global (shard d's pages are ``d·Pl ..``). Returns (ids, refs: the
  taken pages named once)."""
  D, Pl = refs.shape
  free = refs == 0
  flat = want.reshape(-1)
  sh = jnp.broadcast_to(shard, want.shape).reshape(-1)
  n = min(flat.shape[0], Pl)
  if D == 1:
    rank = jnp.cumsum(flat.astype(jnp.int32)) - 1
    cand = jnp.nonzero(free[0], size=n, fill_value=Pl)[0][None]
  else:  # the rank of each wanted entry among its shard's
    mine = flat[:, None] & (sh[:, None] == jnp.arange(D)[None, :])  # [N,D]
    rank = jnp.take_along_axis(jnp.cumsum(mine.astype(jnp.int32), axis=0), sh[:, None],
                               axis=1)[:, 0] - 1
    cand = jax.vmap(lambda f: jnp.nonzero(f, size=n, fill_value=Pl)[0])(free)  # [D,n]
  local = jnp.where(flat & (rank < n), cand[sh, jnp.clip(rank, 0, n - 1)], Pl)
  ids = jnp.where(local < Pl, sh * Pl + local, D * Pl)
  refs = refs.reshape(-1).at[ids].set(1, mode="drop").reshape(D, Pl)
  return ids.reshape(want.shape), refs


def shard_of_slot(slot, G: int, D: int):
  """The slot shard (of D) of slots ``slot`` (int array; padding slots >= G count as the
  last)."""
  return jnp.minimum(slot, G - 1) // (G // D)


def entry_shard(slot_shard, entry, seq: int):
  """The pool shard that serves table entry ``entry`` of a slot in slot shard ``slot_shard``
  (int arrays, broadcast): ``d·Q + entry mod Q`` with Q = ``seq`` sequence shards (d with
  Q = 1)."""
  return slot_shard * seq + entry % seq


def allocate(table: jax.Array, refs: jax.Array, need: jax.Array, seq: int = 1):
  """Give a free page to every entry of ``need`` that has none.

  Args:
    table: int32 [G,M,NP] page table (-1 = no page). refs: int32 [D·Q,Pl] table entries
      naming each page, per pool shard (0 = free). need: bool [G,M,NP] entries that must
      hold a page after the call. seq: Q, the sequence shards of each slot shard
      (``entry_shard``).
  Returns:
    (table, refs). Entries the pool could not serve keep -1 (callers check capacity first:
    ``entries_short``).
  """
  want = need & (table < 0)
  G, _, NP = table.shape
  shard = entry_shard(shard_of_slot(jnp.arange(G), G, refs.shape[0] // seq)[:, None, None],
                      jnp.arange(NP)[None, None, :], seq)
  ids, refs = _take(refs, want, shard)
  table = jnp.where(want & (ids < refs.size), ids, table)
  return table.astype(jnp.int32), refs


def take_entry(table: jax.Array, refs: jax.Array, take: jax.Array, entry: jax.Array,
               seq: int = 1):
  """One table entry per sample: a page for entry ``entry`` [G,M] of every sample where
  ``take`` [G,M] and it has none (from the entry's shard: ``entry_shard`` with Q = ``seq``).

  Returns:
    (table, refs, page int32 [G,M]: the page of that entry, -1 where none).
  """
  G, M, NP = table.shape
  entry = jnp.minimum(entry, NP - 1)
  at = (jnp.arange(G)[:, None], jnp.arange(M)[None, :], entry)
  page = table[at]
  want = take & (page < 0)
  shard = entry_shard(shard_of_slot(jnp.arange(G), G, refs.shape[0] // seq)[:, None], entry, seq)
  ids, refs = _take(refs, want, shard)
  page = jnp.where(want & (ids < refs.size), ids, page)
  return table.at[at].set(page), refs, page


def release(table: jax.Array, refs: jax.Array, rows: jax.Array):
  """Drop the table entries of the slots where ``rows`` (bool [G]) is True: each page they
  name loses one reference per entry, and a page no entry names any more is free.

  Args:
    table: int32 [G,M,NP]. refs: int32 [D,Pl]. rows: bool [G].
  Returns:
    (table with those slots' entries -1, refs).
  """
  ids = jnp.where(rows[:, None, None] & (table >= 0), table, refs.size)
  refs = refs.reshape(-1).at[ids.reshape(-1)].add(-1, mode="drop").reshape(refs.shape)
  return jnp.where(rows[:, None, None], -1, table), refs


def fork(table: jax.Array, refs: jax.Array, slot, src, dst, cached, S: int,
         identity: bool = False, seq: int = 1, src_slot=None, given=None, use_given=None):
  """Sample ``dst`` of slot ``slot`` starts as a copy of sample ``src`` of slot ``src_slot``
  (default ``slot``: a sibling) up to its first ``cached`` response positions (rows [F];
  padding rows have slot >= G).

  Entries wholly below ``cached`` share src's pages (each gains a reference: it goes back
  to the pool when the last entry naming it is released); the entry that holds position
  ``cached`` and earlier ones gets a fresh page, to be filled with a copy of src's
  (``copy_pages``); later entries have none. With ``identity`` dst keeps its own pages and
  every entry holding a kept position is copied.

  Args:
    table: int32 [G,M,NP]. refs: int32 [D,Pl]. slot, src, dst, cached: int32 [F] (src holds
      at least ``cached`` positions; dst's row holds no page: a freshly admitted slot).
    S: page size. seq: Q (``entry_shard``: the copy's page is on its entry's shard, where
      src's page of that entry is). src_slot: int32 [F], each on the pool shard of its
      row's ``slot`` (the caller's rule: a slot reads only its shard's pages).
    given, use_given: int32 [F,NP] and bool [F]: rows where ``use_given`` take their
      source's pages from ``given`` (-1 past them) instead of a table row: pages no table
      names any more, kept by a prefix cache (``hold``).
  Returns:
    (table, refs, frm, to): frm, to int32 [F,NP] the pages to copy from and onto (Pg where
    nothing is copied).
  """
  G, _, NP = table.shape
  Pg = refs.size
  e = jnp.arange(NP)[None, :]
  valid = (slot < G)[:, None]
  g = jnp.minimum(slot, G - 1)
  s = g if src_slot is None else jnp.minimum(src_slot, G - 1)
  n = cached[:, None]
  src_pages = table[s, src]  # [F,NP]
  if given is not None:
    src_pages = jnp.where(use_given[:, None], given, src_pages)
  full = (e + 1) * S <= n
  partial = (e * S < n) & ~full
  if identity:
    frm = jnp.where((full | partial) & valid, src_pages, Pg)
    return table, refs, frm, jnp.where(frm < Pg, table[g, dst], Pg)
  shard = entry_shard(shard_of_slot(slot, G, refs.shape[0] // seq)[:, None], e, seq)
  ids, refs = _take(refs, partial & valid, shard)
  got = partial & valid & (ids < Pg)
  shared = jnp.where(full & valid & (src_pages >= 0), src_pages, Pg)
  refs = refs.reshape(-1).at[shared.reshape(-1)].add(1, mode="drop").reshape(refs.shape)
  row = jnp.where(full, src_pages, jnp.where(got, ids, -1))
  table = table.at[jnp.where(valid[:, 0], slot, G), dst].set(row, mode="drop")
  frm = jnp.where(got, src_pages, Pg)
  return table.astype(jnp.int32), refs, frm, jnp.where(got, ids, Pg)


def hold(refs: jax.Array, ids: jax.Array, delta: int):
  """``refs`` with ``delta`` (1: one more holder, -1: one less) added for each of pages
  ``ids`` (int [N], entries >= Pg skipped): a holder that is no table entry, e.g. a prefix
  cache keeping a finished sample's pages for later forks."""
  flat = refs.reshape(-1).at[ids].add(delta, mode="drop")
  return flat.reshape(refs.shape)


def free_pages(refs) -> np.ndarray:
  """int [D·Q]: the free pages of each pool shard (``refs`` int32 [D·Q,Pl], a device or
  host array; one device read)."""
  return (np.asarray(refs) == 0).sum(-1)


def copy_pages(pool: tuple, frm: jax.Array, to: jax.Array) -> tuple:
  """Each layer's pool with pages ``frm`` copied onto pages ``to`` (any shape, equal; entries
  equal to Pg are skipped)."""
  Pg = pool[0].shape[0]
  frm, to = frm.reshape(-1), to.reshape(-1)
  src = jnp.minimum(frm, Pg - 1)
  to = jnp.where(frm < Pg, to, Pg)
  return tuple(p.at[to].set(p[src], mode="drop") for p in pool)


def write(pool_k, pool_v, page, offset, k, v, shards: int = 1, seq: int = 1):
  """Write token K/V onto pages: ``k``/``v`` [N,K,H] at (page [N], offset [N]).

  Tokens whose page is -1 (none) are dropped. Keys are stored [Pg,K,H,S], values [Pg,K,S,H].
  Each token's K/V goes in as one [H] row per kv head (a scatter whose window is the H
  axis), which XLA:TPU updates in place in the layout the pool has (``device_layout``: H
  minor for both). Written as one [K,H] slab per token, the scatter wanted [Pg,S,K,H]
  (K and H minor), and the decode loop carried every layer's pool in that layout, copied
  into it before the loop and out of it for the paged kernel in every step. ``shards`` D:
  the N rows are slot-major over the pool's D shards (N / D rows per shard, each writing
  only its shard's pages), and each shard writes its own pages (``by_shard``). ``seq`` Q:
  each slot shard's pages are split over Q sequence shards (``entry_shard``); every row goes
  to the Q shards of its slot shard and is written by the one that holds its page.
  """
  if shards * seq > 1:
    T, Pl = shards * seq, pool_k.shape[0] // (shards * seq)
    if seq > 1:
      d = jnp.arange(page.shape[0]) // (page.shape[0] // shards)  # each row's slot shard
      mine = page[None] // Pl == d[None] * seq + jnp.arange(seq)[:, None]  # [Q,N]
      page = jnp.where(mine & (page[None] >= 0), page[None], -1)
      page, offset, k, v = (rows_by_sequence(x, shards, seq) for x in
                            (page, *(jnp.broadcast_to(y, (seq, *y.shape)) for y in (offset, k, v))))
    return by_shard(write, T, (pool_k, pool_v), (local_ids(page, Pl), offset, k, v))
  Pg, K = pool_k.shape[:2]
  page = jnp.where(page < 0, Pg, page)[..., None]
  head, offset = jnp.arange(K), offset[..., None]
  pool_k = pool_k.at[page, head, :, offset].set(k.astype(pool_k.dtype), mode="drop")
  pool_v = pool_v.at[page, head, offset].set(v.astype(pool_v.dtype), mode="drop")
  return pool_k, pool_v


def rows_by_sequence(x, shards: int, seq: int):
  """[Q,N,..] (row-major over N: D slot shards of N/D rows) -> [D·Q·N/D,..], shard
  ``d·Q + q``'s rows (its slot shard's, in sequence shard q's copy) in a block of their own
  (``by_shard``'s order)."""
  N = x.shape[1]
  x = jnp.swapaxes(x.reshape(seq, shards, N // shards, *x.shape[2:]), 0, 1)
  return x.reshape(shards * seq * (N // shards), *x.shape[3:])


def rows_from_sequence(x, shards: int, seq: int):
  """``rows_by_sequence``'s inverse for results: [D·Q·N/D,..] -> [Q,N,..]."""
  n = x.shape[0] // (shards * seq)
  x = jnp.swapaxes(x.reshape(shards, seq, n, *x.shape[1:]), 0, 1)
  return x.reshape(seq, shards * n, *x.shape[3:])


def by_sequence(table, start, length, S: int, seq: int):
  """Each sequence shard's part of rows' pages (``entry_shard``): shard q holds entries q,
  q + Q, .. of every row; read in that order they are a row of nb / Q entries whose valid
  positions are again one range (positions below ``start`` come first, those below
  ``length`` form a prefix), so paged attention over them is the plain one.

  Args:
    table: int32 [B,nb] (nb a multiple of Q = ``seq``). start, length: int32 [B]: positions
      start <= j < length valid. S: page size.
  Returns:
    (table [Q,B,nb/Q], start [Q,B], length [Q,B]) in each shard's compacted positions.
  """
  B, nb = table.shape
  entries = jnp.arange(nb).reshape(nb // seq, seq).T  # [Q,nb/Q]: entry i·Q + q
  below = lambda n: jnp.sum(jnp.clip(n[None, :, None] - entries[:, None, :] * S, 0, S), -1)
  return jnp.moveaxis(table.reshape(B, nb // seq, seq), 2, 0), below(start), below(length)


def local_ids(table, Pl: int):
  """Global page ids -> their shard's own (``id mod Pl``; -1 stays -1)."""
  return jnp.where(table < 0, table, table % Pl)


def by_shard(fn, D: int, pool: tuple, rows: tuple):
  """``fn(*pool_shard, *rows_shard)`` on each of the pool's D shards: every array of
  ``pool`` [D·Pl,..] as [D,Pl,..] and of ``rows`` [N,..] (slot-major, ids local:
  ``local_ids``) as [D,N/D,..], mapped over D, results [D,..] joined back to [D·X,..].
  Each shard's pages and rows sit on the same devices (``kv_cache``: the pool's pages and
  the slots over the same batch axes), so XLA partitions the mapped gathers and scatters
  along D, with no collective."""
  split = lambda x: x.reshape(D, x.shape[0] // D, *x.shape[1:])
  out = jax.vmap(fn)(*[split(x) for x in pool], *[split(x) for x in rows])
  return jax.tree.map(lambda x: x.reshape(D * x.shape[1], *x.shape[2:]), out)


# logical axes of each layer's pool (keys and values): pages on every batch shard, kv heads
# over ``act_kv_heads`` (``kv_cache.CACHE_AXES``)
POOL_AXES = (None, "act_kv_heads", None, None)


def device_layout(x, axes=POOL_AXES) -> Layout | None:
  """The layout XLA:TPU gives by default to a shard of ``x`` (logical ``axes``, the shard
  the active mesh's rules give each device; the whole of ``x`` outside a mesh): the layout a
  program's arguments and results have. None where the program is not traced for TPU."""
  if pallas_kernels.current_platform() != "tpu":
    return None
  active = sharding.active()
  shape = list(x.shape)
  if active is None:
    device = jax.devices()[0]
  else:
    mesh, rules = active
    device = mesh.devices.flat[0]
    spec = sharding.logical_to_spec(axes, rules, mesh, x.shape)
    for i, names in enumerate(spec):
      names = (names,) if isinstance(names, str) else (names or ())
      shape[i] //= math.prod(mesh.shape[n] for n in names)
  if device.platform != "tpu":
    return None
  try:
    return Layout.from_pjrt_layout(device.client.get_default_layout(x.dtype, tuple(shape),
                                                                    device))
  except jax.errors.JaxRuntimeError:  # a client that does not say
    return None


def h_minor(layout: Layout | None) -> bool:
  """Whether a key pool [Pg,K,H,S] laid out as ``layout`` has H minor and is otherwise in
  order: its row-major [Pg,K,S,H] relabelling, the [S,H] key pages that
  ``pallas_kernels.paged_decode_attention(keys_by_row=True)`` reads without a copy. XLA:TPU
  lays [..,H,S] out so when S is below the 128 lanes and H a multiple of them."""
  return layout is not None and tuple(layout.major_to_minor) == (0, 1, 3, 2)


def identity_table(G: int, M: int, NP: int, D: int = 1) -> jax.Array:
  """int32 [G,M,NP]: entry (g, m, p) on page ``p·G·M + g·M + m`` for good (page-major), so
  the first nb pages of every sample are the pool's first nb·G·M pages (``in_place``). With
  D shards, the same within each shard: slot g = d·G/D + g' on page ``d·Pl + p·(G/D)·M +
  g'·M + m`` (Pl = G·M·NP / D)."""
  Gl = G // D
  local = (jnp.arange(NP, dtype=jnp.int32)[None, None, :] * (Gl * M)
           + jnp.arange(Gl * M, dtype=jnp.int32).reshape(Gl, M, 1))
  shard = jnp.arange(D, dtype=jnp.int32)[:, None, None, None] * (Gl * M * NP)
  return (shard + local[None]).reshape(G, M, NP)


def live_pages(pool_k, pool_v, table_live, shards: int = 1):
  """The live pages of every sample, page-major: keys [nb,G,M,K,H,S], values [nb,G,M,K,S,H]
  (``table_live`` int32 [G,M,nb]); entries without a page read page 0 (their positions are
  masked by the caller's validity mask). ``shards``: the pool's D shards, each read by its
  own slots (``by_shard``)."""
  if shards > 1:
    pages_ = by_shard(lambda pk, pv, t: tuple(jnp.moveaxis(x, 0, 1) for x in
                                              live_pages(pk, pv, t)),
                      shards, (pool_k, pool_v),
                      (local_ids(table_live, pool_k.shape[0] // shards),))
    return tuple(jnp.moveaxis(x, 1, 0) for x in pages_)
  idx = jnp.maximum(jnp.moveaxis(table_live, -1, 0), 0)
  return pool_k[idx], pool_v[idx]


def in_place(pool_k, pool_v, G: int, M: int, nb: int, shards: int = 1):
  """``live_pages`` for ``identity_table``: the pool's first nb·G·M pages (of each shard)
  reshaped, no gather and no copy (a leading slice of a row-major array is contiguous)."""
  _, K, H, S = pool_k.shape
  if shards == 1:
    return (pool_k[:nb * G * M].reshape(nb, G, M, K, H, S),
            pool_v[:nb * G * M].reshape(nb, G, M, K, S, H))
  D, Gl = shards, G // shards
  first = lambda x: x.reshape(D, -1, *x.shape[1:])[:, :nb * Gl * M].reshape(
      D, nb, Gl, M, *x.shape[1:])
  join = lambda x: jnp.moveaxis(x, 0, 1).reshape(nb, G, M, *x.shape[4:])
  return join(first(pool_k)), join(first(pool_v))


def contiguous(pool_k, pool_v, table_live):
  """The live pages of every row as one response cache: keys [..,K,H,nb·S], values
  [..,K,nb·S,H] (``table_live`` int32 [..,nb]); positions without a page hold page 0's
  values and must be masked."""
  idx = jnp.maximum(table_live, 0)
  k, v = pool_k[idx], pool_v[idx]  # [..,nb,K,H,S] / [..,nb,K,S,H]
  axis, nb = table_live.ndim - 1, table_live.shape[-1]
  k = jnp.moveaxis(k, axis, -2)  # [..,K,H,nb,S]
  k = k.reshape(*k.shape[:-2], nb * k.shape[-1])
  v = jnp.moveaxis(v, axis, -3)  # [..,K,nb,S,H]
  return k, v.reshape(*v.shape[:-3], nb * v.shape[-2], v.shape[-1])


def rows_need(slot, sample, start, count, G: int, M: int, NP: int, S: int):
  """bool [G,M,NP]: the entries that hold response indices ``start .. start+count-1`` of
  rows (slot [B], sample [B]); rows with slot >= G are ignored."""
  e = jnp.arange(NP)
  hit = ((e[None, :] >= (start // S)[:, None]) & (e[None, :] * S < (start + count)[:, None])
         & (count > 0)[:, None])
  return jnp.zeros((G, M, NP), jnp.int8).at[slot, sample].max(hit.astype(jnp.int8),
                                                              mode="drop") > 0


def write_rows(pool_k, pool_v, table, slot, sample, index, valid, k, v):
  """Write K/V of tokens [B,T] at response indices ``index`` [B,T] of rows (slot, sample)
  [B] onto their pages; ``valid`` bool [B,T]. k, v: [B,T,K,H]."""
  G = table.shape[0]
  S = pool_k.shape[-1]
  entry = jnp.clip(index // S, 0, table.shape[-1] - 1)
  page = table[jnp.minimum(slot, G - 1)[:, None], sample[:, None], entry]
  page = jnp.where(valid & (slot < G)[:, None], page, -1)
  return write(pool_k, pool_v, page, index % S, k, v)


def grow(pool: tuple, pages: int, shards: int = 1) -> tuple:
  """Each layer's pool padded with zero pages to ``pages`` pages, each of its ``shards``
  shards alike (at the end of each shard: ``regrown_ids`` gives the pages in use their new
  ids)."""
  D = shards
  def pad(p):
    q = p.reshape(D, p.shape[0] // D, *p.shape[1:])
    q = jnp.pad(q, [(0, 0), (0, pages // D - q.shape[1])] + [(0, 0)] * (p.ndim - 1))
    return q.reshape(pages, *p.shape[1:])
  return tuple(pad(p) for p in pool)


def regrown_ids(table, old: int, new: int, shards: int = 1):
  """Page ids of ``table`` in a pool grown from ``old`` to ``new`` pages (``grow``): page
  ``d·Pl + i`` of shard d becomes ``d·Pl' + i``; the same ids on one shard."""
  if shards == 1:
    return table
  Pl, Pl_new = old // shards, new // shards
  return jnp.where(table < 0, table, (table // Pl) * Pl_new + table % Pl)
