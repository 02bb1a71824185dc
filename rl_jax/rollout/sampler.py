"""Jitted KV-cache sampler over group slots with a shared (prompt-once) prefix cache.

Axis letters (model legend plus): G group slots, M samples per group, P prefix (prompt)
cache length, R response length (suffix cache), T query block length, L layers,
K kv heads, Q query heads per kv head, H head dim, V vocab.

Layout. Each slot g holds one prompt, prefilled once into the prefix cache
``prefix_k/v`` (L arrays [G,K,P,H], one per layer), and M samples that keep only their own
response K/V in the suffix cache ``suffix_k/v`` (L arrays [G,M,K,R,H]). One array per layer
and kv heads before length let the decode step read the caches in place: no per-step slice
or transpose copies. Prompt token t has RoPE position t, response token j of every sample
position ``prefix_len + j`` (the positions of the unpacked sequence, so log-probs equal
``models.forward`` teacher forcing). The replicated layout is the same code with M = 1 and
the prompt repeated in N slots.

Attention of a response query is exact softmax attention over two key sets: the group's
shared prefix (keys s < prefix_len, stored once) and the sample's own suffix (r <= its fill).
Prefill of resumed responses combines the prefix and the causal block as two partial
softmaxes with a log-sum-exp merge (``merge_partials``); a decode step puts both score sets
under one softmax (``decode_attention``), the same result with fewer passes.

Entry points: ``init_state``; ``admit`` (prefill prompts into free slots, first tokens);
``resume`` (rebuild the response K/V of resumed partial samples); ``decode`` (the
``while_loop``). Shapes are bucketed by the engine, so each compiles a few times at most.

Every sampled token is drawn from a uniform that depends only on (request id, sample id,
token index) (``sampling.stream_words`` once per sample at admission, then
``sampling.token_uniforms``), so results do not depend on batching, slots or the mesh.

Sharding: caches carry logical axes (``CACHE_AXES``): slots over ``batch`` (data/fsdp), kv
heads over ``act_kv_heads`` (tensor) and cache length over ``kv_length`` (sequence).

References: Kwon et al. 2023, "Efficient Memory Management for LLM Serving with
PagedAttention" (prefix sharing); Milakov & Gimelshein 2018, "Online normalizer calculation
for softmax" (log-sum-exp merge); DualKV (shared-prompt attention for RL, 2025).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import sharding
from rl_jax.models import transformer as tx
from rl_jax.models.config import ModelConfig
from rl_jax.rollout import sampling

# Number of times each jitted entry point was traced (a retrace means a recompile).
TRACE_COUNTS: collections.Counter = collections.Counter()

# finish-reason codes stored in DecodeState.reason
RUNNING, EOS, STOP, LENGTH = 0, 1, 2, 3
REASON_NAMES = {RUNNING: "running", EOS: "eos", STOP: "stop", LENGTH: "length"}


class DecodeState(NamedTuple):
  """Device state of all slots (a pytree; every field has a logical-axes entry).

  Attributes:
    prefix_k, prefix_v: tuples of L arrays [G,K,P,H], prompt K/V, one copy per slot.
    prefix_len: int32 [G] prompt length of each slot.
    suffix_k, suffix_v: tuples of L arrays [G,M,K,R,H], each sample's own response K/V.
    tokens: int32 [G,M,R] response tokens (index j = j-th generated token).
    logprobs: float32 [G,M,R] behaviour log-prob of each token.
    versions: int32 [G,M,R] policy version that sampled each token.
    length: int32 [G,M] tokens generated so far (the last one is not yet in the cache).
    budget: int32 [G,M] maximum response length of each sample.
    reason: int32 [G,M] RUNNING, EOS, STOP or LENGTH.
    active: bool [G] slot holds a group.
    request_id: int32 [G]; sample_id: int32 [G,M] (PRNG stream identifiers).
    stream: uint32 [G,M,2] key words of each sample's random stream.
  """

  prefix_k: jax.Array
  prefix_v: jax.Array
  prefix_len: jax.Array
  suffix_k: jax.Array
  suffix_v: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  versions: jax.Array
  length: jax.Array
  budget: jax.Array
  reason: jax.Array
  active: jax.Array
  request_id: jax.Array
  sample_id: jax.Array
  stream: jax.Array


CACHE_AXES = DecodeState(
    prefix_k=("batch", "act_kv_heads", "kv_length", None),  # each layer's array
    prefix_v=("batch", "act_kv_heads", "kv_length", None),
    prefix_len=("batch",),
    suffix_k=("batch", None, "act_kv_heads", "kv_length", None),
    suffix_v=("batch", None, "act_kv_heads", "kv_length", None),
    tokens=("batch", None, None),
    logprobs=("batch", None, None),
    versions=("batch", None, None),
    length=("batch", None),
    budget=("batch", None),
    reason=("batch", None),
    active=("batch",),
    request_id=("batch",),
    sample_id=("batch", None),
    stream=("batch", None, None),
)


def _context(ctx):
  return sharding.use(*ctx) if ctx is not None else contextlib.nullcontext()


def _constrain(x, axes):
  if isinstance(x, tuple):  # per-layer caches
    return tuple(sharding.constrain(c, axes) for c in x)
  return sharding.constrain(x, axes)


def _constrain_state(state: DecodeState) -> DecodeState:
  return DecodeState(*[_constrain(x, a) for x, a in zip(state, CACHE_AXES)])


def kv_cache_bytes(cfg: ModelConfig, groups: int, samples: int, prompt_len: int,
                   response_len: int, prompt_once: bool = True) -> int:
  """Bytes of K and V held for ``groups`` prompts with ``samples`` responses each.

  Prompt-once keeps ``G·P + G·M·R`` token positions, replicated ``G·M·(P + R)``.
  """
  per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
  if prompt_once:
    positions = groups * prompt_len + groups * samples * response_len
  else:
    positions = groups * samples * (prompt_len + response_len)
  return int(per_token * positions)


# ------------------------------------------------------------------------------ attention
def _partial(scores: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Softmax of masked scores [..., S] over its own keys, and their log-sum-exp [...]."""
  scores = jnp.where(mask, scores, -jnp.inf)
  m = jnp.max(scores, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(scores - m), 0.0)
  total = jnp.sum(p, axis=-1)
  lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + m[..., 0], -jnp.inf)
  return p / jnp.where(total > 0, total, 1.0)[..., None], lse


