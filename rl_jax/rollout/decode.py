"""Decode over the prompt-once cache: one token per running sample per step, in a
``lax.while_loop`` that runs until enough groups finish (continuous batching).

Axis letters: the legend of ``rl_jax/__init__.py`` (G group slots, M samples per
slot, P prefix cache length, R response cache length, N query heads, K kv heads, J query
heads per kv head, H head dim, V vocab).

A decode query attends its group's shared prefix (stored once) and its own response, read
from its first ``live`` pages of the response pool (``pages``: a power-of-two bucket
covering the longest live response, so a step's work follows the tokens generated, not the
budget; the fed token takes a page when it starts one). Both score sets share one softmax (``decode_attention``): the same result as the log-sum-exp
merge of the two partial softmaxes that prefill uses, with fewer passes, which matters in
the per-token loop.

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

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.models import transformer as tx
from rl_jax.models.config import ModelConfig
from rl_jax.rollout import pages, sampling
from rl_jax.rollout.kv_cache import (RUNNING, TRACE_COUNTS, DecodeState, constrain_state,
                                     mesh_context, record)

__all__ = ["can_step", "decode", "decode_attention", "decode_step"]


def decode_attention(q, prefix_k, prefix_v, prefix_valid, suffix_k, suffix_v, suffix_valid,
                     keys_length_last: bool = True):
  """One query per sample over its group's shared prefix and its own suffix cache.

  The current token's K/V must already be in the suffix cache (``suffix_valid`` includes it).
  The prefix scores [..,P] (prefix K/V read once per group) and the sample's suffix scores
  [..,R] share one softmax; this equals the log-sum-exp merge of the two partial softmaxes
  (``pallas_kernels.merge_partials``) with fewer passes.

  Keys are stored length-last (``kv_cache``), so both products are plain matmuls.

  Args:
    q: [G,M,N,H]. prefix_k: [G,K,H,P]; prefix_v: [G,K,P,H]; prefix_valid: bool [G,P] or
      [G,M,P]. suffix_k: [G,M,K,H,R]; suffix_v: [G,M,K,R,H]; suffix_valid: bool [G,M,R].
    keys_length_last: False reads keys laid out like the values ([G,K,P,H] /
      [G,M,K,R,H]), the layout the caches had before; on CPU it is 1.5-2x slower per layer
      (``scripts/bench_decode_attention.py``'s baseline).
  Returns:
    [G,M,N,H] in q's dtype.
  """
  G, M, N, H = q.shape
  K, P = prefix_v.shape[1], prefix_v.shape[2]
  J = N // K
  qg = q.reshape(G, M, K, J, H).astype(jnp.float32) / np.float32(np.sqrt(H))
  f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
  # batch dims leading in both operands: plain batched matmuls over (g,k) and (g,m,k);
  # a = M·J rows of a kv head (a local letter)
  q_pre = jnp.swapaxes(qg, 1, 2).reshape(G, K, M * J, H)
  pre_spec, suf_spec = (("gkah,gkhp->gkap", "gmkjh,gmkhr->gmkjr") if keys_length_last else
                        ("gkah,gkph->gkap", "gmkjh,gmkrh->gmkjr"))
  s_pre = f32(pre_spec, q_pre, prefix_k).reshape(G, K, M, J, P)
  s_pre = jnp.swapaxes(s_pre, 1, 2)  # [G,M,K,J,P]
  s_suf = f32(suf_spec, qg, suffix_k)
  pre_valid = prefix_valid if prefix_valid.ndim == 3 else prefix_valid[:, None, :]
  valid = jnp.concatenate([jnp.broadcast_to(pre_valid, (G, M, P)),
                           suffix_valid], axis=-1)[:, :, None, None, :]
  scores = jnp.where(valid, jnp.concatenate([s_pre, s_suf], axis=-1), -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)  # at least the current token is valid
  p_pre = jnp.swapaxes(probs[..., :P], 1, 2).reshape(G, K, M * J, P)
  o_pre = jnp.swapaxes(f32("gkap,gkph->gkah", p_pre, prefix_v).reshape(G, K, M, J, H), 1, 2)
  out = o_pre + f32("gmkjr,gmkrh->gmkjh", probs[..., P:], suffix_v)
  return out.reshape(G, M, N, H).astype(q.dtype)


def decode_step(cfg: ModelConfig, params, layers, state: DecodeState, sp, version,
                filtered: bool, live: int | None = None, identity: bool = False) -> DecodeState:
  """Feed every running sample's last token, append one sampled token.

  The fed token (response index ``cur``) takes a page if its table entry has none
  (``pages.take_entry``); per layer its K/V is written onto that page in place, then the query
  attends its prefix and the first ``live`` pages of its response (``decode_attention`` over
  ``pages.gather_live``).

  Args / Returns: see ``decode``; ``layers`` = ``tx.unstack_layers(params, cfg)``; ``live``:
  static live-page bucket nb (None = every entry, NP); ``identity``: static, the table is
  ``init_state(identity=True)``'s, so pages are read as slices of the pool in place (no
  gather) and none is taken. One step. Every running sample's
  ``cur`` must lie below ``live·S`` and the pool must hold a page for each sample that needs
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
  if identity:
    table, free = state.pages, state.free
    page = (jnp.arange(G * M, dtype=jnp.int32).reshape(G, M) * NP
            + jnp.minimum(cur // S, NP - 1))
  else:
    table, free, page = pages.take_entry(state.pages, state.free, take, cur // S)
  page = jnp.where(take, page, -1).reshape(-1)  # rows not fed write nothing
  offset = (cur % S).reshape(-1)
  live_table = table[:, :, :nb]
  read = ((lambda k, v: pages.in_place(k, v, G, M, NP, nb)) if identity else
          (lambda k, v: pages.contiguous(k, v, live_table)))
  caches = {"sk": list(state.suffix_k), "sv": list(state.suffix_v)}

  qpos = state.prefix_len[:, None] + cur  # [G,M]

  def attend(q, k, v, layer, spec=None):
    l = layer
    caches["sk"][l], caches["sv"][l] = pages.write(caches["sk"][l], caches["sv"][l], page,
                                                   offset, k[:, 0], v[:, 0])
    sk, sv_ = read(caches["sk"][l], caches["sv"][l])
    pv, sv = pvalid, svalid
    if spec is not None:
      pv = tx.window_mask(spec, pvalid[:, None, :], qpos[..., None] - jnp.arange(P))
      sv = tx.window_mask(spec, svalid, cur[..., None] - jnp.arange(nb * S))
    out = decode_attention(q.reshape(G, M, *q.shape[2:]), state.prefix_k[l], state.prefix_v[l],
                           pv, sk, sv_, sv)
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
                                             state.length.reshape(-1))
  tok, lp = sampling.sample_logits(uniforms, logits, sp, filtered)
  state = state._replace(suffix_k=tuple(caches["sk"]), suffix_v=tuple(caches["sv"]),
                         pages=table, free=free)
  return constrain_state(record(state, tok.reshape(G, M), lp.reshape(G, M), take, version, sp))


def can_step(state: DecodeState, live: int) -> jax.Array:
  """Whether ``decode_step(.., live)`` can run: every running sample's fed index lies in
  the first ``live`` pages and the pool holds a page for every sample whose fed index
  starts a page it has none for."""
  S = state.suffix_v[0].shape[2]
  take = (state.reason == RUNNING) & state.active[:, None]
  cur = jnp.maximum(state.length - 1, 0)
  inside = jnp.all(~take | (cur < live * S))
  entry = jnp.minimum(cur // S, state.pages.shape[-1] - 1)
  has = jnp.take_along_axis(state.pages, entry[..., None], axis=-1)[..., 0] >= 0
  return inside & (jnp.sum(take & ~has) <= jnp.sum(state.free))


@functools.partial(jax.jit, static_argnames=("cfg", "filtered", "ctx", "live", "identity"),
                   donate_argnames=("state",))
def decode(cfg: ModelConfig, params, state: DecodeState, sp, version, max_steps,
           min_finished, filtered: bool, ctx=None, live: int | None = None,
           identity: bool = False) -> tuple[DecodeState, jax.Array]:
  """Decode inside one ``lax.while_loop`` until enough groups finish.

  Stops when no sample is running, after ``max_steps`` steps, once at least
  ``min_finished`` active slots have all their samples finished (so the caller can refill
  them: continuous batching), or when the next step cannot run (``can_step``: a sample
  reached the end of the ``live`` pages the program reads, or the pool is out of pages;
  the caller then picks a larger bucket, grows the pool or preempts).

  Args:
    params: model parameters (jit argument). state: DecodeState (donated).
    sp: SamplingParams. version: int32 policy version recorded for new tokens.
    max_steps, min_finished: int32 scalars (traced).
    filtered: static; top-k/top-p active. live: static live-page bucket (None = all NP).
    identity: static; the state's table is ``init_state(identity=True)``'s (``decode_step``).
  Returns:
    (state, steps run).
  """
  TRACE_COUNTS["decode"] += 1
  with mesh_context(ctx):

    def finished(s):
      return jnp.sum(s.active & jnp.all(s.reason != RUNNING, axis=1))

    def cond(carry):
      s, step = carry
      running = jnp.any((s.reason == RUNNING) & s.active[:, None])
      return (running & (step < max_steps) & (finished(s) < min_finished)
              & can_step(s, nb))

    layers = tx.unstack_layers(params, cfg)  # sliced once per call, not per step
    nb = state.pages.shape[-1] if live is None else live

    def body(carry):
      s, step = carry
      return decode_step(cfg, params, layers, s, sp, version, filtered, nb, identity), step + 1

    return jax.lax.while_loop(cond, body, (constrain_state(state), jnp.int32(0)))
