"""Tile-level math shared by the TPU and GPU shared-prefix attention kernels.

Pure functions on in-register (or in-VMEM) tiles; no refs, no grid. Axis letters (the legend
of ``rl_jax/models/transformer.py``): T query rows of a tile, S key rows of a tile, H head
dim.

References: FlashAttention-2 (Dao, 2023) online softmax and backward; DualKV
(amazon-science/dualkv-flash-attn-for-rl) for the context + own-response split.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["MASK_VALUE", "causal_mask", "context_mask", "finalize", "init_carry", "matmul",
           "matmul_tn", "online_softmax_step", "probs_and_dscores", "scores"]

# A finite "minus infinity": masked scores never produce inf - inf = nan.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

_NT = (((1,), (1,)), ((), ()))  # contract the last dim of both: a @ b.T
_TN = (((0,), (0,)), ((), ()))  # contract the first dim of both: a.T @ b


def _dot(a, b, dims):
  """float32 ``lax.dot_general(a, b, dims)``. 16-bit operands get the native product
  (``Precision.DEFAULT``): Mosaic rejects a float32 contract precision on bf16 operands,
  which ``jax_default_matmul_precision="highest"`` would ask for; float32 operands follow
  that setting as before."""
  narrow = jnp.dtype(a.dtype).itemsize < 4 and jnp.dtype(b.dtype).itemsize < 4
  return lax.dot_general(a, b, dims, precision=lax.Precision.DEFAULT if narrow else None,
                         preferred_element_type=jnp.float32)


def scores(q: jax.Array, k: jax.Array, scale: float) -> jax.Array:
  """Scaled scores of one tile.

  Args:
    q: [T,H] queries.
    k: [S,H] keys.
    scale: softmax scale (1/sqrt(H)).

  Returns:
    float32 [T,S] scores q k^T * scale.
  """
  return _dot(q, k, _NT) * scale


def context_mask(bq: int, bk: int, k_start, ctx_len) -> jax.Array:
  """bool [T,S]: key ``k_start + c`` is inside the context (index < ctx_len)."""
  cols = k_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  return cols < ctx_len


def causal_mask(bq: int, bk: int, q_start, k_start) -> jax.Array:
  """bool [T,S]: response key ``k_start + c`` is at or before query ``q_start + r``."""
  rows = q_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  cols = k_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  return cols <= rows


def init_carry(bq: int, head_dim: int):
  """Online-softmax state (running max m [T,1], sum l [T,1], unnormalised out [T,H])."""
  return (jnp.full((bq, 1), MASK_VALUE, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
          jnp.zeros((bq, head_dim), jnp.float32))


def online_softmax_step(m, l, acc, s, mask, v, pv=None):
  """Folds one key tile into the online softmax.

  Args:
    m: float32 [T,1] running max.
    l: float32 [T,1] running sum of exp(s - m).
    acc: float32 [T,H] running sum of exp(s - m) v.
    s: float32 [T,S] scores of this tile.
    mask: bool [T,S] keys each query may see.
    v: [S,H] values of this tile.
    pv: ``pv(p, v)`` -> float32 [T,H] for p float32 [T,S]; default the matmul with p
      rounded to v's dtype (tiles too small for a dot pass broadcast products).

  Returns:
    The updated (m, l, acc).
  """
  s = jnp.where(mask, s, MASK_VALUE)
  m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
  alpha = jnp.exp(m - m_new)
  p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
  l_new = alpha * l + jnp.sum(p, axis=1, keepdims=True)
  pv = matmul(p.astype(v.dtype), v) if pv is None else pv(p, v)
  return m_new, l_new, alpha * acc + pv


def finalize(m, l, acc):
  """Normalised output float32 [T,H] and log-sum-exp float32 [T,1] of the online softmax;
  0 and -inf for a row that saw no key (l = 0)."""
  seen = l > 0
  safe = jnp.where(seen, l, 1.0)
  return jnp.where(seen, acc / safe, 0.0), jnp.where(seen, m + jnp.log(safe), -jnp.inf)


def probs_and_dscores(q, k, v, do, lse, di, mask, scale):
  """Recomputed probabilities and score gradients of one tile.

  Args:
    q: [T,H] queries; k, v: [S,H] keys and values; do: [T,H] output cotangent.
    lse: float32 [T,1] log-sum-exp of each query row (over both regions).
    di: float32 [T,1] rowsum(do * o) minus the log-sum-exp cotangent.
    mask: bool [T,S].
    scale: softmax scale.

  Returns:
    p float32 [T,S] = softmax probabilities, ds float32 [T,S] = dL/d(scaled scores).
  """
  s = scores(q, k, scale)
  p = jnp.where(mask, jnp.exp(s - lse), 0.0)
  dp = _dot(do, v, _NT)
  return p, p * (dp - di)


def matmul(a, b):
  """float32 a @ b."""
  return _dot(a, b, (((1,), (0,)), ((), ())))


def matmul_tn(a, b):
  """float32 a.T @ b."""
  return _dot(a, b, _TN)