def merge_partials(outs: list[jax.Array], lses: list[jax.Array]) -> jax.Array:
  """Exact softmax attention from partial results over disjoint key sets.

  ``lse = logaddexp(lse_1, ..., lse_n)``, ``out = sum_i exp(lse_i - lse) · out_i``.

  Args:
    outs: each [G,M,K,Q,T,H] normalised over its own keys; lses: each [G,M,K,Q,T].
  Returns:
    [G,M,K,Q,T,H].
  """
  total = functools.reduce(jnp.logaddexp, lses)
  safe = jnp.where(jnp.isfinite(total), total, 0.0)
  return sum(jnp.exp(l - safe)[..., None] * o for o, l in zip(outs, lses))


def grouped_attention(q, block_k, block_v, block_mask, prefix=None):
  """Attention of grouped queries (prefill) over a shared prefix and their own block.

  Args:
    q: [G,M,T,N,H]. block_k, block_v: [G,M,T,K,H] K/V of the queries' own tokens;
      block_mask: bool [G,M,T,T] (query t may see block key s).
    prefix: optional (k [G,P,K,H], v [G,P,K,H], valid bool [G,P]) shared by the M samples.
  Returns:
    [G,M,T,N,H] in q's dtype.
  """
  G, M, T, N, H = q.shape
  K = block_k.shape[3]
  qg = q.reshape(G, M, T, K, N // K, H).astype(jnp.float32) / np.float32(np.sqrt(H))
  f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
  outs, lses = [], []
  s = f32("gmtkqh,gmskh->gmkqts", qg, block_k)
  p, l = _partial(s, block_mask[:, :, None, None])
  outs.append(f32("gmkqts,gmskh->gmkqth", p, block_v)); lses.append(l)
  if prefix is not None:
    pk, pv, pvalid = prefix
    s = f32("gmtkqh,gpkh->gmkqtp", qg, pk)
    p, l = _partial(s, pvalid[:, None, None, None, None, :])
    outs.append(f32("gmkqtp,gpkh->gmkqth", p, pv)); lses.append(l)
  out = merge_partials(outs, lses)  # [G,M,K,Q,T,H]
  return jnp.moveaxis(out, 4, 2).reshape(G, M, T, N, H).astype(q.dtype)


def decode_attention(q, prefix_k, prefix_v, prefix_valid, suffix_k, suffix_v, suffix_valid):
  """One query per sample over its group's shared prefix and its own suffix cache.

  The current token's K/V must already be in the suffix cache (``suffix_valid`` includes it).
  The prefix scores [.., P] (prefix K/V read once per group) and the sample's suffix scores
  [.., R] share one softmax; this equals the log-sum-exp merge of the two partial softmaxes
  (``merge_partials``) with fewer passes, which matters in the per-token loop.

  Args:
    q: [G,M,N,H]. prefix_k, prefix_v: [G,K,P,H]; prefix_valid: bool [G,P].
    suffix_k, suffix_v: [G,M,K,R,H]; suffix_valid: bool [G,M,R].
  Returns:
    [G,M,N,H] in q's dtype.
  """
  G, M, N, H = q.shape
  K, P = prefix_k.shape[1], prefix_k.shape[2]
  Q = N // K
  qg = q.reshape(G, M, K, Q, H).astype(jnp.float32) / np.float32(np.sqrt(H))
  f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
  # batch dims leading in both operands: plain batched matmuls over (g,k) and (g,m,k)
  q_pre = jnp.swapaxes(qg, 1, 2).reshape(G, K, M * Q, H)
  s_pre = f32("gkah,gkph->gkap", q_pre, prefix_k).reshape(G, K, M, Q, P)
  s_pre = jnp.swapaxes(s_pre, 1, 2)  # [G,M,K,Q,P]
  s_suf = f32("gmkqh,gmkrh->gmkqr", qg, suffix_k)
  valid = jnp.concatenate([jnp.broadcast_to(prefix_valid[:, None, :], (G, M, P)),
                           suffix_valid], axis=-1)[:, :, None, None, :]
  scores = jnp.where(valid, jnp.concatenate([s_pre, s_suf], axis=-1), -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)  # at least the current token is valid
  p_pre = jnp.swapaxes(probs[..., :P], 1, 2).reshape(G, K, M * Q, P)
  o_pre = jnp.swapaxes(f32("gkap,gkph->gkah", p_pre, prefix_v).reshape(G, K, M, Q, H), 1, 2)
  out = o_pre + f32("gmkqr,gmkrh->gmkqh", probs[..., P:], suffix_v)
  return out.reshape(G, M, N, H).astype(q.dtype)


def _run_trunk(cfg, params, tokens, positions, G, M, block_mask, prefix=None):
  """Prefill trunk over tokens [G·M,T] with grouped attention.

  ``prefix`` = (k [L,G,P,K,H], v [L,G,P,K,H], valid bool [G,P]) is scanned with the layers.
  Returns hidden [G·M,T,D] and the block's new K/V, each [L,G,M,T,K,H].
  """
  T = tokens.shape[1]
  pre_kv = None if prefix is None else (prefix[0], prefix[1])

  def attend(q, k, v, pre):
    split = lambda a: a.reshape(G, M, T, *a.shape[2:])
    out = grouped_attention(split(q), split(k), split(v), block_mask,
                            prefix=None if pre is None else (pre[0], pre[1], prefix[2]))
    return out.reshape(G * M, T, *out.shape[3:]), (split(k), split(v))

  x = tx.embed(cfg, params, tokens)
  h, (k_new, v_new) = tx.trunk(cfg, params, x, positions, attend, pre_kv)
  return h, k_new, v_new


# ------------------------------------------------------------------------------ bookkeeping
def _record(state: DecodeState, tok, lp, take, version, sp: sampling.SamplingParams):
  """Append token ``tok`` [G,M] (log-prob ``lp``) to rows where ``take``; update reasons."""
  R = state.tokens.shape[-1]
  idx = state.length
  hot = (jnp.arange(R) == idx[..., None]) & take[..., None]
  tokens = jnp.where(hot, tok[..., None], state.tokens)
  logprobs = jnp.where(hot, lp[..., None], state.logprobs)
  versions = jnp.where(hot, version, state.versions)
  length = state.length + take.astype(jnp.int32)
  is_eos = jnp.any(tok[..., None] == sp.eos_ids, axis=-1)
  W = sp.stop_seqs.shape[-1]
  window_idx = length[..., None] - W + jnp.arange(W)  # [G,M,W]
  window = jnp.take_along_axis(tokens, jnp.clip(window_idx, 0, R - 1), axis=-1)
  match = (sp.stop_seqs[None, None] < 0) | (window[:, :, None, :] == sp.stop_seqs[None, None])
  is_stop = jnp.any(jnp.all(match, axis=-1) & (sp.stop_lens > 0)
                    & (sp.stop_lens <= length[..., None]), axis=-1)
  reason = jnp.where(is_eos, EOS, jnp.where(is_stop, STOP, jnp.where(
      length >= state.budget, LENGTH, RUNNING)))
  reason = jnp.where(take, reason, state.reason)
  return state._replace(tokens=tokens, logprobs=logprobs, versions=versions, length=length,
                        reason=reason)


# ------------------------------------------------------------------------------ entry points
def _init_state(cfg: ModelConfig, G: int, M: int, P: int, R: int) -> DecodeState:
  L, K, H = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  dt = jnp.dtype(cfg.dtype)
  layers = lambda shape: tuple(jnp.zeros(shape, dt) for _ in range(L))
  return DecodeState(
      prefix_k=layers((G, K, P, H)), prefix_v=layers((G, K, P, H)),
      prefix_len=jnp.ones((G,), jnp.int32),
      suffix_k=layers((G, M, K, R, H)), suffix_v=layers((G, M, K, R, H)),
      tokens=jnp.zeros((G, M, R), jnp.int32), logprobs=jnp.zeros((G, M, R), jnp.float32),
      versions=jnp.full((G, M, R), -1, jnp.int32), length=jnp.zeros((G, M), jnp.int32),
      budget=jnp.zeros((G, M), jnp.int32), reason=jnp.full((G, M), LENGTH, jnp.int32),
      active=jnp.zeros((G,), bool), request_id=jnp.zeros((G,), jnp.int32),
      sample_id=jnp.zeros((G, M), jnp.int32), stream=jnp.zeros((G, M, 2), jnp.uint32))


@functools.partial(jax.jit, static_argnames=("cfg", "G", "M", "P", "R", "ctx"))
def init_state(cfg: ModelConfig, G: int, M: int, P: int, R: int, ctx=None) -> DecodeState:
  """Empty state for G slots of M samples, prefix length P, response length R."""
  TRACE_COUNTS["init_state"] += 1
  with _context(ctx):
    return _constrain_state(_init_state(cfg, G, M, P, R))


class Admission(NamedTuple):
  """Groups to place into slots (host arrays, Bn = admission bucket).

  Attributes:
    slots: int32 [Bn] target slot (>= G for padding rows, which are dropped).
    prompt: int32 [Bn,Pb] right-padded prompts; prompt_len: int32 [Bn].
    tokens, logprobs, versions: [Bn,M,R] tokens already generated (resumed samples).
    length: int32 [Bn,M] tokens already generated; reason: int32 [Bn,M] (RUNNING unless the
      sample already finished); budget: int32 [Bn,M] maximum response length.
    request_id: int32 [Bn]; sample_id: int32 [Bn,M].
  """

  slots: Any
  prompt: Any
  prompt_len: Any
  tokens: Any
  logprobs: Any
  versions: Any
  length: Any
  reason: Any
  budget: Any
  request_id: Any
  sample_id: Any


@functools.partial(jax.jit, static_argnames=("cfg", "filtered", "fresh", "ctx"),
                   donate_argnames=("state",))
def admit(cfg: ModelConfig, params, state: DecodeState, adm: Admission, sp, version, base_key,
          filtered: bool, fresh: bool = False, ctx=None) -> DecodeState:
  """Prefill prompts (once per group) into slots; sample first tokens of fresh samples.

  Resumed samples keep their tokens; their response K/V is rebuilt by ``resume``.

  Args:
    params: model parameters (a jit argument: new weights never recompile).
    state: DecodeState (donated). adm: Admission. sp: SamplingParams. version: int32 scalar
      policy version of tokens sampled here. base_key: typed PRNG key.
    filtered: static; top-k/top-p active.
    fresh: static; every slot is free and ``adm.slots`` is ``0, 1, ..`` then padding (>= G)
      with Bn == G, so the state's arrays are replaced instead of scattered into.
  Returns:
    Updated DecodeState. Samples with no token yet get their first token from the prompt's
    last logits; resumed samples keep their tokens (the last one becomes the next input).
  """
  TRACE_COUNTS["admit"] += 1
  with _context(ctx):
    Bn, Pb = adm.prompt.shape
    M = adm.length.shape[1]
    pos = jnp.broadcast_to(jnp.arange(Pb, dtype=jnp.int32), (Bn, Pb))
    pvalid = pos < adm.prompt_len[:, None]
    causal = tx.causal_mask(pos, pos, pvalid)
    h, pk, pv = _run_trunk(cfg, params, adm.prompt, pos, Bn, 1, causal[:, None])
    pk, pv = pk[:, :, 0], pv[:, :, 0]  # [L,Bn,Pb,K,H]
    last = jnp.take_along_axis(h, (adm.prompt_len - 1)[:, None, None], axis=1)[:, 0]
    logits = tx.logits_from_hidden(cfg, params, last)  # [Bn,V]

    sub = DecodeState(pk, pv, adm.prompt_len, None, None, jnp.asarray(adm.tokens),
                      jnp.asarray(adm.logprobs), jnp.asarray(adm.versions),
                      jnp.asarray(adm.length), jnp.asarray(adm.budget),
                      jnp.asarray(adm.reason), None, adm.request_id, adm.sample_id, None)
    first = (sub.length == 0) & (sub.reason == RUNNING)
    stream = sampling.stream_words(base_key, jnp.repeat(adm.request_id, M),
                                   adm.sample_id.reshape(-1))
    uniforms = lambda: sampling.token_uniforms(stream, jnp.zeros((Bn * M,), jnp.int32))
    tok, lp = sampling.sample_logits(uniforms, jnp.repeat(logits, M, axis=0), sp, filtered)
    sub = _record(sub, tok.reshape(Bn, M), lp.reshape(Bn, M), first, version, sp)

    if fresh:  # every slot was free and slots == [0, 1, ...] + padding: replace wholesale
      put = lambda a, u, lead=0: u.astype(a.dtype)
    else:
      put = lambda a, u, lead=0: a.at[(slice(None),) * lead + (adm.slots,)].set(
          u.astype(a.dtype), mode="drop")
    Pfull = state.prefix_k[0].shape[2]
    # [L,Bn,Pb,K,H] -> cache layout [L,Bn,K,P,H]
    pad_p = lambda a: jnp.pad(jnp.swapaxes(a, 2, 3), ((0, 0),) * 3 + ((0, Pfull - Pb), (0, 0)))
    per_layer = lambda cache, u: tuple(put(c, u[l]) for l, c in enumerate(cache))
    new = state._replace(
        prefix_k=per_layer(state.prefix_k, pad_p(pk)), prefix_v=per_layer(state.prefix_v, pad_p(pv)),
        prefix_len=put(state.prefix_len, adm.prompt_len),
        tokens=put(state.tokens, sub.tokens), logprobs=put(state.logprobs, sub.logprobs),
        versions=put(state.versions, sub.versions), length=put(state.length, sub.length),
        budget=put(state.budget, sub.budget), reason=put(state.reason, sub.reason),
        active=put(state.active, adm.slots < state.active.shape[0]),
        request_id=put(state.request_id, adm.request_id),
        sample_id=put(state.sample_id, adm.sample_id),
        stream=put(state.stream, stream.reshape(Bn, M, 2)))
    return _constrain_state(new)


class Resume(NamedTuple):
  """Resumed, still running samples whose response K/V is rebuilt (host arrays).

  Attributes (Br = bucket; padding rows have slot >= G and are dropped):
    slot: int32 [Br]; sample: int32 [Br] index within the slot.
    tokens: int32 [Br,S] the sample's tokens so far (the last one is fed by the next decode
      step, so K/V is built for the first ``length − 1``); length: int32 [Br].
  """

  slot: Any
  sample: Any
  tokens: Any
  length: Any


@functools.partial(jax.jit, static_argnames=("cfg", "ctx"), donate_argnames=("state",))
def resume(cfg: ModelConfig, params, state: DecodeState, res: Resume, ctx=None) -> DecodeState:
  """Re-prefill the response K/V of resumed samples (after ``admit`` placed their prompts).

  Each listed sample's tokens attend the prefix K/V of its slot and their own causal past;
  the K/V is written into the sample's rows of the suffix cache. Only these samples are
  computed (finished samples and fresh groups are not).

  Args:
    params: model parameters (jit argument). state: DecodeState (donated). res: Resume.
  Returns:
    Updated DecodeState.
  """
  TRACE_COUNTS["resume"] += 1
  with _context(ctx):
    Br, S = res.tokens.shape
    G = state.active.shape[0]
    slot = jnp.minimum(res.slot, G - 1)  # padding rows read slot G-1 and are dropped below
    j = jnp.arange(S, dtype=jnp.int32)
    plen = state.prefix_len[slot]
    P = state.prefix_k[0].shape[2]
    pvalid = jnp.arange(P)[None, :] < plen[:, None]
    rpos = plen[:, None] + j
    rvalid = j[None, :] < (res.length - 1)[:, None]  # the last token is fed next
    bmask = (j[:, None] >= j[None, :])[None] & rvalid[:, None, :]
    # prefix of each row's slot, [L,Br,K,P,H] -> [L,Br,P,K,H] for grouped_attention
    gather = lambda cache: jnp.swapaxes(jnp.stack([c[slot] for c in cache]), 2, 3)
    _, rk, rv = _run_trunk(cfg, params, res.tokens, rpos, Br, 1, bmask[:, None],
                           prefix=(gather(state.prefix_k), gather(state.prefix_v), pvalid))
    place = lambda cache, u: tuple(
        c.at[res.slot, res.sample, :, :S].set(jnp.swapaxes(u[l, :, 0], 1, 2).astype(c.dtype),
                                              mode="drop")
        for l, c in enumerate(cache))
    new = state._replace(suffix_k=place(state.suffix_k, rk), suffix_v=place(state.suffix_v, rv))
    return _constrain_state(new)


def decode_step(cfg: ModelConfig, params, layers, state: DecodeState, sp, version,
                filtered: bool) -> DecodeState:
  """Feed every running sample's last token, append one sampled token.

  Per layer, the fed token's K/V is scattered into the sample's suffix cache at its fill
  position (in place), then the query attends its prefix and suffix (``decode_attention``).

  Args / Returns: see ``decode``; ``layers`` = ``tx.unstack_layers(params)``. One step.
  """
  G, M, R = state.tokens.shape
  P = state.prefix_k[0].shape[2]
  take = (state.reason == RUNNING) & state.active[:, None]
  cur = jnp.maximum(state.length - 1, 0)  # index of the token fed now
  feed = jnp.take_along_axis(state.tokens, cur[..., None], axis=-1)[..., 0]
  pos = (state.prefix_len[:, None] + cur).reshape(G * M, 1)
  pvalid = jnp.arange(P)[None, :] < state.prefix_len[:, None]
  svalid = jnp.arange(R)[None, None, :] <= cur[..., None]
  gi = jnp.broadcast_to(jnp.arange(G)[:, None], (G, M))
  mi = jnp.broadcast_to(jnp.arange(M)[None, :], (G, M))
  caches = {"sk": list(state.suffix_k), "sv": list(state.suffix_v)}

  def attend(q, k, v, layer):
    l = layer
    put = lambda c, x: c.at[gi, mi, :, cur].set(x.reshape(G, M, *x.shape[2:]).astype(c.dtype))
    caches["sk"][l], caches["sv"][l] = put(caches["sk"][l], k), put(caches["sv"][l], v)
    out = decode_attention(q.reshape(G, M, *q.shape[2:]), state.prefix_k[l], state.prefix_v[l],
                           pvalid, caches["sk"][l], caches["sv"][l], svalid)
    return out.reshape(G * M, 1, *out.shape[2:]), layer

  x = tx.embed(cfg, params, feed.reshape(G * M, 1))
  h, _ = tx.trunk_unrolled(cfg, params, layers, x, pos, attend, list(range(len(layers))))
  logits = tx.logits_from_hidden(cfg, params, h[:, 0])  # [G·M,V]
  uniforms = lambda: sampling.token_uniforms(state.stream.reshape(G * M, 2),
                                             state.length.reshape(-1))
  tok, lp = sampling.sample_logits(uniforms, logits, sp, filtered)
  state = state._replace(suffix_k=tuple(caches["sk"]), suffix_v=tuple(caches["sv"]))
  return _constrain_state(_record(state, tok.reshape(G, M), lp.reshape(G, M), take, version, sp))


@functools.partial(jax.jit, static_argnames=("cfg", "filtered", "ctx"),
                   donate_argnames=("state",))
def decode(cfg: ModelConfig, params, state: DecodeState, sp, version, max_steps,
           min_finished, filtered: bool, ctx=None) -> tuple[DecodeState, jax.Array]:
  """Decode inside one ``lax.while_loop`` until enough groups finish.

  Stops when no sample is running, after ``max_steps`` steps, or once at least
  ``min_finished`` active slots have all their samples finished (so the caller can refill
  them: continuous batching).

  Args:
    params: model parameters (jit argument). state: DecodeState (donated).
    sp: SamplingParams. version: int32 policy version recorded for new tokens.
    max_steps, min_finished: int32 scalars (traced).
    filtered: static; top-k/top-p active.
  Returns:
    (state, steps run).
  """
  TRACE_COUNTS["decode"] += 1
  with _context(ctx):

    def finished(s):
      return jnp.sum(s.active & jnp.all(s.reason != RUNNING, axis=1))

    def cond(carry):
      s, step = carry
      running = jnp.any((s.reason == RUNNING) & s.active[:, None])
      return running & (step < max_steps) & (finished(s) < min_finished)

    layers = tx.unstack_layers(params)  # sliced once per call, not per step

    def body(carry):
      s, step = carry
      return decode_step(cfg, params, layers, s, sp, version, filtered), step + 1

    return jax.lax.while_loop(cond, body, (_constrain_state(state), jnp.int32(0)))


@functools.partial(jax.jit, static_argnames=("dtype",))
def cast_params(params, dtype: str):
  """Jitted cast of the trainer's parameters to the sampler's storage dtype."""
  return jax.tree.map(lambda x: x.astype(dtype), params)
