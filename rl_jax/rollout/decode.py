"""Decode over the prompt-once cache: one token per running sample per step, in a
``lax.while_loop`` that runs until enough groups finish (continuous batching).

Axis letters: the legend of ``rl_jax/__init__.py`` (G group slots, M samples per
slot, P prefix cache length, R response cache length, N query heads, K kv heads, J query
heads per kv head, H head dim, V vocab).

A decode query attends its group's shared prefix (stored once) and its own response, read
from its first ``live`` pages of the response pool (``pages``: a power-of-two bucket
covering the longest live response, so a step's work follows the tokens generated, not the
budget; the fed token takes a page when it starts one). Both score sets share one softmax
(``paged_decode_attention``, each page a batch entry of the matmuls): the same result as the
log-sum-exp merge of the two partial softmaxes that prefill uses, with fewer passes, which
matters in the per-token loop.

Sliding-window layers (Gemma 3): the query at position pos sees prefix key p only if
pos − p < window and suffix key r only if cur − r < window (``AttnSpec`` from the trunk;
layer kinds are static in the unrolled decode step).

Mixture of experts: the experts every MoE layer chooses for the fed token are written into
``DecodeState.routing`` at the token's index (what router replay feeds the trainer).

Every sampled token is drawn from a uniform that depends only on (request id, sample id,
token index) (``sampling.token_uniforms``), so results do not depend on batching, slots or
the mesh.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

import pallas_kernels
from rl_jax import sharding
from rl_jax.models import grouped
from rl_jax.models import transformer as tx
from rl_jax.models.config import ModelConfig
from rl_jax.rollout import kv_cache, pages, sampling
from rl_jax.rollout.kv_cache import (RUNNING, TRACE_COUNTS, DecodeState, constrain_state,
                                     mesh_context, record)

__all__ = ["NEVER", "SharedReads", "can_step", "decode", "decode_attention", "decode_step",
           "paged_decode_attention", "reads_shared_pages", "shared_reads",
           "split_decode_attention"]


def decode_attention(q, prefix_k, prefix_v, prefix_valid, suffix_k, suffix_v, suffix_valid,
                     keys_length_last: bool = True):
  """One query per sample over its group's shared prefix and its own contiguous suffix cache:
  ``paged_decode_attention`` with the suffix as one page.

  Args:
    q: [G,M,N,H]. prefix_k: [G,K,H,P]; prefix_v: [G,K,P,H]; prefix_valid: bool [G,P] or
      [G,M,P]. suffix_k: [G,M,K,H,R]; suffix_v: [G,M,K,R,H]; suffix_valid: bool [G,M,R].
    keys_length_last: False reads keys laid out like the values ([G,K,P,H] /
      [G,M,K,R,H]), the layout the caches had before; on CPU it is 1.5-2x slower per layer
      (``scripts/bench_decode_attention.py``'s baseline).
  Returns:
    [G,M,N,H] in q's dtype.
  """
  return paged_decode_attention(q, prefix_k, prefix_v, prefix_valid, suffix_k[None],
                                suffix_v[None], suffix_valid, keys_length_last)


def paged_decode_attention(q, prefix_k, prefix_v, prefix_valid, page_k, page_v, page_valid,
                           keys_length_last: bool = True, shared=None):
  """One query per sample over its group's shared prefix and its own response pages, and
  optionally pages its group's samples share (read once per group, as the prefix).

  The current token's K/V must already be on its page (``page_valid`` includes it). The
  prefix scores [..,P] (prefix K/V read once per group) and the sample's page scores share
  one softmax; this equals the log-sum-exp merge of the two partial softmaxes
  (``pallas_kernels.merge_partials``) with fewer passes. Pages come page-major
  (``pages.live_pages`` / ``pages.in_place``): page p of every sample is one batch entry of
  plain batched matmuls (batch axes (p, g, m, k) leading in both operands), so no page is
  copied into a joined cache; keys are stored length-last, so q·K contracts H and p·V the
  page's S positions, both without transposes.

  Args:
    q: [G,M,N,H]. prefix_k: [G,K,H,P]; prefix_v: [G,K,P,H]; prefix_valid: bool [G,P] or
      [G,M,P]. page_k: [nb,G,M,K,H,S] (keys_length_last=False: [nb,G,M,K,S,H]); page_v:
      [nb,G,M,K,S,H]; page_valid: bool [G,M,nb·S] (position i of the pages read: page
      i // S, offset i % S).
    shared: None, or (keys [G,K,H,T], values [G,K,T,H], valid bool [G,M or 1,T]): the T
      positions of pages every sample of a group names (``pages.shared_entries``: a prompt
      on pages, a forked prefix; ``pages.shared_cache``), read once per group like the
      prefix; each sample's ``page_*`` then hold only its entries after them. The same
      softmax, summed in another order.
  Returns:
    [G,M,N,H] in q's dtype.
  """
  G, M, N, H = q.shape
  K, P = prefix_v.shape[1], prefix_v.shape[2]
  nb, S = page_v.shape[0], page_v.shape[-2]
  J = N // K
  qg = q.reshape(G, M, K, J, H).astype(jnp.float32) / np.float32(np.sqrt(H))
  f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
  # a = M·J rows of a kv head (a local letter); p = page, s = position on the page
  q_pre = jnp.swapaxes(qg, 1, 2).reshape(G, K, M * J, H)
  pre_spec, page_spec = (("gkah,gkhp->gkap", "pgmkjh,pgmkhs->pgmkjs") if keys_length_last else
                         ("gkah,gkph->gkap", "pgmkjh,pgmksh->pgmkjs"))
  s_pre = f32(pre_spec, q_pre, prefix_k).reshape(G, K, M, J, P)
  s_pre = jnp.swapaxes(s_pre, 1, 2)  # [G,M,K,J,P]
  s_page = f32(page_spec, jnp.broadcast_to(qg, (nb, G, M, K, J, H)), page_k)  # [nb,G,M,K,J,S]
  pre_valid = prefix_valid if prefix_valid.ndim == 3 else prefix_valid[:, None, :]
  pre_valid = jnp.broadcast_to(pre_valid, (G, M, P))[:, :, None, None, :]
  valid = jnp.moveaxis(page_valid.reshape(G, M, nb, S), 2, 0)[:, :, :, None, None, :]
  s_pre = jnp.where(pre_valid, s_pre, -jnp.inf)
  s_page = jnp.where(valid, s_page, -jnp.inf)
  top = jnp.maximum(jnp.max(s_pre, axis=-1), jnp.max(s_page, axis=(0, -1)))  # [G,M,K,J]
  if shared is not None:  # as the prefix: the group's M·J rows of a kv head at once
    sh_k, sh_v, sh_valid = shared
    T = sh_v.shape[2]
    s_sh = jnp.swapaxes(f32("gkah,gkht->gkat", q_pre, sh_k).reshape(G, K, M, J, T), 1, 2)
    s_sh = jnp.where(jnp.broadcast_to(sh_valid, (G, M, T))[:, :, None, None, :], s_sh,
                     -jnp.inf)
    top = jnp.maximum(top, jnp.max(s_sh, axis=-1))
  e_pre = jnp.exp(s_pre - top[..., None])
  e_page = jnp.exp(s_page - top[..., None])
  total = jnp.sum(e_pre, axis=-1) + jnp.sum(e_page, axis=(0, -1))  # >= 1: the current token
  if shared is not None:
    e_sh = jnp.exp(s_sh - top[..., None])
    total = total + jnp.sum(e_sh, axis=-1)
  p_pre = jnp.swapaxes(e_pre / total[..., None], 1, 2).reshape(G, K, M * J, P)
  o_pre = jnp.swapaxes(f32("gkap,gkph->gkah", p_pre, prefix_v).reshape(G, K, M, J, H), 1, 2)
  o_page = f32("pgmkjs,pgmksh->pgmkjh", e_page / total[..., None], page_v)
  out = o_pre + jnp.sum(o_page, axis=0)
  if shared is not None:
    p_sh = jnp.swapaxes(e_sh / total[..., None], 1, 2).reshape(G, K, M * J, T)
    out = out + jnp.swapaxes(f32("gkat,gkth->gkah", p_sh, sh_v).reshape(G, K, M, J, H), 1, 2)
  return out.reshape(G, M, N, H).astype(q.dtype)


def split_decode_attention(q, prefix_k, prefix_v, prefix_valid, pool_k, pool_v, table,
                           start, length, shards: int = 1, seq: int = 1):
  """``paged_decode_attention`` as two partial softmaxes merged by log-sum-exp: the prefix in
  jnp (read once per group), the response pages by ``pallas_kernels.paged_decode_attention``
  (the Pallas kernel of the platform the program is compiled for, TPU or GPU; the jnp
  reference on CPU), which reads each row's pages in place through its table (no gather).

  Args:
    q: [G,M,N,H]. prefix_k: [G,K,H,P]; prefix_v: [G,K,P,H]; prefix_valid: bool [G,P] or
      [G,M,P]. pool_k: [Pg,K,H,S]; pool_v: [Pg,K,S,H]; table: int32 [G,M,nb] (-1: no
      page). start, length: int32 [G,M]: response positions start <= j < length are valid.
    shards: the pool's D slot shards (``pages``' "Shards"; pages of shard d only in the
      tables of slots ``d·G/D ..``). seq: Q sequence shards per slot shard (entry e's page
      on sequence shard e mod Q: ``pages.entry_shard``; nb a multiple of Q); each attends
      its own entries (``pages.by_sequence``) and the Q partial softmaxes are merged.
  Returns:
    [G,M,N,H] in q's dtype.
  """
  G, M, N, H = q.shape
  K, P = prefix_v.shape[1], prefix_v.shape[2]
  J = N // K
  scale = 1.0 / float(np.sqrt(H))
  qg = q.reshape(G, M, K, J, H)
  f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
  q_pre = jnp.swapaxes(qg.astype(jnp.float32) * np.float32(scale), 1, 2).reshape(G, K, M * J, H)
  s_pre = jnp.swapaxes(f32("gkah,gkhp->gkap", q_pre, prefix_k).reshape(G, K, M, J, P), 1, 2)
  pre_valid = prefix_valid if prefix_valid.ndim == 3 else prefix_valid[:, None, :]
  p_pre, lse_pre = pallas_kernels.partial_softmax(s_pre, pre_valid[:, :, None, None, :])
  p_pre = jnp.swapaxes(p_pre, 1, 2).reshape(G, K, M * J, P)
  o_pre = jnp.swapaxes(f32("gkap,gkph->gkah", p_pre, prefix_v).reshape(G, K, M, J, H), 1, 2)
  rows = lambda x: x.reshape(G * M, *x.shape[2:])
  o_pg, lse_pg = _pages_per_shard(scale, G, shards, seq)(rows(qg), pool_k, pool_v, rows(table),
                                                         rows(start), rows(length))
  out = pallas_kernels.merge_partials([o_pre, o_pg.reshape(G, M, K, J, H)],
                                      [lse_pre, lse_pg.reshape(G, M, K, J)])
  return out.reshape(G, M, N, H).astype(q.dtype)


def _pages_per_shard(scale: float, G: int, shards: int, seq: int = 1):
  """``pallas_kernels.paged_decode_attention`` (rows [G·M,..], slot-major) run per shard with
  ``shard_map`` on a mesh of several devices when it runs a Pallas kernel (XLA cannot
  partition a kernel's custom call): kv heads over ``act_kv_heads``; with a pool of D > 1
  shards (``kv_cache.pool_shards``), rows and pool pages over the slots' batch axes, each
  shard's table in its own page ids (``pages.local_ids``); with one, rows over the rules'
  ``batch`` axes and each shard holding the pool's pages of its kv heads. With Q = ``seq``
  > 1 sequence shards: ``_pages_by_sequence``."""
  if seq > 1:
    return functools.partial(_pages_by_sequence, scale, G, shards, seq)

  def run(q, pool_k, pool_v, table, start, length):
    # keys read as [S,H] pages where the pool is laid out with H minor (no copy)
    by_row = pages.h_minor(pages.device_layout(pool_k))
    attend = functools.partial(pallas_kernels.paged_decode_attention, scale=scale,
                               keys_by_row=by_row)
    active = sharding.active()
    if active is None or active[0].size == 1 or pallas_kernels.current_platform() == "cpu":
      if shards > 1:  # the jnp reference, each shard reading its own pages
        return pages.by_shard(lambda pk, pv, *rows: attend(rows[0], pk, pv, *rows[1:]),
                              shards, (pool_k, pool_v),
                              (q, pages.local_ids(table, pool_k.shape[0] // shards), start,
                               length))
      return attend(q, pool_k, pool_v, table, start, length)
    mesh, rules = active
    one = lambda axes, n: sharding.logical_to_spec((axes,), rules, mesh, (n,))[0]
    heads = one("act_kv_heads", q.shape[1])
    if shards > 1:
      rows = one("batch", G)
      table = pages.local_ids(table, pool_k.shape[0] // shards)
      pool_spec = PartitionSpec(rows, heads)
    else:
      rows = one("batch", q.shape[0])
      pool_spec = PartitionSpec(None, heads)
    q_spec = PartitionSpec(rows, heads)
    # check_vma=False: a pallas_call's outputs carry no varying-axes type
    fn = jax.shard_map(attend, mesh=mesh, check_vma=False,
                       in_specs=(q_spec, pool_spec, pool_spec, PartitionSpec(rows),
                                 PartitionSpec(rows), PartitionSpec(rows)),
                       out_specs=(q_spec, q_spec))
    return fn(q, pool_k, pool_v, table, start, length)

  return run


def _pages_by_sequence(scale: float, G: int, shards: int, seq: int, q, pool_k, pool_v, table,
                       start, length):
  """``_pages_per_shard`` over a pool of D slot shards x Q = ``seq`` sequence shards: each
  of the D·Q shards attends the rows of its slot shard over its own entries
  (``pages.by_sequence``: entries q, q + Q, .. compacted, with the positions valid on them),
  and the Q partial results of a row are merged by log-sum-exp (``merge_partials``). A
  shard that holds none of a row's valid positions gives lse -inf, out 0: weight 0.

  Args: as the ``run`` of ``_pages_per_shard`` (q [B,K,J,H] rows slot-major; pool [Pg,..]).
  Returns:
    (out float32 [B,K,J,H], lse float32 [B,K,J]).
  """
  D, Q = shards, seq
  S = pool_v.shape[2]
  Pl = pool_k.shape[0] // (D * Q)
  tq, sq, lq = pages.by_sequence(table, start, length, S, Q)  # [Q,B,nb/Q], [Q,B]
  tq = pages.local_ids(tq, Pl)
  by_row = pages.h_minor(pages.device_layout(pool_k))
  attend = functools.partial(pallas_kernels.paged_decode_attention, scale=scale,
                             keys_by_row=by_row)
  active = sharding.active()
  if active is None or active[0].size == 1 or pallas_kernels.current_platform() == "cpu":
    wide = lambda x: pages.rows_by_sequence(jnp.broadcast_to(x, (Q, *x.shape)), D, Q)
    out = pages.by_shard(lambda pk, pv, *rows: attend(rows[0], pk, pv, *rows[1:]), D * Q,
                         (pool_k, pool_v), (wide(q), *(pages.rows_by_sequence(x, D, Q)
                                                       for x in (tq, sq, lq))))
    o, lse = (pages.rows_from_sequence(x, D, Q) for x in out)  # [Q,B,..]
  else:
    mesh, rules = active
    page_axes, seq_axes = kv_cache.pool_page_axes(G, active, Q), kv_cache.sequence_axes(G, active)
    heads = sharding.logical_to_spec(("act_kv_heads",), rules, mesh, (q.shape[1],))[0]
    rows = sharding.logical_to_spec(("batch",), rules, mesh, (G,))[0]

    def own(q, pk, pv, t, first, end):  # a device's sequence shard: [1,..] in and out
      return tuple(x[None] for x in attend(q, pk, pv, t[0], first[0], end[0]))

    fn = jax.shard_map(own, mesh=mesh, check_vma=False,
                       in_specs=(PartitionSpec(rows, heads), PartitionSpec(page_axes, heads),
                                 PartitionSpec(page_axes, heads), PartitionSpec(seq_axes, rows),
                                 PartitionSpec(seq_axes, rows), PartitionSpec(seq_axes, rows)),
                       out_specs=(PartitionSpec(seq_axes, rows, heads),) * 2)
    o, lse = fn(q, pool_k, pool_v, tq, sq, lq)
  return pallas_kernels.merge_partials(list(o), list(lse), return_lse=True)


def reads_shared_pages(cfg: ModelConfig, Q: int, identity: bool) -> bool:
  """Whether ``decode_step`` can read the pages a group's samples share once per group
  (its ``shared`` bucket): on the jnp path, over a table that shares pages (not the
  identity table) of a pool not split over sequence devices. The paged kernel reads each
  row's pages in place instead. Call it inside the engine's mesh (``mesh_context``: the
  path follows the platform compiled for)."""
  kernel = grouped.prefix_attention_path(cfg.prefix_attention) == "kernel"
  return not identity and Q == 1 and not kernel


class SharedReads(NamedTuple):
  """The pages each slot's running samples all name at a ``decode`` call's start (forked
  prompt pages, a forked prefix), read once per slot at every step of the call: they are
  never written while shared (tokens are only appended, forks copy a partial page), so
  they stay the slot's through the call.

  own: int32 [G], the first table entry each sample reads as its own
  (``pages.shared_entries``). table: int32 [G,1,ns], the slot's entries before ``own``
  (-1 from ``own`` on: ``pages.shared_table``)."""
  own: jax.Array
  table: jax.Array


def shared_reads(state: DecodeState, shared: int) -> SharedReads:
  """``SharedReads`` of the running samples of ``state``, at most ``shared`` pages a slot."""
  take = (state.reason == RUNNING) & state.active[:, None]
  return SharedReads(*pages.shared_table(state.pages, take, shared))


def decode_step(cfg: ModelConfig, params, layers, state: DecodeState, sp, version,
                filtered: bool, live: int | None = None, identity: bool = False,
                shared: SharedReads | None = None) -> DecodeState:
  """Feed every running sample's last token, append one sampled token.

  The fed token (response index ``cur``) takes a page if its table entry has none
  (``pages.take_entry``); per layer its K/V is written onto that page in place, then the query
  attends its prefix and the first ``live`` pages of its response (``paged_decode_attention``
  over ``pages.live_pages``). With ``shared`` the leading pages every running sample of a
  slot names are read once per slot from their copy, and each sample's ``live`` pages are
  its entries after them.

  Args / Returns: see ``decode``; ``layers`` = ``tx.unstack_layers(params, cfg)``; ``live``:
  static live-page bucket nb (None = every entry, NP); ``identity``: static, the table is
  ``init_state(identity=True)``'s, so pages are read as a leading slice of the pool in
  place (no gather) and none is taken; ``shared``: ``shared_reads`` of the call (None:
  none; needs ``reads_shared_pages``), each layer's shared pages gathered as one cache per
  slot (``pages.shared_cache``: a transient of one layer's [G,K,H,ns·S]). One step. Every running sample's ``cur`` must lie
  below ``(shared.own + live)·S`` and the pool must hold a page for each sample that needs
  one (``decode`` checks both before each step).
  """
  G, M, R = state.tokens.shape
  P = state.prefix_v[0].shape[2]
  S = state.suffix_v[0].shape[2]
  nb = state.pages.shape[-1] if live is None else live
  take = (state.reason == RUNNING) & state.active[:, None]
  cur = jnp.maximum(state.length - 1, 0)  # index of the token fed now
  feed = jnp.take_along_axis(state.tokens, cur[..., None], axis=-1)[..., 0]
  pos = (state.prefix_len[:, None] + cur).reshape(G * M, 1)
  pvalid = jnp.arange(P)[None, :] < state.prefix_len[:, None]
  svalid = jnp.arange(nb * S)[None, None, :] <= cur[..., None]
  NP = state.pages.shape[-1]
  # pool shards: D slot shards (each slot reads and writes its own shard's pages) of Q
  # sequence shards each (entry e of a sample's table on sequence shard e mod Q)
  D, Q = kv_cache.state_shards(state)
  if identity:
    table, refs = state.pages, state.refs
    entry = jnp.minimum(cur // S, NP - 1)
    page = jnp.take_along_axis(table, entry[..., None], axis=-1)[..., 0]
  else:
    table, refs, page = pages.take_entry(state.pages, state.refs, take, cur // S, Q)
  page = jnp.where(take, page, -1).reshape(-1)  # rows not fed write nothing
  offset = (cur % S).reshape(-1)
  live_table = table[:, :, :nb]
  caches = {"sk": list(state.suffix_k), "sv": list(state.suffix_v)}
  # a pool split over sequence devices is read shard by shard and merged (split path)
  split = grouped.prefix_attention_path(cfg.prefix_attention) == "kernel" or Q > 1
  if shared is not None and not reads_shared_pages(cfg, Q, identity):
    raise ValueError("shared pages are read once per slot only on the jnp path over a "
                     "shared table (reads_shared_pages)")
  spos = jnp.arange(nb * S)  # the response position of each key read, [..,nb·S]
  if shared is not None:  # entries own .. own+nb-1 per sample; the ones before, once a slot
    live_table = pages.own_entries(table, shared.own, nb)
    own = shared.own[:, None, None]  # [G,1,1]
    spos = own * S + spos  # [G,1,nb·S]
    svalid = (spos <= cur[..., None]) & (spos < NP * S)
    sh_pos = jnp.arange(shared.table.shape[-1] * S)
    # [G,1,ns·S]: a running sample's fed token lies past its slot's shared pages
    sh_valid = sh_pos < own * S
  read = ((lambda k, v: pages.in_place(k, v, G, M, nb, D)) if identity else
          (lambda k, v: pages.live_pages(k, v, live_table, D)))

  qpos = state.prefix_len[:, None] + cur  # [G,M]

  def attend(q, k, v, layer, spec=None):
    l = layer
    caches["sk"][l], caches["sv"][l] = pages.write(caches["sk"][l], caches["sv"][l], page,
                                                   offset, k[:, 0], v[:, 0], D, Q)
    pv, sv = pvalid, svalid
    shv = sh_valid if shared is not None else None
    if spec is not None:
      pv = tx.window_mask(spec, pvalid[:, None, :], qpos[..., None] - jnp.arange(P))
      sv = tx.window_mask(spec, svalid, cur[..., None] - spos)
      if shared is not None:
        shv = tx.window_mask(spec, sh_valid, cur[..., None] - sh_pos)
    q = q.reshape(G, M, *q.shape[2:])
    if split:  # the response pages through the paged kernel (``split_decode_attention``)
      start = jnp.zeros_like(cur)  # sliding layers see response keys cur - j < window
      if spec is not None and spec.window is not None and spec.sliding is not False:
        start = jnp.where(spec.sliding, jnp.maximum(cur - spec.window + 1, 0), start)
      out = split_decode_attention(q, state.prefix_k[l], state.prefix_v[l], pv,
                                   caches["sk"][l], caches["sv"][l], live_table, start, cur + 1,
                                   D, Q)
    else:
      once = None
      if shared is not None:
        once = (*pages.shared_cache(caches["sk"][l], caches["sv"][l], shared.table, D), shv)
      out = paged_decode_attention(q, state.prefix_k[l], state.prefix_v[l], pv,
                                   *read(caches["sk"][l], caches["sv"][l]), sv, shared=once)
    return out.reshape(G * M, 1, *out.shape[2:]), layer

  x = tx.embed(cfg, params, feed.reshape(G * M, 1))
  moe = state.routing is not None
  out = tx.trunk_unrolled(cfg, params, layers, x, pos, attend, list(range(len(layers))),
                          return_routing=moe)
  h = out[0]
  if moe:  # the fed token's experts [Y,G·M,1,X] -> its record at index cur
    ids = jnp.moveaxis(out[2][:, :, 0], 0, 1).reshape(G, M, *state.routing.shape[3:])
    at = (jnp.arange(G)[:, None], jnp.arange(M)[None, :], jnp.where(take, cur, R))
    state = state._replace(routing=state.routing.at[at].set(ids, mode="drop"))
  logits = tx.logits_from_hidden(cfg, params, h[:, 0])  # [G·M,V]
  uniforms = lambda: sampling.token_uniforms(state.stream.reshape(G * M, 2),
                                             (state.length - state.skip).reshape(-1))
  tok, lp = sampling.sample_logits(uniforms, logits, sp, filtered)
  state = state._replace(suffix_k=tuple(caches["sk"]), suffix_v=tuple(caches["sv"]),
                         pages=table, refs=refs)
  return constrain_state(record(state, tok.reshape(G, M), lp.reshape(G, M), take, version, sp))


def can_step(state: DecodeState, live: int, own=None) -> jax.Array:
  """Whether ``decode_step(.., live, shared=)`` can run: every running sample's fed index
  lies in the pages it reads (below entry ``own + live``; ``own`` int32 [G], the
  ``SharedReads``' first own entries, None: 0) and each pool shard holds a page for every
  sample of its slots whose fed index starts a page it has none for."""
  S = state.suffix_v[0].shape[2]
  take = (state.reason == RUNNING) & state.active[:, None]
  cur = jnp.maximum(state.length - 1, 0)
  end = live if own is None else own[:, None] + live
  inside = jnp.all(~take | (cur < end * S))
  entry = jnp.minimum(cur // S, state.pages.shape[-1] - 1)
  has = jnp.take_along_axis(state.pages, entry[..., None], axis=-1)[..., 0] >= 0
  G = state.pages.shape[0]
  D, Q = kv_cache.state_shards(state)  # D·Q shards: a slot's entry e on shard d·Q + e mod Q
  shard = pages.entry_shard(pages.shard_of_slot(jnp.arange(G), G, D)[:, None], entry, Q)
  short = jnp.zeros(D * Q, jnp.int32).at[shard].add((take & ~has).astype(jnp.int32))
  return inside & jnp.all(short <= jnp.sum(state.refs == 0, axis=1))


# ``decode``'s ``min_finished`` or ``stop_count`` when that rule should never stop the loop
NEVER = np.iinfo(np.int32).max


@functools.partial(jax.jit, static_argnames=("cfg", "filtered", "ctx", "live", "identity",
                                             "shared"), donate_argnames=("state",))
def decode(cfg: ModelConfig, params, state: DecodeState, sp, version, max_steps,
           min_finished, stop_count, filtered: bool, ctx=None, live: int | None = None,
           identity: bool = False, shared: int = 0) -> tuple[DecodeState, jax.Array]:
  """Decode inside one ``lax.while_loop`` until the caller has work to do.

  Stops when no sample is running, after ``max_steps`` steps, once at least
  ``min_finished`` active slots have all their samples finished (so the caller can refill
  them: continuous batching), once ``stop_count`` of the samples running at entry have
  stopped (a turn ended: its environment step can start), or when the next step cannot run
  (``can_step``: a sample reached the end of the ``live`` pages the program reads, or the
  pool is out of pages; the caller then picks a larger bucket, grows the pool or preempts).
  A sample stops on an end id or a stop sequence (``sp``) or at its ``budget``; it then
  leaves the decode batch (``decode_step`` skips samples that are not RUNNING).

  Args:
    params: model parameters (jit argument). state: DecodeState (donated).
    sp: SamplingParams. version: int32 policy version recorded for new tokens.
    max_steps, min_finished, stop_count: int32 scalars (traced; ``NEVER`` turns a rule off).
    filtered: static; top-k/top-p active. live: static live-page bucket (None = all NP).
    identity: static; the state's table is ``init_state(identity=True)``'s (``decode_step``).
    shared: static; the pages every running sample of a slot names at entry, at most this
      many (``shared_reads``), are read once per slot at every step (0: none); ``live``
      then counts each sample's pages after them.
  Returns:
    (state, steps run).
  """
  TRACE_COUNTS["decode"] += 1
  with mesh_context(ctx):
    running = lambda s: (s.reason == RUNNING) & s.active[:, None]
    at_entry = jnp.sum(running(state))

    def finished(s):
      return jnp.sum(s.active & jnp.all(s.reason != RUNNING, axis=1))

    layers = tx.unstack_layers(params, cfg)  # sliced once per call, not per step
    nb = state.pages.shape[-1] if live is None else live
    once = shared_reads(state, shared) if shared else None
    own = None if once is None else once.own

    def cond(carry):
      s, step = carry
      n = jnp.sum(running(s))
      return ((n > 0) & (step < max_steps) & (finished(s) < min_finished)
              & (at_entry - n < stop_count) & can_step(s, nb, own))

    def body(carry):
      s, step = carry
      return (decode_step(cfg, params, layers, s, sp, version, filtered, nb, identity, once),
              step + 1)

    return jax.lax.while_loop(cond, body, (constrain_state(state), jnp.int32(0)))
