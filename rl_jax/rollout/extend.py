"""Incremental prefill of multi-turn rollouts: an observation chunk onto the sample's pages
of the KV cache (``extend``); the turns themselves are decoded by ``decode.decode``, which
stops when a turn ends. ``prefill_tail`` is the same prefill without a sampled token: a
resumed sample's tokens after the whole pages it forked from a sample that begins alike.

Axis letters: the legend of ``rl_jax/__init__.py`` (G group slots, M samples per
slot, P prefix cache length, R response (trajectory) cache length, L layers, K kv heads,
H head dim, V vocab). Be is the extension bucket (rows) and C the chunk bucket (tokens).

A trajectory lives in its sample's response region: token j of the trajectory (model tokens
and observation tokens alike) has RoPE position ``prefix_len + j``, exactly as in the
unpacked sequence ``prompt + trajectory``. When a turn ends, the last sampled token (the
end-of-turn token, index ``length − 1``) is not yet in the cache (the decode loop feeds a
token one step after sampling it). ``extend`` writes the chunk ``[that token] + observation``
at indices ``length − 1 ..``: its queries attend the slot's prompt, the sample's cached
trajectory and the chunk itself (causally), its K/V goes into the sample's suffix cache in
place, and the next model token is drawn from the chunk's last logits with the uniform of its
trajectory index, so sampling does not depend on when (or in which batch) the chunk arrived.
The trajectory's K/V lives on the sample's pages of the response pool (``pages``).

Nothing of the history is recomputed: the cost is that of the chunk's tokens attending a
cached context (an incremental prefill) read up to a live-page bucket (``live``: a power of
two of pages covering the rows' trajectories so far, as the decode reads), so it follows the
trajectories' lengths rather than the budget R.

Mixture of experts: the chunk's first token is the model's (the turn's last sampled token),
fed here rather than by a decode step, so the experts every MoE layer chooses for it are
written into ``DecodeState.routing`` at its index, as ``decode`` writes those of the tokens
it feeds; the observation tokens' records are -1 (router replay routes them by the router,
like prompt tokens).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rl_jax.models import transformer as tx
from rl_jax.models.config import ModelConfig
from rl_jax.rollout import pages, sampling
from rl_jax.rollout.kv_cache import (RUNNING, TRACE_COUNTS, DecodeState, constrain_state,
                                     mesh_context, record, state_shards)
from rl_jax.rollout.prefill import Resume, run_trunk

__all__ = ["Extension", "extend", "prefill_tail"]


class Extension(NamedTuple):
  """Chunks appended to samples' trajectories (host arrays; padding rows have slot >= G).

  Attributes:
    slot, sample: int32 [Be] the row's slot and sample index within the slot.
    start: int32 [Be] trajectory index of the chunk's first token (the sample's
      ``length − 1``: its last sampled token, not yet cached).
    tokens: int32 [Be,C] the chunk, right-padded: ``[tokens[start]] + observation ids``.
    count: int32 [Be] valid chunk tokens (>= 1).
    budget: int32 [Be] the sample's new length limit (end of its next turn).
  """

  slot: Any
  sample: Any
  start: Any
  tokens: Any
  count: Any
  budget: Any


def _context(state: DecodeState, slot, sample, start, nb: int):
  """Per-row cached context, the prompt then the first ``nb`` pages of the trajectory:
  (k, v) [L,Be,P+nb·S,K,H], valid [Be,P+nb·S] (trajectory positions below ``start``)."""
  P = state.prefix_v[0].shape[2]
  table = state.pages[slot, sample][:, :nb]  # [Be,nb]
  R = nb * state.suffix_v[0].shape[2]
  # keys are stored length-last ([Be,K,H,len]), values [Be,K,len,H]
  suffix = [pages.contiguous(k, v, table) for k, v in zip(state.suffix_k, state.suffix_v)]
  join = lambda pre, suf, axis: jnp.stack([
      jnp.moveaxis(jnp.concatenate([p[slot], s], axis=axis), axis, 1)
      for p, s in zip(pre, suf)])
  pvalid = jnp.arange(P)[None, :] < state.prefix_len[slot][:, None]
  svalid = jnp.arange(R)[None, :] < start[:, None]
  return (join(state.prefix_k, [s[0] for s in suffix], 3),
          join(state.prefix_v, [s[1] for s in suffix], 2),
          jnp.concatenate([pvalid, svalid], axis=1))


@functools.partial(jax.jit, static_argnames=("cfg", "filtered", "ctx", "live"),
                   donate_argnames=("state",))
def extend(cfg: ModelConfig, params, state: DecodeState, ext: Extension, sp, version,
           filtered: bool, ctx=None, live: int | None = None) -> tuple[DecodeState, jax.Array]:
  """Incremental prefill of chunks onto samples' caches, then one sampled token per row.

  Args:
    params: model parameters (jit argument). state: DecodeState (donated). ext: Extension.
    sp: SamplingParams. version: int32 policy version recorded for the sampled tokens.
    filtered: static; top-k/top-p active.
    live: static; the chunks attend the first ``live`` pages of their rows' trajectories
      (a bucket covering every row's ``start``, so the work follows the trajectories'
      lengths, not the budget R); None: every entry (NP).
  Returns:
    (state, logits float32 [Be,V] of each chunk's last token). Each listed sample's
    trajectory holds the chunk at ``start ..`` (log-prob 0, version -1 on the observation
    tokens), then the sampled token; ``length = start + count + 1``, ``budget`` is set and
    the reason is RUNNING unless the new token already ends the turn. Mixture-of-experts
    models: the chunk's expert records as the module docstring says.
  """
  TRACE_COUNTS["extend"] += 1
  with mesh_context(ctx):
    Be, C = ext.tokens.shape
    G = state.active.shape[0]
    R = state.tokens.shape[-1]
    slot = jnp.minimum(ext.slot, G - 1)  # padding rows compute on slot G-1, dropped below
    j = jnp.arange(C, dtype=jnp.int32)
    pos = state.prefix_len[slot][:, None] + ext.start[:, None] + j
    cvalid = j[None, :] < ext.count[:, None]
    bmask = (j[:, None] >= j[None, :])[None] & cvalid[:, None, :]
    moe = state.routing is not None
    nb = state.pages.shape[-1] if live is None else live
    h, ck, cv, *ids = run_trunk(cfg, params, ext.tokens, pos, Be, 1, bmask[:, None],
                                prefix=_context(state, slot, ext.sample, ext.start, nb),
                                return_routing=moe)
    last = jnp.take_along_axis(h, (ext.count - 1)[:, None, None], axis=1)[:, 0]
    logits = tx.logits_from_hidden(cfg, params, last)  # [Be,V]

    # chunk K/V onto the rows' pages at start + j (invalid tokens and padding rows dropped)
    M, NP = state.pages.shape[1:]
    S = state.suffix_v[0].shape[2]
    count = jnp.where(ext.slot < G, ext.count, 0)
    need = pages.rows_need(ext.slot, ext.sample, ext.start, count, G, M, NP, S)
    table, refs = pages.allocate(state.pages, state.refs, need, state_shards(state)[1])
    index = ext.start[:, None] + j
    written = [pages.write_rows(k, v, table, ext.slot, ext.sample, index, cvalid,
                                ck[l, :, 0], cv[l, :, 0])
               for l, (k, v) in enumerate(zip(state.suffix_k, state.suffix_v))]

    # the rows' token records: chunk written, then the sampled token appended by ``record``
    r = jnp.arange(R, dtype=jnp.int32)
    in_chunk = (r[None] >= ext.start[:, None]) & (r[None] < (ext.start + ext.count)[:, None])
    src = jnp.clip(r[None] - ext.start[:, None], 0, C - 1)
    old = lambda a: a[slot, ext.sample]
    obs = in_chunk & (r[None] > ext.start[:, None])  # the chunk after the sampled token
    toks = jnp.where(in_chunk, jnp.take_along_axis(ext.tokens, src, axis=1), old(state.tokens))
    sub = DecodeState(None, None, None, None, None, toks[:, None],
                      jnp.where(obs, 0.0, old(state.logprobs))[:, None],
                      jnp.where(obs, -1, old(state.versions))[:, None],
                      (ext.start + ext.count)[:, None], ext.budget[:, None],
                      jnp.full((Be, 1), RUNNING, jnp.int32), None, None, None, None,
                      skip=old(state.skip)[:, None])
    stream = state.stream[slot, ext.sample]
    uniforms = lambda: sampling.token_uniforms(stream, ext.start + ext.count - old(state.skip))
    tok, lp = sampling.sample_logits(uniforms, logits, sp, filtered)
    sub = record(sub, tok[:, None], lp[:, None], jnp.ones((Be, 1), bool), version, sp)

    put = lambda a, u: a.at[ext.slot, ext.sample].set(u[:, 0].astype(a.dtype), mode="drop")
    new = state._replace(
        suffix_k=tuple(w[0] for w in written), suffix_v=tuple(w[1] for w in written),
        pages=table, refs=refs,
        tokens=put(state.tokens, sub.tokens), logprobs=put(state.logprobs, sub.logprobs),
        versions=put(state.versions, sub.versions), length=put(state.length, sub.length),
        budget=put(state.budget, sub.budget), reason=put(state.reason, sub.reason))
    if moe:
      new = new._replace(routing=_chunk_routing(state.routing, ext, ids[0]))
    return constrain_state(new), logits


def _chunk_routing(routing, ext: Extension, ids):
  """The rows' expert records [G,M,R,Y,X] with the chunk's: the first (model) token's
  experts ``ids`` [Y,Be,C,X] at index ``start``, -1 at the observation tokens' indices
  (padding rows and tokens dropped)."""
  Be, C = ext.tokens.shape
  R = routing.shape[2]
  j = jnp.arange(C, dtype=jnp.int32)
  chunk = jnp.moveaxis(ids.astype(jnp.int32), 0, 2)  # [Be,C,Y,X]
  chunk = jnp.where((j == 0)[None, :, None, None], chunk, -1)
  index = jnp.where(j[None, :] < ext.count[:, None], ext.start[:, None] + j, R)
  at = (jnp.asarray(ext.slot)[:, None], jnp.asarray(ext.sample)[:, None], index)
  return routing.at[at].set(chunk, mode="drop")


@functools.partial(jax.jit, static_argnames=("cfg", "ctx", "live"),
                   donate_argnames=("state",))
def prefill_tail(cfg: ModelConfig, params, state: DecodeState, res: Resume, start,
                 ctx=None, live: int | None = None) -> DecodeState:
  """Rebuild resumed samples' response K/V from index ``start`` on: the positions below it
  are on their pages already (a fork's whole pages of another sample with the same tokens
  there, ``slots.forks``), so only the rest is computed, as an incremental prefill.

  Args:
    params: model parameters (jit argument). state: DecodeState (donated).
    res: ``prefill.Resume`` whose ``tokens`` [Br,T] are each row's response tokens
      ``start .. start+T-1`` and ``length`` its whole length (the last token is fed by the
      next decode step, so K/V is built up to index ``length − 2``).
    start: int32 [Br] the positions each row holds on its pages.
    live: static; the block attends the first ``live`` pages of each row (a bucket covering
      every row's ``start``); None: every entry (NP).
  Returns:
    Updated DecodeState: the block's K/V on the rows' pages at ``start ..`` (pages taken as
    needed). Its queries attend the slot's prompt, the sample's positions below ``start``
    and the block causally, at RoPE positions ``prefix_len + start + j``, so the K/V is that
    of ``prefill.resume`` over the whole row to float rounding.
  """
  TRACE_COUNTS["prefill_tail"] += 1
  with mesh_context(ctx):
    Br, T = res.tokens.shape
    G = state.active.shape[0]
    slot = jnp.minimum(res.slot, G - 1)  # padding rows compute on slot G-1, dropped below
    j = jnp.arange(T, dtype=jnp.int32)
    plen = state.prefix_len[slot]
    P = state.prefix_v[0].shape[2]
    M, NP = state.pages.shape[1:]
    S = state.suffix_v[0].shape[2]
    pos = plen[:, None] + start[:, None] + j
    count = jnp.where(res.slot < G, res.length - 1 - start, 0)
    valid = j[None, :] < count[:, None]
    bmask = (j[:, None] >= j[None, :])[None] & valid[:, None, :]
    # keys of the context: the prompt at 0 .. P-1, response index r at prefix_len + r
    nb = NP if live is None else live
    key_pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(P), (Br, P)),
                               plen[:, None] + jnp.arange(nb * S)[None, :]], axis=1)
    _, ck, cv = run_trunk(cfg, params, res.tokens, pos, Br, 1, bmask[:, None],
                          prefix=_context(state, slot, res.sample, start, nb),
                          block_delta=(j[:, None] - j[None, :])[None, None],
                          prefix_delta=(pos[:, :, None] - key_pos[:, None, :])[:, None])
    need = pages.rows_need(res.slot, res.sample, start, count, G, M, NP, S)
    table, refs = pages.allocate(state.pages, state.refs, need, state_shards(state)[1])
    index = start[:, None] + j
    written = [pages.write_rows(k, v, table, res.slot, res.sample, index, valid,
                                ck[l, :, 0], cv[l, :, 0])
               for l, (k, v) in enumerate(zip(state.suffix_k, state.suffix_v))]
    return constrain_state(state._replace(suffix_k=tuple(w[0] for w in written),
                                          suffix_v=tuple(w[1] for w in written),
                                          pages=table, refs=refs))
