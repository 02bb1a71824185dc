"""GPU (Triton) kernels for shared-prefix attention: key blocks walked by a loop.

Each program owns one output tile and loops over the tiles it reduces over, keeping the
accumulators in registers (Triton has no sequential grid axis to carry state across). The
loops are bounded by what a tile can see: ceil(ctx_len / block) context tiles and the
response tiles up to the diagonal.

Kernels read the caller's layouts directly (Triton tiles need no lane alignment):
  q, o, do [G,M,R',N,H]   k_ctx, v_ctx [G,P',K,H]   k_resp, v_resp [G,M,R',K,H]
  lse, di  [G,M,R',N] float32
Axis letters (the legend of ``rl_jax/__init__.py``): G groups, M responses per
group, R' padded response length, P' padded context length, N query heads, K kv heads,
H head dim.

References: DualKV shared-prefix attention (amazon-science/dualkv-flash-attn-for-rl);
FlashAttention-2 (Dao, 2023).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _tiles
from pallas_kernels.block_sizes import FittedBlocks

__all__ = ["backward", "forward"]


def _params(head_dim: int):
  return pltriton.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def _num_ctx_blocks(ctx_len, bk):
  return lax.div(ctx_len + bk - 1, bk)


def _num_visible_resp_blocks(i, bq, bk):
  """Response key tiles at or before the diagonal of query tile ``i``."""
  return lax.div((i + 1) * bq - 1, bk) + 1


def _query_specs(m_, rep, bq, p_, r_, h_):
  """Block specs of the (query block i, g*M + m, query head n) grid for the query-tile
  kernels (forward, dq)."""
  def q_map(i, gm, n):
    return lax.div(gm, m_), lax.rem(gm, m_), i, n, 0

  def len_map(i, gm, n):
    return (lax.div(gm, m_),)

  def ctx_map(i, gm, n):
    return lax.div(gm, m_), 0, lax.div(n, rep), 0

  def resp_map(i, gm, n):
    return lax.div(gm, m_), lax.rem(gm, m_), 0, lax.div(n, rep), 0

  def row_map(i, gm, n):
    return lax.div(gm, m_), lax.rem(gm, m_), i, n

  return (pl.BlockSpec((None,), len_map), pl.BlockSpec((None, None, bq, None, h_), q_map),
          pl.BlockSpec((None, p_, None, h_), ctx_map),
          pl.BlockSpec((None, None, r_, None, h_), resp_map),
          pl.BlockSpec((None, None, bq, None), row_map))


# ---------------------------------------------------------------------------------------
# Forward.


def _fwd_kernel(len_ref, q_ref, kc_ref, vc_ref, kr_ref, vr_ref, o_ref, lse_ref, *, scale, bk):
  i = pl.program_id(0)
  bq, head_dim = q_ref.shape
  ctx_len = len_ref[...]
  q = q_ref[...]

  def body(k_ref, v_ref, mask_fn):
    def step(j, carry):
      start = pl.multiple_of(j * bk, bk)
      s = _tiles.scores(q, k_ref[pl.ds(start, bk), :], scale)
      return _tiles.online_softmax_step(*carry, s, mask_fn(start), v_ref[pl.ds(start, bk), :])
    return step

  carry = _tiles.init_carry(bq, head_dim)
  carry = lax.fori_loop(0, _num_ctx_blocks(ctx_len, bk), body(
      kc_ref, vc_ref, lambda start: _tiles.context_mask(bq, bk, start, ctx_len)), carry)
  carry = lax.fori_loop(0, _num_visible_resp_blocks(i, bq, bk), body(
      kr_ref, vr_ref, lambda start: _tiles.causal_mask(bq, bk, i * bq, start)), carry)
  o, lse = _tiles.finalize(*carry)
  o_ref[...] = o.astype(o_ref.dtype)
  lse_ref[...] = lse[:, 0]


def forward(q, k_ctx, v_ctx, k_resp, v_resp, ctx_lengths, *, fitted: FittedBlocks,
            scale: float, interpret: bool):
  """Shared-prefix attention forward on padded inputs.

  Args:
    q: [G,M,R',N,H]; k_ctx, v_ctx: [G,P',K,H]; k_resp, v_resp: [G,M,R',K,H].
    ctx_lengths: int32 [G], each in [0, P'].
    fitted: block sizes dividing R' and P'.
    scale: softmax scale.
    interpret: run the kernel in the Pallas interpreter.

  Returns:
    o [G,M,R',N,H] (dtype of q) and lse float32 [G,M,R',N].
  """
  g_, m_, r_, n_, h_ = q.shape
  p_, k_ = k_ctx.shape[1], k_ctx.shape[2]
  bq, bk = fitted.sizes.block_q, fitted.sizes.block_kv
  len_spec, q_spec, ctx_spec, resp_spec, row_spec = _query_specs(
      m_, n_ // k_, bq, p_, r_, h_)
  return pl.pallas_call(
      functools.partial(_fwd_kernel, scale=scale, bk=bk),
      grid=(r_ // bq, g_ * m_, n_),
      in_specs=[len_spec, q_spec, ctx_spec, ctx_spec, resp_spec, resp_spec],
      out_specs=[q_spec, row_spec],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((g_, m_, r_, n_), jnp.float32)],
      compiler_params=_params(h_),
      interpret=interpret,
      name="shared_prefix_attention_fwd",
  )(ctx_lengths, q, k_ctx, v_ctx, k_resp, v_resp)


# ---------------------------------------------------------------------------------------
# Backward.


def _dq_kernel(len_ref, q_ref, kc_ref, vc_ref, kr_ref, vr_ref, do_ref, lse_ref, di_ref,
               dq_ref, *, scale, bk):
  i = pl.program_id(0)
  bq, head_dim = q_ref.shape
  ctx_len = len_ref[...]
  q, do = q_ref[...], do_ref[...]
  lse, di = lse_ref[...][:, None], di_ref[...][:, None]

  def body(k_ref, v_ref, mask_fn):
    def step(j, dq):
      start = pl.multiple_of(j * bk, bk)
      k = k_ref[pl.ds(start, bk), :]
      _, ds = _tiles.probs_and_dscores(q, k, v_ref[pl.ds(start, bk), :], do, lse, di,
                                       mask_fn(start), scale)
      return dq + _tiles.matmul(ds.astype(k.dtype), k)
    return step

  dq = jnp.zeros((bq, head_dim), jnp.float32)
  dq = lax.fori_loop(0, _num_ctx_blocks(ctx_len, bk), body(
      kc_ref, vc_ref, lambda start: _tiles.context_mask(bq, bk, start, ctx_len)), dq)
  dq = lax.fori_loop(0, _num_visible_resp_blocks(i, bq, bk), body(
      kr_ref, vr_ref, lambda start: _tiles.causal_mask(bq, bk, i * bq, start)), dq)
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_step(q, k, v, do, lse, di, mask, scale, dk, dv):
  p, ds = _tiles.probs_and_dscores(q, k, v, do, lse, di, mask, scale)
  return (dk + _tiles.matmul_tn(ds.astype(q.dtype), q) * scale,
          dv + _tiles.matmul_tn(p.astype(do.dtype), do))


def _dkv_ctx_kernel(len_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dk_ref, dv_ref, *,
                    scale, bq, rep, m_):
  c, kh = pl.program_id(0), pl.program_id(2)
  bk, head_dim = k_ref.shape
  ctx_len = len_ref[...]
  k, v = k_ref[...], v_ref[...]
  mask = _tiles.context_mask(bq, bk, c * bk, ctx_len)
  num_q_blocks = q_ref.shape[1] // bq

  # One loop over (response m, query head r of this kv head, query block i), in a fixed
  # order, so the sum over the M responses is deterministic.
  def step(x, carry):
    i = lax.rem(x, num_q_blocks)
    r = lax.rem(lax.div(x, num_q_blocks), rep)
    m = lax.div(x, num_q_blocks * rep)
    n = kh * rep + r
    rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
    return _dkv_step(q_ref[m, rows, n, :], k, v, do_ref[m, rows, n, :],
                     lse_ref[m, rows, n][:, None], di_ref[m, rows, n][:, None], mask, scale,
                     *carry)

  # Integer arithmetic, not a select: Triton's lowering of a scalar select can type the
  # loop bound as a boolean.
  trips = jnp.minimum(jnp.maximum(ctx_len - c * bk, 0), 1) * (m_ * rep * num_q_blocks)
  zeros = jnp.zeros((bk, head_dim), jnp.float32)
  dk, dv = lax.fori_loop(0, trips, step, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dkv_resp_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dk_ref, dv_ref, *,
                     scale, bq, rep):
  j, kh = pl.program_id(0), pl.program_id(2)
  bk, head_dim = k_ref.shape
  k, v = k_ref[...], v_ref[...]
  num_q_blocks = q_ref.shape[0] // bq
  first_q_block = lax.div(j * bk, bq)
  span = num_q_blocks - first_q_block

  def step(x, carry):
    r = lax.div(x, span)
    i = first_q_block + lax.rem(x, span)
    n = kh * rep + r
    rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
    mask = _tiles.causal_mask(bq, bk, i * bq, j * bk)
    return _dkv_step(q_ref[rows, n, :], k, v, do_ref[rows, n, :], lse_ref[rows, n][:, None],
                     di_ref[rows, n][:, None], mask, scale, *carry)

  zeros = jnp.zeros((bk, head_dim), jnp.float32)
  dk, dv = lax.fori_loop(0, rep * span, step, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq(ctx_lengths, q, k_ctx, v_ctx, k_resp, v_resp, do, lse, di, *, fitted, scale, interpret):
  g_, m_, r_, n_, h_ = q.shape
  p_, k_ = k_ctx.shape[1], k_ctx.shape[2]
  bq, bk = fitted.sizes.block_q, fitted.sizes.block_kv
  len_spec, q_spec, ctx_spec, resp_spec, row_spec = _query_specs(
      m_, n_ // k_, bq, p_, r_, h_)
  return pl.pallas_call(
      functools.partial(_dq_kernel, scale=scale, bk=bk),
      grid=(r_ // bq, g_ * m_, n_),
      in_specs=[len_spec, q_spec, ctx_spec, ctx_spec, resp_spec, resp_spec, q_spec, row_spec,
                row_spec],
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_params(h_),
      interpret=interpret,
      name="shared_prefix_attention_dq",
  )(ctx_lengths, q, k_ctx, v_ctx, k_resp, v_resp, do, lse, di)


def _dkv_ctx(ctx_lengths, q, k_ctx, v_ctx, do, lse, di, *, fitted, scale, interpret):
  """dK/dV of the context, summed over the M responses and the query heads of each kv head."""
  g_, m_, r_, n_, h_ = q.shape
  p_, k_ = k_ctx.shape[1], k_ctx.shape[2]
  bq, bk = fitted.sizes.block_q_bwd, fitted.sizes.block_kv_bwd
  group = lambda c, g, kh: (g, 0, 0, 0, 0)
  k_spec = pl.BlockSpec((None, bk, None, h_), lambda c, g, kh: (g, c, kh, 0))
  q_spec = pl.BlockSpec((None, m_, r_, n_, h_), group)
  row_spec = pl.BlockSpec((None, m_, r_, n_), lambda c, g, kh: (g, 0, 0, 0))
  return pl.pallas_call(
      functools.partial(_dkv_ctx_kernel, scale=scale, bq=bq, rep=n_ // k_, m_=m_),
      grid=(p_ // bk, g_, k_),
      in_specs=[pl.BlockSpec((None,), lambda c, g, kh: (g,)), q_spec, k_spec, k_spec, q_spec,
                row_spec, row_spec],
      out_specs=[k_spec, k_spec],
      out_shape=[jax.ShapeDtypeStruct(k_ctx.shape, k_ctx.dtype),
                 jax.ShapeDtypeStruct(v_ctx.shape, v_ctx.dtype)],
      compiler_params=_params(h_),
      interpret=interpret,
      name="shared_prefix_attention_dkv_context",
  )(ctx_lengths, q, k_ctx, v_ctx, do, lse, di)


def _dkv_resp(q, k_resp, v_resp, do, lse, di, *, fitted, scale, interpret):
  """dK/dV of each response's own keys, summed over the query heads of each kv head."""
  g_, m_, r_, n_, h_ = q.shape
  k_ = k_resp.shape[3]
  bq, bk = fitted.sizes.block_q_bwd, fitted.sizes.block_kv_bwd
  seq = lambda j, gm, kh: (lax.div(gm, m_), lax.rem(gm, m_), 0, 0, 0)
  k_spec = pl.BlockSpec((None, None, bk, None, h_),
                        lambda j, gm, kh: (lax.div(gm, m_), lax.rem(gm, m_), j, kh, 0))
  q_spec = pl.BlockSpec((None, None, r_, n_, h_), seq)
  row_spec = pl.BlockSpec((None, None, r_, n_),
                          lambda j, gm, kh: (lax.div(gm, m_), lax.rem(gm, m_), 0, 0))
  return pl.pallas_call(
      functools.partial(_dkv_resp_kernel, scale=scale, bq=bq, rep=n_ // k_),
      grid=(r_ // bk, g_ * m_, k_),
      in_specs=[q_spec, k_spec, k_spec, q_spec, row_spec, row_spec],
      out_specs=[k_spec, k_spec],
      out_shape=[jax.ShapeDtypeStruct(k_resp.shape, k_resp.dtype),
                 jax.ShapeDtypeStruct(v_resp.shape, v_resp.dtype)],
      compiler_params=_params(h_),
      interpret=interpret,
      name="shared_prefix_attention_dkv_response",
  )(q, k_resp, v_resp, do, lse, di)


def backward(q, k_ctx, v_ctx, k_resp, v_resp, ctx_lengths, do, lse, di, *,
             fitted: FittedBlocks, scale: float, interpret: bool):
  """Gradients of shared-prefix attention on padded inputs.

  Args:
    q, k_ctx, v_ctx, k_resp, v_resp, ctx_lengths: as in ``forward``.
    do: [G,M,R',N,H] output cotangent.
    lse: float32 [G,M,R',N] log-sum-exp from the forward.
    di: float32 [G,M,R',N] rowsum(do * o) minus the log-sum-exp cotangent.
    fitted, scale, interpret: as in ``forward``.

  Returns:
    (dq, dk_ctx, dv_ctx, dk_resp, dv_resp) in the layouts and dtypes of the inputs.
  """
  kw = dict(fitted=fitted, scale=scale, interpret=interpret)
  dq = _dq(ctx_lengths, q, k_ctx, v_ctx, k_resp, v_resp, do, lse, di, **kw)
  dkc, dvc = _dkv_ctx(ctx_lengths, q, k_ctx, v_ctx, do, lse, di, **kw)
  dkr, dvr = _dkv_resp(q, k_resp, v_resp, do, lse, di, **kw)
  return dq, dkc, dvc, dkr, dvr
