"""TPU (Mosaic) kernels for shared-prefix attention: key blocks walked by the grid.

Each grid step holds one query tile and one key tile in VMEM; the last grid axis walks the
key tiles (first the context, then the response's own tiles) and the online-softmax state
lives in VMEM scratch. Key tiles no query of the step can see are skipped, and their index
maps repeat the previous block so the pipeline issues no copy for them. Context lengths are
scalar-prefetched into SMEM.

Kernel layouts (head-major so the last two block dims are [rows, H]):
  q, o, do     [G,N,M,R',H]      k_ctx, v_ctx [G,K,P',H]     k_resp, v_resp [G,K,M,R',H]
  lse, di      [G,N,M,1,R'] float32 (rows, so the last block dim is the query block)
Axis letters (the legend of ``rl_jax/__init__.py``): G groups, M responses per
group, R' padded response length, P' padded context length, N query heads, K kv heads,
H head dim; T query rows of a tile.

References: DualKV shared-prefix attention (amazon-science/dualkv-flash-attn-for-rl);
FlashAttention-2 (Dao, 2023).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _tiles
from pallas_kernels.block_sizes import FittedBlocks

__all__ = ["backward", "forward"]

_PAR, _ARB = "parallel", "arbitrary"
_LANES = 128


def _last_ctx_block(ctx_len, bk):
  """Index of the last key block holding a context token (0 if the context is empty)."""
  return jnp.maximum(lax.div(ctx_len + bk - 1, bk) - 1, 0)


def _col_to_row(x):
  """float32 [T,1] -> [1,T] (via a lane-dense transpose, which Mosaic supports)."""
  return jnp.broadcast_to(x, (x.shape[0], _LANES)).T[:1]


def _row_to_col(ref):
  """A [1,T] ref -> float32 [T,1] value."""
  return jnp.expand_dims(ref[0], -1)


def _to_kernel_layout(q, k_ctx, v_ctx, k_resp, v_resp):
  """[G,M,R,N,H] / [G,P,K,H] -> head-major kernel layouts."""
  return (q.transpose(0, 3, 1, 2, 4), k_ctx.transpose(0, 2, 1, 3), v_ctx.transpose(0, 2, 1, 3),
          k_resp.transpose(0, 3, 1, 2, 4), v_resp.transpose(0, 3, 1, 2, 4))


def _rows(x):
  """float32 [G,M,R,N] -> [G,N,M,1,R]."""
  return x.transpose(0, 3, 1, 2)[:, :, :, None, :]


def _visit_key_tile(update, t, i, bq, bk, ctx_len, num_ctx_blocks, kc_ref, vc_ref, kr_ref,
                    vr_ref):
  """Calls ``update(k_ref, v_ref, mask)`` for key tile t of query tile i, if any key in it is
  visible: tiles t < num_ctx_blocks are context (keys < ctx_len), the rest are the query's
  own response (causal)."""
  k_start = t * bk

  @pl.when(jnp.logical_and(t < num_ctx_blocks, k_start < ctx_len))
  def _context():
    update(kc_ref, vc_ref, _tiles.context_mask(bq, bk, k_start, ctx_len))

  r_start = (t - num_ctx_blocks) * bk

  @pl.when(jnp.logical_and(t >= num_ctx_blocks, r_start < (i + 1) * bq))
  def _response():
    update(kr_ref, vr_ref, _tiles.causal_mask(bq, bk, i * bq, r_start))


# ---------------------------------------------------------------------------------------
# Forward.


def _fwd_kernel(lens_ref, q_ref, kc_ref, vc_ref, kr_ref, vr_ref, o_ref, lse_ref,
                m_sc, l_sc, acc_sc, *, scale, num_ctx_blocks):
  g, i, t = pl.program_id(0), pl.program_id(3), pl.program_id(4)
  bq, bk = q_ref.shape[0], kc_ref.shape[0]
  ctx_len = lens_ref[g]

  # m and l live lane-broadcast in [T,128] scratch (lane-dense VMEM); column [T,1] values.
  lanes = lambda x: jnp.broadcast_to(x, (bq, _LANES))
  column = lambda ref: ref[...][:, :1]

  @pl.when(t == 0)
  def _init():
    m, l, acc = _tiles.init_carry(bq, q_ref.shape[1])
    m_sc[...], l_sc[...], acc_sc[...] = lanes(m), lanes(l), acc

  def update(k_ref, v_ref, mask):
    s = _tiles.scores(q_ref[...], k_ref[...], scale)
    m, l, acc = _tiles.online_softmax_step(column(m_sc), column(l_sc), acc_sc[...], s, mask,
                                           v_ref[...])
    m_sc[...], l_sc[...], acc_sc[...] = lanes(m), lanes(l), acc

  _visit_key_tile(update, t, i, bq, bk, ctx_len, num_ctx_blocks, kc_ref, vc_ref, kr_ref,
                  vr_ref)

  @pl.when(t == pl.num_programs(4) - 1)
  def _finalize():
    o, lse = _tiles.finalize(column(m_sc), column(l_sc), acc_sc[...])
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = _col_to_row(lse)


def _query_kv_index_maps(rep, bq, bk, num_ctx_blocks):
  """Index maps of the (group g, query head n, response m, query block i, key block t) grid
  for the query-tile kernels (forward, dq)."""

  def q_map(g, n, m, i, t, lens):
    return g, n, m, i, 0

  def row_map(g, n, m, i, t, lens):
    return g, n, m, 0, i

  def ctx_map(g, n, m, i, t, lens):
    return g, lax.div(n, rep), jnp.minimum(t, _last_ctx_block(lens[g], bk)), 0

  def resp_map(g, n, m, i, t, lens):
    last_visible = lax.div((i + 1) * bq - 1, bk)
    return g, lax.div(n, rep), m, jnp.clip(t - num_ctx_blocks, 0, last_visible), 0

  return q_map, row_map, ctx_map, resp_map


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
  nc, nr = p_ // bk, r_ // bk
  q_t, kc_t, vc_t, kr_t, vr_t = _to_kernel_layout(q, k_ctx, v_ctx, k_resp, v_resp)
  q_map, row_map, ctx_map, resp_map = _query_kv_index_maps(n_ // k_, bq, bk, nc)
  q_spec = pl.BlockSpec((None, None, None, bq, h_), q_map)
  ctx_spec = pl.BlockSpec((None, None, bk, h_), ctx_map)
  resp_spec = pl.BlockSpec((None, None, None, bk, h_), resp_map)
  row_spec = pl.BlockSpec((None, None, None, 1, bq), row_map)
  o_t, lse_t = pl.pallas_call(
      functools.partial(_fwd_kernel, scale=scale, num_ctx_blocks=nc),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(g_, n_, m_, r_ // bq, nc + nr),
          in_specs=[q_spec, ctx_spec, ctx_spec, resp_spec, resp_spec],
          out_specs=[q_spec, row_spec],
          scratch_shapes=[pltpu.VMEM((bq, _LANES), jnp.float32),
                          pltpu.VMEM((bq, _LANES), jnp.float32),
                          pltpu.VMEM((bq, h_), jnp.float32)],
      ),
      out_shape=[jax.ShapeDtypeStruct(q_t.shape, q.dtype),
                 jax.ShapeDtypeStruct((g_, n_, m_, 1, r_), jnp.float32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=(_PAR,) * 4 + (_ARB,)),
      interpret=interpret,
      name="shared_prefix_attention_fwd",
  )(ctx_lengths, q_t, kc_t, vc_t, kr_t, vr_t)
  return o_t.transpose(0, 2, 3, 1, 4), lse_t[:, :, :, 0, :].transpose(0, 2, 3, 1)


# ---------------------------------------------------------------------------------------
# Backward: dq (query tiles, keys on the grid), then dK/dV of the context and of the
# responses (key tiles, query tiles on the grid).


def _dq_kernel(lens_ref, q_ref, kc_ref, vc_ref, kr_ref, vr_ref, do_ref, lse_ref, di_ref,
               dq_ref, dq_sc, *, scale, num_ctx_blocks):
  g, i, t = pl.program_id(0), pl.program_id(3), pl.program_id(4)
  bq, bk = q_ref.shape[0], kc_ref.shape[0]
  ctx_len = lens_ref[g]

  @pl.when(t == 0)
  def _init():
    dq_sc[...] = jnp.zeros_like(dq_sc)

  def update(k_ref, v_ref, mask):
    k = k_ref[...]
    _, ds = _tiles.probs_and_dscores(q_ref[...], k, v_ref[...], do_ref[...],
                                     _row_to_col(lse_ref), _row_to_col(di_ref), mask, scale)
    dq_sc[...] += _tiles.matmul(ds.astype(k.dtype), k) * scale

  _visit_key_tile(update, t, i, bq, bk, ctx_len, num_ctx_blocks, kc_ref, vc_ref, kr_ref,
                  vr_ref)

  @pl.when(t == pl.num_programs(4) - 1)
  def _finalize():
    dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def _dkv_update(q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dk_sc, dv_sc, mask, scale):
  q, do = q_ref[...], do_ref[...]
  p, ds = _tiles.probs_and_dscores(q, k_ref[...], v_ref[...], do, _row_to_col(lse_ref),
                                   _row_to_col(di_ref), mask, scale)
  dv_sc[...] += _tiles.matmul_tn(p.astype(do.dtype), do)
  dk_sc[...] += _tiles.matmul_tn(ds.astype(q.dtype), q) * scale


def _dkv_ctx_kernel(lens_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dk_ref, dv_ref,
                    dk_sc, dv_sc, *, scale):
  g, c = pl.program_id(0), pl.program_id(2)
  first = (pl.program_id(3) == 0) & (pl.program_id(4) == 0) & (pl.program_id(5) == 0)
  last = ((pl.program_id(3) == pl.num_programs(3) - 1)
          & (pl.program_id(4) == pl.num_programs(4) - 1)
          & (pl.program_id(5) == pl.num_programs(5) - 1))
  bq, bk = q_ref.shape[0], k_ref.shape[0]
  ctx_len = lens_ref[g]

  @pl.when(first)
  def _init():
    dk_sc[...] = jnp.zeros_like(dk_sc)
    dv_sc[...] = jnp.zeros_like(dv_sc)

  @pl.when(c * bk < ctx_len)
  def _accumulate():
    mask = _tiles.context_mask(bq, bk, c * bk, ctx_len)
    _dkv_update(q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dk_sc, dv_sc, mask, scale)

  @pl.when(last)
  def _finalize():
    dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dkv_resp_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dk_ref, dv_ref,
                     dk_sc, dv_sc, *, scale):
  j, i = pl.program_id(3), pl.program_id(5)
  first = (pl.program_id(4) == 0) & (i == 0)
  last = (pl.program_id(4) == pl.num_programs(4) - 1) & (i == pl.num_programs(5) - 1)
  bq, bk = q_ref.shape[0], k_ref.shape[0]

  @pl.when(first)
  def _init():
    dk_sc[...] = jnp.zeros_like(dk_sc)
    dv_sc[...] = jnp.zeros_like(dv_sc)

  @pl.when((i + 1) * bq > j * bk)
  def _accumulate():
    mask = _tiles.causal_mask(bq, bk, i * bq, j * bk)
    _dkv_update(q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dk_sc, dv_sc, mask, scale)

  @pl.when(last)
  def _finalize():
    dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dq(lens, q_t, kc_t, vc_t, kr_t, vr_t, do_t, lse_t, di_t, *, fitted, scale, interpret):
  g_, n_, m_, r_, h_ = q_t.shape
  k_, p_ = kc_t.shape[1], kc_t.shape[2]
  bq, bk = fitted.sizes.block_q, fitted.sizes.block_kv
  nc, nr = p_ // bk, r_ // bk
  q_map, row_map, ctx_map, resp_map = _query_kv_index_maps(n_ // k_, bq, bk, nc)
  q_spec = pl.BlockSpec((None, None, None, bq, h_), q_map)
  ctx_spec = pl.BlockSpec((None, None, bk, h_), ctx_map)
  resp_spec = pl.BlockSpec((None, None, None, bk, h_), resp_map)
  row_spec = pl.BlockSpec((None, None, None, 1, bq), row_map)
  return pl.pallas_call(
      functools.partial(_dq_kernel, scale=scale, num_ctx_blocks=nc),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(g_, n_, m_, r_ // bq, nc + nr),
          in_specs=[q_spec, ctx_spec, ctx_spec, resp_spec, resp_spec, q_spec, row_spec,
                    row_spec],
          out_specs=q_spec,
          scratch_shapes=[pltpu.VMEM((bq, h_), jnp.float32)],
      ),
      out_shape=jax.ShapeDtypeStruct(q_t.shape, q_t.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=(_PAR,) * 4 + (_ARB,)),
      interpret=interpret,
      name="shared_prefix_attention_dq",
  )(lens, q_t, kc_t, vc_t, kr_t, vr_t, do_t, lse_t, di_t)


def _dkv_ctx(lens, q_t, kc_t, vc_t, do_t, lse_t, di_t, *, fitted, scale, interpret):
  """dK/dV of the context, summed over the M responses and the query heads of each kv head."""
  g_, n_, m_, r_, h_ = q_t.shape
  k_, p_ = kc_t.shape[1], kc_t.shape[2]
  rep = n_ // k_
  bq, bk = fitted.sizes.block_q_bwd, fitted.sizes.block_kv_bwd

  # Grid (g, kv head, key block c, query head within the group r, response m, query block i).
  # Key blocks past the context repeat query block (0, 0, 0): no copies for skipped steps.
  def q_map(g, kh, c, r, m, i, lens):
    live = c * bk < lens[g]
    return (g, kh * rep + jnp.where(live, r, 0), jnp.where(live, m, 0), jnp.where(live, i, 0),
            0)

  def row_map(g, kh, c, r, m, i, lens):
    b = q_map(g, kh, c, r, m, i, lens)
    return b[0], b[1], b[2], 0, b[3]

  def k_map(g, kh, c, r, m, i, lens):
    return g, kh, c, 0

  q_spec = pl.BlockSpec((None, None, None, bq, h_), q_map)
  row_spec = pl.BlockSpec((None, None, None, 1, bq), row_map)
  k_spec = pl.BlockSpec((None, None, bk, h_), k_map)
  return pl.pallas_call(
      functools.partial(_dkv_ctx_kernel, scale=scale),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(g_, k_, p_ // bk, rep, m_, r_ // bq),
          in_specs=[q_spec, k_spec, k_spec, q_spec, row_spec, row_spec],
          out_specs=[k_spec, k_spec],
          scratch_shapes=[pltpu.VMEM((bk, h_), jnp.float32), pltpu.VMEM((bk, h_), jnp.float32)],
      ),
      out_shape=[jax.ShapeDtypeStruct(kc_t.shape, kc_t.dtype),
                 jax.ShapeDtypeStruct(vc_t.shape, vc_t.dtype)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=(_PAR,) * 3 + (_ARB,) * 3),
      interpret=interpret,
      name="shared_prefix_attention_dkv_context",
  )(lens, q_t, kc_t, vc_t, do_t, lse_t, di_t)


def _dkv_resp(q_t, kr_t, vr_t, do_t, lse_t, di_t, *, fitted, scale, interpret):
  """dK/dV of each response's own keys, summed over the query heads of each kv head."""
  g_, n_, m_, r_, h_ = q_t.shape
  k_ = kr_t.shape[1]
  rep = n_ // k_
  bq, bk = fitted.sizes.block_q_bwd, fitted.sizes.block_kv_bwd

  # Grid (g, kv head, response m, key block j, query head within the group r, query block
  # i). Query blocks entirely before key block j see none of it: they repeat the first
  # block that does, so the pipeline skips their copies.
  def q_map(g, kh, m, j, r, i):
    return g, kh * rep + r, m, jnp.maximum(i, lax.div(j * bk, bq)), 0

  def row_map(g, kh, m, j, r, i):
    return g, kh * rep + r, m, 0, jnp.maximum(i, lax.div(j * bk, bq))

  def k_map(g, kh, m, j, r, i):
    return g, kh, m, j, 0

  q_spec = pl.BlockSpec((None, None, None, bq, h_), q_map)
  row_spec = pl.BlockSpec((None, None, None, 1, bq), row_map)
  k_spec = pl.BlockSpec((None, None, None, bk, h_), k_map)
  return pl.pallas_call(
      functools.partial(_dkv_resp_kernel, scale=scale),
      grid=(g_, k_, m_, r_ // bk, rep, r_ // bq),
      in_specs=[q_spec, k_spec, k_spec, q_spec, row_spec, row_spec],
      out_specs=[k_spec, k_spec],
      scratch_shapes=[pltpu.VMEM((bk, h_), jnp.float32), pltpu.VMEM((bk, h_), jnp.float32)],
      out_shape=[jax.ShapeDtypeStruct(kr_t.shape, kr_t.dtype),
                 jax.ShapeDtypeStruct(vr_t.shape, vr_t.dtype)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=(_PAR,) * 4 + (_ARB,) * 2),
      interpret=interpret,
      name="shared_prefix_attention_dkv_response",
  )(q_t, kr_t, vr_t, do_t, lse_t, di_t)


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
  q_t, kc_t, vc_t, kr_t, vr_t = _to_kernel_layout(q, k_ctx, v_ctx, k_resp, v_resp)
  do_t = do.transpose(0, 3, 1, 2, 4)
  lse_t, di_t = _rows(lse), _rows(di)
  kw = dict(fitted=fitted, scale=scale, interpret=interpret)
  dq = _dq(ctx_lengths, q_t, kc_t, vc_t, kr_t, vr_t, do_t, lse_t, di_t, **kw)
  dkc, dvc = _dkv_ctx(ctx_lengths, q_t, kc_t, vc_t, do_t, lse_t, di_t, **kw)
  dkr, dvr = _dkv_resp(q_t, kr_t, vr_t, do_t, lse_t, di_t, **kw)
  return (dq.transpose(0, 2, 3, 1, 4), dkc.transpose(0, 2, 1, 3), dvc.transpose(0, 2, 1, 3),
          dkr.transpose(0, 2, 3, 1, 4), dvr.transpose(0, 2, 3, 1, 4))
