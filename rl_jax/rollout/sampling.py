"""Token sampling: temperature, top-k, top-p, greedy, and the exact behaviour log-prob.

Axis letters: B rows, V vocab.

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


class SamplingParams(NamedTuple):
  """Traced sampling settings (changing a value never recompiles).

  Attributes:
    temperature: float32 scalar; 0 means greedy.
    top_k: int32 scalar; 0 disables top-k.
    top_p: float32 scalar in (0, 1]; 1 disables top-p.
    eos_ids: int32 [E] end-of-sequence ids (-1 entries are padding).
    stop_seqs: int32 [S, W] stop sequences, right-aligned, left-padded with -1.
    stop_lens: int32 [S] true length of each stop sequence (0 = unused row).
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


def sample_logits(keys: jax.Array, logits: jax.Array, params: SamplingParams,
                  filtered: bool) -> tuple[jax.Array, jax.Array]:
  """Draw one token per row and its log-prob under the distribution it was drawn from.

  Args:
    keys: typed PRNG keys [B] (one per row). logits: float32 [B,V].
    params: SamplingParams. filtered: static; False skips the top-k/top-p sort (use it
      when top_k == 0 and top_p == 1).
  Returns:
    tokens int32 [B]; logprobs float32 [B] (0 for greedy rows).
  """
  greedy = params.temperature <= 0.0
  temp = jnp.where(greedy, 1.0, params.temperature)
  if filtered:
    z = filter_logits(logits, temp, params.top_k, params.top_p)
  else:
    z = logits.astype(jnp.float32) / temp
  drawn = jax.vmap(jax.random.categorical)(keys, z).astype(jnp.int32)
  logp = jax.nn.log_softmax(z, axis=-1)
  drawn_lp = jnp.take_along_axis(logp, drawn[:, None], axis=-1)[:, 0]
  best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jnp.where(greedy, best, drawn), jnp.where(greedy, 0.0, drawn_lp)


def row_keys(base_key: jax.Array, request_ids: jax.Array, sample_ids: jax.Array,
             token_index: jax.Array) -> jax.Array:
  """PRNG key of token ``token_index`` of sample ``sample_ids`` of request ``request_ids``.

  Keys depend only on (request, sample, token index), never on slot or batch layout, so the
  same request samples the same tokens in any batch, slot, mesh or after a resume.

  Args:
    base_key: typed key scalar; request_ids, sample_ids, token_index: int [B].
  Returns:
    typed keys [B].
  """

  def one(r, s, t):
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base_key, r), s), t)

  return jax.vmap(one)(request_ids, sample_ids, token_index)
