"""Token sampling: temperature, top-k, top-p, greedy, and the exact behaviour log-prob.

Axis letters: the legend of ``rl_jax/__init__.py`` (B rows, V vocab); local to
this module (lower case, local): e eos ids, z stop sequences, w stop-sequence window.

The log-prob recorded for a sampled token is ``log_softmax(filtered)[token]`` where
``filtered`` is the tempered logits with every token outside the top-k / top-p set at -inf:
exactly the distribution the token was drawn from. A greedy draw (temperature 0) comes from
a point mass, so its log-prob is 0.

References: Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration" (top-p);
Fan et al. 2018, "Hierarchical Neural Story Generation" (top-k).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

__all__ = ["SamplingParams", "filter_logits", "first_argmax", "sample_logits", "stream_words",
           "token_uniforms"]


class SamplingParams(NamedTuple):
  """Traced sampling settings (changing a value never recompiles).

  Attributes:
    temperature: float32 scalar; 0 means greedy.
    top_k: int32 scalar; 0 disables top-k.
    top_p: float32 scalar in (0, 1]; 1 disables top-p.
    eos_ids: int32 [e] end-of-sequence ids (-1 entries are padding).
    stop_seqs: int32 [z,w] stop sequences, right-aligned, left-padded with -1.
    stop_lens: int32 [z] true length of each stop sequence (0 = unused row).
  """

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  eos_ids: jax.Array
  stop_seqs: jax.Array
  stop_lens: jax.Array


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array) -> jax.Array:
  """Tempered logits with tokens outside the top-k, then top-p, set to -inf.

  Top-k keeps every token whose tempered logit is >= the k-th largest (ties at the boundary
  are kept). Top-p then keeps the smallest prefix of the top-k tokens, by descending
  probability under the top-k-renormalised distribution, whose mass reaches ``top_p``.

  Args:
    logits: float32 [B,V]. temperature: scalar > 0. top_k: int scalar (0 = off).
    top_p: scalar in (0, 1] (1 = off).
  Returns:
    float32 [B,V] tempered, filtered logits.
  """
  V = logits.shape[-1]
  z = logits.astype(jnp.float32) / temperature
  desc = -jnp.sort(-z, axis=-1)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V).astype(jnp.int32)
  kth = desc[:, k - 1][:, None]
  z = jnp.where(z >= kth, z, -jnp.inf)
  desc = jnp.where(jnp.arange(V)[None, :] < k, desc, -jnp.inf)
  probs = jax.nn.softmax(desc, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = (mass_before < top_p) | (top_p >= 1.0)
  n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
  threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
  return jnp.where(z >= threshold, z, -jnp.inf)


def first_argmax(x: jax.Array) -> jax.Array:
  """``argmax`` over the last axis (first maximum) as two plain reductions: max, then the
  smallest index attaining it. XLA's CPU backend runs the fused (value, index) reduction of
  ``jnp.argmax`` an order of magnitude slower. x [B,V] -> int32 [B]."""
  V = x.shape[-1]
  hit = x == jnp.max(x, axis=-1, keepdims=True)
  return jnp.minimum(jnp.min(jnp.where(hit, jnp.arange(V, dtype=jnp.int32), V), axis=-1), V - 1)


def sample_logits(uniforms, logits: jax.Array, params: SamplingParams,
                  filtered: bool) -> tuple[jax.Array, jax.Array]:
  """Draw one token per row and its log-prob under the distribution it was drawn from.

  Draws by inversion: one uniform ``u`` per row, token = first index whose cumulative
  probability exceeds ``u · total`` (one random number per row instead of one per vocabulary
  entry for Gumbel-max). Tokens of probability 0 (filtered out) are never drawn. At
  temperature 0 a ``lax.cond`` skips the softmax and the draw entirely.

  Args:
    uniforms: float32 [B] in [0, 1), one per row, or a function of no arguments returning
      them (then only evaluated when sampling, not at temperature 0). logits: float32 [B,V].
    params: SamplingParams. filtered: static; False skips the top-k/top-p sort (use it
      when top_k == 0 and top_p == 1).
  Returns:
    tokens int32 [B]; logprobs float32 [B] (0 for greedy rows).
  """
  greedy = params.temperature <= 0.0

  def argmax(_):
    return first_argmax(logits), jnp.zeros(logits.shape[:1], jnp.float32)

  def draw(_):
    if filtered:
      z = filter_logits(logits, params.temperature, params.top_k, params.top_p)
    else:
      z = logits.astype(jnp.float32) / params.temperature
    logp = jax.nn.log_softmax(z, axis=-1)
    p = jnp.exp(logp)
    cdf = jnp.cumsum(p, axis=-1)
    u = uniforms() if callable(uniforms) else uniforms
    x = u * cdf[:, -1]
    tok = jnp.minimum(jnp.sum(cdf <= x[:, None], axis=-1), logits.shape[-1] - 1)
    tok = tok.astype(jnp.int32)
    lp = jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
    # Rounding can put x at the very top of the CDF, past the last kept token: take the mode.
    bad = ~jnp.isfinite(lp)
    best = first_argmax(z)
    tok = jnp.where(bad, best, tok)
    lp = jnp.where(bad, jnp.take_along_axis(logp, best[:, None], axis=-1)[:, 0], lp)
    return tok, lp

  return jax.lax.cond(greedy, argmax, draw, None)


def stream_words(base_key: jax.Array, request_ids: jax.Array,
                 sample_ids: jax.Array) -> jax.Array:
  """Key words of the random stream of each (request, sample).

  Streams depend only on (request id, sample id), never on slot, batch layout or mesh, so a
  request samples the same tokens in any batch, after a resume, or on another mesh.

  Args:
    base_key: typed threefry key scalar. request_ids, sample_ids: int [B].
  Returns:
    uint32 [B,2].
  """

  def one(r, s):
    return jax.random.key_data(jax.random.fold_in(jax.random.fold_in(base_key, r), s))

  return jax.vmap(one)(request_ids, sample_ids)


def token_uniforms(words: jax.Array, token_index: jax.Array) -> jax.Array:
  """Uniform in [0, 1) for token ``token_index`` of each stream: one threefry block per row.

  Args:
    words: uint32 [B,2] (``stream_words``). token_index: int [B].
  Returns:
    float32 [B].
  """
  count = token_index.astype(jnp.uint32)
  bits, _ = threefry2x32_p.bind(words[:, 0], words[:, 1], count, jnp.zeros_like(count))
  mantissa = (bits >> jnp.uint32(9)) | jnp.uint32(0x3F800000)
  return jax.lax.bitcast_convert_type(mantissa, jnp.float32) - 1.0
