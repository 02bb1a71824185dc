"""Two-region softmax attention merged by log-sum-exp: the one pure-jnp implementation.

A query attends to two disjoint key sets: a context shared by the M samples of its group,
and its own keys (its response so far). Each region gives a partial softmax (an output
normalised over the region's keys and its log-sum-exp); the two merge exactly:
``lse = logaddexp(lse_ctx, lse_own)``, ``out = e^{lse_ctx - lse} out_ctx + e^{lse_own - lse}
out_own``. Everything is computed in float32.

Used by the shared-prefix attention reference (``shared_prefix_attention``, backend
"reference"), the packed training layout through it, and the rollout sampler's prefill of
prompts and of resumed responses.

Axis letters (the legend of ``rl_jax/__init__.py``): G groups, M samples per
group, T query length, S own-key length, P context length, N query heads, K kv heads,
H head dim; J = N/K query heads per kv head.

References: Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"
(log-sum-exp merge); DualKV (amazon-science/dualkv-flash-attn-for-rl).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._tiles import MASK_VALUE

__all__ = ["LAYOUTS", "merge_partials", "partial_softmax", "two_region_attention"]


def partial_softmax(scores: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Softmax of scores over one region's keys, and its log-sum-exp.

  Args:
    scores: float32 [..., S] scaled scores against the region's S keys.
    mask: bool, broadcastable to ``scores``: keys each query may see.

  Returns:
    probabilities float32 [..., S] (zero where nothing is visible) and lse float32 [...]
    (-inf where nothing is visible).
  """
  s = jnp.where(mask, scores, -jnp.inf)
  # finite fill: the max over a row with no visible key stays finite
  m = jnp.max(jnp.where(mask, s, MASK_VALUE), axis=-1, keepdims=True)
  p = jnp.where(mask, jnp.exp(s - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  safe_l = jnp.where(l > 0, l, 1.0)
  lse = jnp.where(l > 0, m + jnp.log(safe_l), -jnp.inf)[..., 0]
  return p / safe_l, lse


def merge_partials(outs, lses, *, return_lse: bool = False):
  """Exact softmax attention from partial results over disjoint key sets.

  ``lse = logaddexp(lse_1, ..., lse_n)``, ``out = sum_i exp(lse_i - lse) · out_i``. A query
  that sees no key in any region gets zeros.

  Args:
    outs: each [..., H] normalised over its own keys; lses: each [...] (same leading shape).
    return_lse: also return the merged log-sum-exp.

  Returns:
    out [..., H] (and lse [...] if ``return_lse``).
  """
  total = functools.reduce(jnp.logaddexp, lses)
  safe = jnp.where(jnp.isfinite(total), total, 0.0)
  terms = [jnp.exp(l - safe)[..., None] * o for o, l in zip(outs, lses)]
  out = functools.reduce(jnp.add, terms)
  return (out, total) if return_lse else out


class _Layout(NamedTuple):
  """How one caller lays out the computation (see ``LAYOUTS``)."""

  own_scores: str  # einsum: grouped queries x own keys -> scores
  own_out: str  # einsum: probabilities x own values -> out
  ctx_scores: str
  ctx_out: str
  mask_axes: tuple[int, int]  # where a [..,T,S] mask gets its two head axes (K, J)
  ctx_first: bool  # the context's term comes first in the merge sum


# The mathematics is the same in every layout. XLA's float32 code for a dot sums in an
# order that depends on the operands' layout, and the merge sum contracts into fused
# multiply-adds in the order of its terms, so each caller keeps the layout (and order) its
# published numbers came from: the kernel reference query-major, the rollout sampler
# head-major.
LAYOUTS = {
    # scores [G,M,T,K,J,S]
    "query_major": _Layout("gmtkjh,gmskh->gmtkjs", "gmtkjs,gmskh->gmtkjh",
                           "gmtkjh,gpkh->gmtkjp", "gmtkjp,gpkh->gmtkjh", (-3, -2), True),
    # scores [G,M,K,J,T,S]
    "head_major": _Layout("gmtkjh,gmskh->gmkjts", "gmkjts,gmskh->gmkjth",
                          "gmtkjh,gpkh->gmkjtp", "gmkjtp,gpkh->gmkjth", (2, 3), False),
}


def two_region_attention(q, k_own, v_own, own_mask, k_ctx=None, v_ctx=None, ctx_mask=None, *,
                         layout: str = "query_major"):
  """Attention of grouped queries over their own keys and, optionally, a shared context.

  Args:
    q: [G,M,T,N,H] queries (any float dtype).
    k_own, v_own: [G,M,S,K,H] each sample's own keys and values.
    own_mask: bool, broadcastable to [G,M,T,S]: own key s visible to query t.
    k_ctx, v_ctx: optional [G,P,K,H] context keys and values, shared by the M samples.
    ctx_mask: bool, broadcastable to [G,M,T,P]: context key p visible to query t.
    layout: a key of ``LAYOUTS``: "query_major" or "head_major" (same values up to float32
      rounding).

  Returns:
    out float32 [G,M,T,K,J,H] (query heads grouped by kv head; reshape to [G,M,T,N,H]) and
    lse float32 [G,M,T,K,J]. Queries that see no key get zeros and -inf.
  """
  lay = LAYOUTS[layout]
  G, M, T, N, H = q.shape
  K = k_own.shape[3]
  f32 = lambda x: x.astype(jnp.float32)
  einsum = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
  qg = f32(q).reshape(G, M, T, K, N // K, H) / np.float32(np.sqrt(H))

  def region(scores_spec, out_spec, k, v, mask):
    p, lse = partial_softmax(einsum(scores_spec, qg, f32(k)), jnp.expand_dims(mask, lay.mask_axes))
    return einsum(out_spec, p, f32(v)), lse

  regions = [region(lay.own_scores, lay.own_out, k_own, v_own, own_mask)]
  if k_ctx is not None:
    ctx = region(lay.ctx_scores, lay.ctx_out, k_ctx, v_ctx, ctx_mask)
    regions = [ctx, *regions] if lay.ctx_first else [*regions, ctx]
  out, lse = merge_partials(*zip(*regions), return_lse=True)
  if layout == "head_major":  # move T back in front of the heads
    out, lse = jnp.moveaxis(out, 4, 2), jnp.moveaxis(lse, 4, 2)
  return out, lse
