"""Prefill into the prompt-once cache: prompts once per group (``admit``) and the response
K/V of resumed partial samples (``resume``).

Axis letters: the legend of ``rl_jax/__init__.py`` (G group slots, M samples per
slot, T query block length, P prefix cache length, R response cache length, L layers,
N query heads, K kv heads, H head dim, V vocab). Bn and Br are the engine's admission and
resume buckets (rows), Pb the admitted prompt bucket.

Prompt token t has RoPE position t, response token j of every sample position
``prefix_len + j`` (the positions of the unpacked sequence, so log-probs equal
``models.forward`` teacher forcing). Prefill attention is ``grouped_attention``: the
two-region log-sum-exp attention of ``pallas_kernels.lse_attention`` (the block of the
queries' own tokens, plus the slot's prompt for resumed responses).

Sliding-window layers (Gemma 3): key s is visible to query t only if their positions differ
by less than the window (``models.transformer.window_mask``), in the block and in the prefix.

Every first token is drawn from a uniform that depends only on (request id, sample id,
token index) (``sampling.stream_words`` at admission), so results do not depend on batching,
slots or the mesh.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.lse_attention import two_region_attention
from rl_jax import compile_options
from rl_jax.models import transformer as tx
from rl_jax.models.config import ModelConfig
from rl_jax.rollout import pages, sampling
from rl_jax.rollout.kv_cache import (RUNNING, TRACE_COUNTS, DecodeState, constrain_state,
                                     fork_rows, mesh_context, record, state_shards)

__all__ = ["Admission", "Resume", "admit", "admit_for", "admit_with", "grouped_attention",
           "fork_written", "onto_pages", "prefill_prompts", "resume", "run_trunk"]


def grouped_attention(q, block_k, block_v, block_mask, prefix=None):
  """Attention of grouped queries (prefill) over a shared prefix and their own block.

  ``pallas_kernels.two_region_attention`` with head-major scores (the sampler's layout).

  Args:
    q: [G,M,T,N,H]. block_k, block_v: [G,M,T,K,H] K/V of the queries' own tokens;
      block_mask: bool [G,M,T,T] (query t may see block key s).
    prefix: optional (k [G,P,K,H], v [G,P,K,H], valid) shared by the M samples; valid is
      bool [G,P] (every query sees the same prefix keys) or [G,M,T,P] (per query).
  Returns:
    [G,M,T,N,H] in q's dtype.
  """
  G, M, T, N, H = q.shape
  if prefix is None:
    ctx = (None, None, None)
  else:
    valid = prefix[2] if prefix[2].ndim == 4 else prefix[2][:, None, None, :]
    ctx = (prefix[0], prefix[1], valid)
  out, _ = two_region_attention(q, block_k, block_v, block_mask, *ctx, layout="head_major")
  return out.reshape(G, M, T, N, H).astype(q.dtype)


def run_trunk(cfg, params, tokens, positions, G, M, block_mask, prefix=None, block_delta=None,
              prefix_delta=None, return_routing: bool = False):
  """Prefill trunk over tokens [G·M,T] with grouped attention.

  ``prefix`` = (k [L,G,P,K,H], v [L,G,P,K,H], valid bool [G,P]) is scanned with the layers.
  Models with sliding-window layers need the position differences (query minus key) of the
  block, ``block_delta`` int broadcastable to [G,M,T,T], and of the prefix, ``prefix_delta``
  int [G,M,T,P].
  Returns hidden [G·M,T,D] and the block's new K/V, each [L,G,M,T,K,H]; with
  ``return_routing`` (mixture-of-experts models) also the experts every MoE layer chose for
  each token, int32 [Y,G·M,T,X].
  """
  T = tokens.shape[1]
  pre_kv = None if prefix is None else (prefix[0], prefix[1])

  def attend(q, k, v, pre, spec=None):
    split = lambda a: a.reshape(G, M, T, *a.shape[2:])
    bmask, pvalid = block_mask, None if prefix is None else prefix[2]
    if spec is not None:
      bmask = tx.window_mask(spec, bmask, block_delta)
      if prefix is not None:
        pvalid = tx.window_mask(spec, pvalid[:, None, None, :], prefix_delta)
    out = grouped_attention(split(q), split(k), split(v), bmask,
                            prefix=None if pre is None else (pre[0], pre[1], pvalid))
    return out.reshape(G * M, T, *out.shape[3:]), (split(k), split(v))

  x = tx.embed(cfg, params, tokens)
  if return_routing:
    h, (k_new, v_new), route = tx.trunk(cfg, params, x, positions, attend, pre_kv,
                                        return_routing=True)
    return h, k_new, v_new, route.ids
  h, (k_new, v_new) = tx.trunk(cfg, params, x, positions, attend, pre_kv)
  return h, k_new, v_new


class Admission(NamedTuple):
  """Groups to place into slots (host arrays, Bn = admission bucket).

  Attributes:
    slots: int32 [Bn] target slot (>= G for padding rows, which are dropped).
    prompt: int32 [Bn,Pb] right-padded prompts; prompt_len: int32 [Bn].
    tokens, logprobs, versions: [Bn,M,R] tokens already generated (resumed samples).
    length: int32 [Bn,M] tokens already generated; reason: int32 [Bn,M] (RUNNING unless the
      sample already finished); budget: int32 [Bn,M] maximum response length.
    request_id: int32 [Bn]; sample_id: int32 [Bn,M].
    skip: int32 [Bn,M] leading response positions holding prompt ids (``DecodeState.skip``).
    onto_pages: None with the whole prompt in the slot; with the prompt on pool pages, int32
      [Bn] the sample whose pages take the prompt's ids after its first and before its last
      (M: none, or the group's samples fork them), ``prompt`` then holding whole prompts
      of which the slot keeps the first id.
    forked: None, or with ``onto_pages`` int32 [Bn,M] the positions each sample takes from
      the ``onto_pages`` sample's pages once written (``pages.fork``: whole pages shared,
      the partial last one copied; 0: none): the group's other samples, forked in the
      admission's own program.
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
  skip: Any
  onto_pages: Any = None
  forked: Any = None


_ADMIT_JIT = dict(static_argnames=("cfg", "filtered", "fresh", "ctx", "chunk", "identity"),
                  donate_argnames=("state",))


def prefill_prompts(cfg: ModelConfig, params, prompt, prompt_len, chunk: int | None = None):
  """Prompts through the trunk: each row's last prompt token's hidden state and the K/V.

  With ``chunk`` (a power of two below the bucket Pb, which it divides), the prompts go
  through in chunks of ``chunk`` tokens under ``lax.scan``: each chunk's queries attend the
  K/V of the chunks before it (written into a [Pb] buffer, read masked) and their own block
  causally, two partial softmaxes merged by log-sum-exp (``run_trunk`` with a prefix), so the
  scores held at once are [chunk, Pb] per head instead of [Pb, Pb]: long prompts prefill in
  bounded memory, one compiled chunk for any number of chunks. Equal to the whole-prompt
  pass to float rounding.

  Args:
    prompt: int32 [Bn,Pb] right-padded; prompt_len: int32 [Bn].
  Returns:
    (hidden [Bn,D] of token ``prompt_len − 1``, keys [L,Bn,Pb,K,H], values [L,Bn,Pb,K,H]).
  """
  Bn, Pb = prompt.shape
  last_of = lambda h, first: jnp.take_along_axis(
      h, jnp.clip(prompt_len - 1 - first, 0, h.shape[1] - 1)[:, None, None], axis=1)[:, 0]
  if chunk is None or chunk >= Pb:
    pos = jnp.broadcast_to(jnp.arange(Pb, dtype=jnp.int32), (Bn, Pb))
    causal = tx.causal_mask(pos, pos, pos < prompt_len[:, None])
    delta = (pos[:, :, None] - pos[:, None, :])[:, None]  # [Bn,1,Pb,Pb]
    h, pk, pv = run_trunk(cfg, params, prompt, pos, Bn, 1, causal[:, None], block_delta=delta)
    return last_of(h, 0), pk[:, :, 0], pv[:, :, 0]
  L, K, H = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  buf = jnp.zeros((L, Bn, Pb, K, H), jnp.dtype(cfg.dtype))
  keys_at = jnp.arange(Pb, dtype=jnp.int32)

  def one_chunk(carry, first):
    kbuf, vbuf, last = carry
    pos = jnp.broadcast_to(first + jnp.arange(chunk, dtype=jnp.int32), (Bn, chunk))
    causal = tx.causal_mask(pos, pos, pos < prompt_len[:, None])
    earlier = keys_at[None, :] < jnp.minimum(first, prompt_len)[:, None]  # [Bn,Pb]
    h, k, v = run_trunk(
        cfg, params, jax.lax.dynamic_slice_in_dim(prompt, first, chunk, axis=1), pos, Bn, 1,
        causal[:, None], prefix=(kbuf, vbuf, earlier),
        block_delta=(pos[:, :, None] - pos[:, None, :])[:, None],
        prefix_delta=(pos[:, :, None] - keys_at[None, None, :])[:, None])
    kbuf = jax.lax.dynamic_update_slice_in_dim(kbuf, k[:, :, 0].astype(kbuf.dtype), first, 2)
    vbuf = jax.lax.dynamic_update_slice_in_dim(vbuf, v[:, :, 0].astype(vbuf.dtype), first, 2)
    here = (prompt_len - 1 >= first) & (prompt_len - 1 < first + chunk)
    return (kbuf, vbuf, jnp.where(here[:, None], last_of(h, first), last)), None

  last = jnp.zeros((Bn, cfg.hidden_size), jnp.dtype(cfg.dtype))
  firsts = jnp.arange(0, Pb, chunk, dtype=jnp.int32)
  (pk, pv, last), _ = jax.lax.scan(one_chunk, (buf, buf, last), firsts)
  return last, pk, pv


@functools.partial(jax.jit, **_ADMIT_JIT)
def admit(cfg: ModelConfig, params, state: DecodeState, adm: Admission, sp, version, base_key,
          filtered: bool, fresh: bool = False, ctx=None, chunk: int | None = None,
          identity: bool = False) -> DecodeState:
  """Prefill prompts (once per group) into slots; sample first tokens of fresh samples.

  Resumed samples keep their tokens; their response K/V is rebuilt by ``resume``. With
  ``adm.onto_pages`` (the prompt on pool pages) the slot keeps each prompt's first id and
  the same pass writes the K/V of its ids after the first onto the pages of the row's
  ``onto_pages`` sample, whose trajectory opens with them (all but the last, which the
  decode feeds): what ``resume`` of that sample's tokens writes, in the admission's own
  program; and the samples ``adm.forked`` names fork those pages there (what
  ``kv_cache.fork_samples`` does after the admission).

  Args:
    params: model parameters (a jit argument: new weights never recompile).
    state: DecodeState (donated). adm: Admission. sp: SamplingParams. version: int32 scalar
      policy version of tokens sampled here. base_key: typed PRNG key.
    filtered: static; top-k/top-p active.
    fresh: static; every slot is free and ``adm.slots`` is ``0, 1, ..`` then padding (>= G)
      with Bn == G, so the state's arrays are replaced instead of scattered into.
    chunk: static; prompts longer than this many tokens are prefilled in chunks
      (``prefill_prompts``); None: whole.
    identity: static; the pool's page table is the identity (``pages.fork``).
  Returns:
    Updated DecodeState. Samples with no token yet get their first token from the prompt's
    last logits; resumed samples keep their tokens (the last one becomes the next input).
  """
  TRACE_COUNTS["admit"] += 1
  with mesh_context(ctx):
    Bn, Pb = adm.prompt.shape
    M = adm.length.shape[1]
    last, pk, pv = prefill_prompts(cfg, params, adm.prompt, adm.prompt_len, chunk)
    logits = tx.logits_from_hidden(cfg, params, last)  # [Bn,V]

    sub = DecodeState(pk, pv, adm.prompt_len, None, None, jnp.asarray(adm.tokens),
                      jnp.asarray(adm.logprobs), jnp.asarray(adm.versions),
                      jnp.asarray(adm.length), jnp.asarray(adm.budget),
                      jnp.asarray(adm.reason), None, adm.request_id, adm.sample_id, None,
                      skip=jnp.asarray(adm.skip))
    first = (sub.length == 0) & (sub.reason == RUNNING)
    stream = sampling.stream_words(base_key, jnp.repeat(adm.request_id, M),
                                   adm.sample_id.reshape(-1))
    uniforms = lambda: sampling.token_uniforms(stream, jnp.zeros((Bn * M,), jnp.int32))
    tok, lp = sampling.sample_logits(uniforms, jnp.repeat(logits, M, axis=0), sp, filtered)
    sub = record(sub, tok.reshape(Bn, M), lp.reshape(Bn, M), first, version, sp)

    if fresh:  # every slot was free and slots == [0, 1, ...] + padding: replace wholesale
      put = lambda a, u, lead=0: u.astype(a.dtype)
    else:
      put = lambda a, u, lead=0: a.at[(slice(None),) * lead + (adm.slots,)].set(
          u.astype(a.dtype), mode="drop")
    Pfull = state.prefix_v[0].shape[2]
    kept = adm.prompt_len if adm.onto_pages is None else jnp.minimum(adm.prompt_len, 1)
    # [L,Bn,Pb,K,H] -> cache layouts: keys [L,Bn,K,H,P], values [L,Bn,K,P,H], cut or
    # padded to the cache's P (positions past ``kept`` are never read)
    fit = lambda a, axis: jax.lax.slice_in_dim(jnp.pad(a, [
        (0, max(Pfull - Pb, 0)) if d == axis else (0, 0) for d in range(a.ndim)]), 0, Pfull,
        axis=axis)
    keys = fit(jnp.transpose(pk, (0, 1, 3, 4, 2)), 4)
    values = fit(jnp.swapaxes(pv, 2, 3), 3)
    per_layer = lambda cache, u: tuple(put(c, u[l]) for l, c in enumerate(cache))
    new = state._replace(
        prefix_k=per_layer(state.prefix_k, keys), prefix_v=per_layer(state.prefix_v, values),
        prefix_len=put(state.prefix_len, kept),
        tokens=put(state.tokens, sub.tokens), logprobs=put(state.logprobs, sub.logprobs),
        versions=put(state.versions, sub.versions), length=put(state.length, sub.length),
        budget=put(state.budget, sub.budget), reason=put(state.reason, sub.reason),
        active=put(state.active, adm.slots < state.active.shape[0]),
        request_id=put(state.request_id, adm.request_id),
        sample_id=put(state.sample_id, adm.sample_id),
        stream=put(state.stream, stream.reshape(Bn, M, 2)), skip=put(state.skip, sub.skip))
    if state.routing is not None:  # MoE: no expert record yet in the admitted slots
      new = new._replace(routing=put(state.routing, jnp.full(
          (Bn, *state.routing.shape[1:]), -1, jnp.int32)))
    if adm.onto_pages is not None:  # prompt ids 1 .. len-2 at response indices 0 .. len-3
      count = jnp.where(adm.onto_pages < M, jnp.maximum(adm.prompt_len - 2, 0), 0)
      new = onto_pages(new, adm.slots, jnp.minimum(adm.onto_pages, M - 1), count,
                       pk[:, :, 1:], pv[:, :, 1:])
      if adm.forked is not None:
        new = fork_written(new, adm.slots, adm.onto_pages, adm.forked, identity)
    return constrain_state(new)


@functools.cache
def admit_with(options: tuple = (), chunk: int | None = None):
  """``admit`` compiled with XLA ``compiler_options`` given as sorted (name, value) items
  (``compile_options.fast_compile_options``) and prompts prefilled in chunks of ``chunk``
  tokens (``prefill_prompts``); ``()`` and None: ``admit`` itself."""
  if not options and chunk is None:
    return admit
  jit = dict(_ADMIT_JIT, static_argnames=tuple(a for a in _ADMIT_JIT["static_argnames"]
                                               if a != "chunk"))
  return jax.jit(functools.partial(admit.__wrapped__, chunk=chunk),
                 compiler_options=dict(options) or None, **jit)


def admit_for(devices, chunk: int | None = None) -> Any:
  """``admit`` compiled for ``devices`` with ``compile_options.fast_compile_options`` (the
  training programs' CPU options; XLA's defaults elsewhere), prompts longer than ``chunk``
  tokens prefilled in chunks."""
  return admit_with(tuple(sorted(compile_options.fast_compile_options(devices).items())),
                    chunk)


class Resume(NamedTuple):
  """Resumed, still running samples whose response K/V is rebuilt (host arrays).

  Attributes (Br = bucket; padding rows have slot >= G and are dropped):
    slot: int32 [Br]; sample: int32 [Br] index within the slot.
    tokens: int32 [Br,T] the sample's tokens so far (the last one is fed by the next decode
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
  the K/V is written onto the sample's pages of the response pool (taken as needed). Only
  these samples are computed (finished samples and fresh groups are not).

  Args:
    params: model parameters (jit argument). state: DecodeState (donated). res: Resume.
  Returns:
    Updated DecodeState.
  """
  TRACE_COUNTS["resume"] += 1
  with mesh_context(ctx):
    Br, T = res.tokens.shape
    G = state.active.shape[0]
    slot = jnp.minimum(res.slot, G - 1)  # padding rows read slot G-1 and are dropped below
    j = jnp.arange(T, dtype=jnp.int32)
    plen = state.prefix_len[slot]
    P = state.prefix_v[0].shape[2]
    pvalid = jnp.arange(P)[None, :] < plen[:, None]
    rpos = plen[:, None] + j
    rvalid = j[None, :] < (res.length - 1)[:, None]  # the last token is fed next
    bmask = (j[:, None] >= j[None, :])[None] & rvalid[:, None, :]
    # prefix of each row's slot as [L,Br,P,K,H] for grouped_attention (keys are stored
    # [L,Br,K,H,P], values [L,Br,K,P,H])
    gather = lambda cache, order: jnp.transpose(jnp.stack([c[slot] for c in cache]), order)
    prefix = (gather(state.prefix_k, (0, 1, 4, 2, 3)), gather(state.prefix_v, (0, 1, 3, 2, 4)),
              pvalid)
    _, rk, rv = run_trunk(cfg, params, res.tokens, rpos, Br, 1, bmask[:, None], prefix=prefix,
                          block_delta=(j[:, None] - j[None, :])[None, None],
                          prefix_delta=(rpos[:, :, None] - jnp.arange(P)[None, None, :])[:, None])
    # the rows' first length − 1 response tokens onto their pages (pages taken as needed)
    count = jnp.where(res.slot < G, res.length - 1, 0)
    return constrain_state(onto_pages(state, res.slot, res.sample, count, rk[:, :, 0],
                                      rv[:, :, 0]))


def fork_written(state: DecodeState, slot, writer, forked, identity: bool) -> DecodeState:
  """Samples of the admitted rows forked from the row's ``writer`` sample's pages.

  Args:
    slot: int32 [Bn] (rows >= G dropped); writer: int32 [Bn] the sample whose pages hold
      the prompt (M: none); forked: int32 [Bn,M] the positions each sample takes (0: none).
    identity: the pool's table is the identity (``pages.fork``).
  Returns:
    The state with the forks' pages shared or copied (``kv_cache.fork_rows``).
  """
  G, M = state.pages.shape[:2]
  Bn = slot.shape[0]
  take = (forked > 0) & (writer < M)[:, None] & (slot < G)[:, None]
  rows = lambda a: a.reshape(Bn * M)
  return fork_rows(state, rows(jnp.where(take, slot[:, None], G)),
                   rows(jnp.broadcast_to(jnp.minimum(writer, M - 1)[:, None], (Bn, M))),
                   rows(jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (Bn, M))),
                   rows(forked), identity)


def onto_pages(state: DecodeState, slot, sample, count, k, v) -> DecodeState:
  """K/V of the first ``count`` response indices of rows (slot, sample) onto their pages.

  Args:
    slot, sample, count: int32 [B] (rows with slot >= G are dropped). k, v: [L,B,T,K,H]
      the K/V of response indices 0 .. T-1, of which the first ``count`` of each row are
      written; pages are taken from the row's pool shard as needed (``pages.allocate``).
  Returns:
    The state with its pool, page table and reference counts updated.
  """
  G, M, NP = state.pages.shape
  S = state.suffix_v[0].shape[2]
  B, T = k.shape[1:3]
  need = pages.rows_need(slot, sample, jnp.zeros_like(count), count, G, M, NP, S)
  table, refs = pages.allocate(state.pages, state.refs, need, state_shards(state)[1])
  index = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  valid = index < count[:, None]
  written = [pages.write_rows(ck, cv, table, slot, sample, index, valid, k[l], v[l])
             for l, (ck, cv) in enumerate(zip(state.suffix_k, state.suffix_v))]
  return state._replace(suffix_k=tuple(w[0] for w in written),
                        suffix_v=tuple(w[1] for w in written), pages=table, refs=refs)
