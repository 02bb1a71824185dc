"""Shared-prefix attention: kernels (Pallas interpreter) and reference vs plain attention.

The plain attention below is written independently of the package: for every (group g,
response i) it builds the sequence [ctx_g[:len_g]; resp_{g,i}] and runs ordinary causal
softmax attention over it, keeping the response rows.

Axis letters: the legend of ``rl_jax/models/transformer.py`` (G groups, M responses per
group, R response length, N query heads, K kv heads, H head dim, P context length).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pallas_kernels
from pallas_kernels import BlockSizes

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _plain_attention(q, k_ctx, v_ctx, k_resp, v_resp, lengths):
  """Causal attention over each concatenated sequence; returns (out, lse) of response rows.

  ``lengths`` is a tuple of Python ints (one per group).
  """
  g_, m_, r_, n_, h_ = q.shape
  rep = n_ // k_ctx.shape[2]
  outs, lses = [], []
  for g in range(g_):
    ln = lengths[g]  # a Python int: the sequence length is static
    for i in range(m_):
      k = jnp.concatenate([k_ctx[g, :ln], k_resp[g, i]], axis=0).astype(jnp.float32)
      v = jnp.concatenate([v_ctx[g, :ln], v_resp[g, i]], axis=0).astype(jnp.float32)
      k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)  # [S,N,H], S = ln + R
      qi = q[g, i].astype(jnp.float32)  # [R,N,H], positions ln .. ln+R-1
      s = jnp.einsum("rnh,snh->nrs", qi, k) / np.sqrt(h_)
      visible = np.arange(ln + r_)[None, :] <= (ln + np.arange(r_))[:, None]
      s = jnp.where(visible[None], s, -jnp.inf)
      lse = jax.scipy.special.logsumexp(s, axis=-1)  # [N,R]
      outs.append(jnp.einsum("nrs,snh->rnh", jnp.exp(s - lse[..., None]), v))
      lses.append(lse.T)
  out = jnp.stack(outs).reshape(q.shape).astype(q.dtype)
  return out, jnp.stack(lses).reshape(g_, m_, r_, n_)


def _inputs(seed, g, m, r, n, k, h, p, dtype):
  """Random inputs (dict in argument order) and loss weights for out and lse."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
  args = dict(q=normal(g, m, r, n, h), k_ctx=normal(g, p, k, h), v_ctx=normal(g, p, k, h),
              k_resp=normal(g, m, r, k, h), v_resp=normal(g, m, r, k, h))
  w_out = jnp.asarray(rng.standard_normal((g, m, r, n, h), np.float32))
  return args, w_out, jnp.asarray(rng.standard_normal((g, m, r, n), np.float32))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _loss_and_grads(attn, args, lengths, w_out, w_lse):
  """Value and gradients (wrt all five float inputs) of sum(w_out*out) + sum(w_lse*lse).

  ``lengths`` is a static tuple (or None): it becomes a constant inside the jitted function.
  """
  def loss(q, k_ctx, v_ctx, k_resp, v_resp):
    out, lse = attn(q, k_ctx, v_ctx, k_resp, v_resp, lengths)
    return (jnp.sum(w_out * out.astype(jnp.float32)) + jnp.sum(w_lse * lse)), (out, lse)
  (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=range(5), has_aux=True)(
      *(args[k] for k in ("q", "k_ctx", "v_ctx", "k_resp", "v_resp")))
  return out, lse, grads


def _assert_close(actual, expected, tol, what):
  actual = np.asarray(actual, np.float32)
  expected = np.asarray(expected, np.float32)
  assert np.all(np.isfinite(actual)), what
  err = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-6)
  assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def _check_against_plain(attn, shape, lengths, dtype, seed=0):
  g, m, r, n, k, h, p = shape
  args, w_out, w_lse = _inputs(seed, g, m, r, n, k, h, p, dtype)
  full = (p,) * g if lengths is None else tuple(lengths)
  expected = _loss_and_grads(_plain_attention, args, full, w_out, w_lse)
  got = _loss_and_grads(attn, args, None if lengths is None else tuple(lengths), w_out, w_lse)
  tol = TOL[dtype]
  _assert_close(got[0], expected[0], tol, "out")
  _assert_close(got[1], expected[1], tol, "lse")
  for name, a, b in zip(("dq", "dk_ctx", "dv_ctx", "dk_resp", "dv_resp"), got[2], expected[2]):
    assert a.dtype == dtype, name
    _assert_close(a, b, tol, name)


def _as_array(lengths):
  return None if lengths is None else jnp.asarray(lengths, jnp.int32)


def _kernel(backend, sizes):
  def attn(q, k_ctx, v_ctx, k_resp, v_resp, lengths):
    return pallas_kernels.shared_prefix_attention_lse(
        q, k_ctx, v_ctx, k_resp, v_resp, _as_array(lengths), interpret=True, backend=backend,
        block_sizes=sizes)
  return attn


def _reference(q, k_ctx, v_ctx, k_resp, v_resp, lengths):
  return pallas_kernels.shared_prefix_attention_reference(
      q, k_ctx, v_ctx, k_resp, v_resp, _as_array(lengths), return_lse=True)


# (G, M, R, N, K, H, P), ctx_lengths, block sizes. R and P are not multiples of the
# blocks; lengths below P (including an empty context); GQA 2 and 4; M = 1.
TPU_CASES = [
    ((2, 3, 20, 2, 1, 16, 27), [27, 11], BlockSizes(8, 8, 8, 8)),
    ((1, 1, 40, 4, 1, 8, 13), None, BlockSizes(16, 8, 8, 16)),
    ((2, 2, 9, 2, 2, 16, 8), [0, 5], BlockSizes(8, 8, 8, 8)),
]
GPU_CASES = [
    ((2, 3, 20, 2, 1, 16, 37), [37, 11], BlockSizes(16, 16, 16, 16)),
    ((1, 1, 40, 4, 1, 32, 16), None, BlockSizes(32, 16, 16, 32)),
    ((2, 2, 9, 2, 2, 16, 8), [0, 5], BlockSizes(16, 16, 16, 16)),
]


@pytest.mark.parametrize("shape,lengths,sizes", TPU_CASES)
def test_tpu_kernel_matches_plain_attention(shape, lengths, sizes):
  _check_against_plain(_kernel("tpu", sizes), shape, lengths, jnp.float32)


@pytest.mark.parametrize("shape,lengths,sizes", GPU_CASES)
def test_gpu_kernel_matches_plain_attention(shape, lengths, sizes):
  _check_against_plain(_kernel("gpu", sizes), shape, lengths, jnp.float32)


@pytest.mark.parametrize("backend,sizes", [("tpu", BlockSizes(8, 8, 8, 8)),
                                           ("gpu", BlockSizes(16, 16, 16, 16))])
def test_kernels_bf16(backend, sizes):
  _check_against_plain(_kernel(backend, sizes), (2, 2, 16, 2, 1, 16, 21), [21, 7],
                       jnp.bfloat16)


@pytest.mark.parametrize("shape,lengths,sizes", TPU_CASES)
def test_reference_matches_plain_attention(shape, lengths, sizes):
  del sizes
  _check_against_plain(_reference, shape, lengths, jnp.float32)


@settings(max_examples=3, deadline=None)
@given(g=st.integers(1, 2), m=st.integers(1, 2), r=st.integers(1, 12), k=st.integers(1, 2),
       rep=st.sampled_from([1, 2]), h=st.sampled_from([4, 8]), p=st.integers(1, 10),
       data=st.data())
def test_reference_matches_plain_attention_random_shapes(g, m, r, k, rep, h, p, data):
  lengths = data.draw(st.lists(st.integers(0, p), min_size=g, max_size=g))
  _check_against_plain(_reference, (g, m, r, k * rep, k, h, p), lengths, jnp.float32)


def test_auto_backend_on_cpu_is_reference_and_jits():
  args, _, _ = _inputs(1, 2, 2, 8, 2, 1, 8, 6, jnp.float32)
  lengths = jnp.array([6, 3], jnp.int32)
  plain = jax.jit(_plain_attention, static_argnums=5)  # one program, not op by op
  expected = plain(*args.values(), (6, 3))[0]
  fn = jax.jit(pallas_kernels.shared_prefix_attention)  # lengths traced: no value check
  _assert_close(fn(*args.values(), lengths), expected, 1e-5, "auto")
  interp = pallas_kernels.shared_prefix_attention(*args.values(), lengths, interpret=True)
  _assert_close(interp, expected, 1e-5, "auto, interpret")


def _good():
  args, _, _ = _inputs(2, 2, 2, 4, 4, 2, 8, 5, jnp.float32)
  return args


def _call(**changes):
  args = _good()
  lengths = changes.pop("ctx_lengths", None)
  kwargs = {k: changes.pop(k) for k in ("backend", "interpret", "block_sizes") if k in changes}
  args.update(changes)
  return pallas_kernels.shared_prefix_attention(*args.values(), lengths, **kwargs)


@pytest.mark.parametrize("changes,message", [
    (dict(q=jnp.zeros((2, 2, 4, 4))), "q must have 5 dims"),
    (dict(v_ctx=jnp.zeros((2, 6, 2, 8))), "v_ctx shape"),
    (dict(k_ctx=jnp.zeros((3, 5, 2, 8)), v_ctx=jnp.zeros((3, 5, 2, 8))), "k_ctx shape"),
    (dict(k_resp=jnp.zeros((2, 2, 3, 2, 8))), "k_resp shape"),
    (dict(v_resp=jnp.zeros((2, 2, 4, 2, 4))), "v_resp shape"),
    (dict(q=jnp.zeros((2, 2, 4, 3, 8))), "multiple of kv heads"),
    (dict(q=jnp.zeros((2, 2, 4, 4, 8), jnp.bfloat16)), "share one dtype"),
    (dict(q=jnp.zeros((2, 2, 4, 4, 8), jnp.int32), k_ctx=jnp.zeros((2, 5, 2, 8), jnp.int32),
          v_ctx=jnp.zeros((2, 5, 2, 8), jnp.int32), k_resp=jnp.zeros((2, 2, 4, 2, 8), jnp.int32),
          v_resp=jnp.zeros((2, 2, 4, 2, 8), jnp.int32)), "dtype must be"),
    (dict(ctx_lengths=jnp.array([5], jnp.int32)), "ctx_lengths must have shape"),
    (dict(ctx_lengths=jnp.array([5.0, 1.0])), "ctx_lengths must be integers"),
    (dict(ctx_lengths=jnp.array([6, 1], jnp.int32)), r"ctx_lengths must lie in \[0, P=5\]"),
    (dict(ctx_lengths=jnp.array([-1, 1], jnp.int32)), r"ctx_lengths must lie in \[0, P=5\]"),
    (dict(backend="cuda"), "backend must be one of"),
    (dict(interpret="yes"), "interpret must be a bool"),
    (dict(backend="gpu", interpret=True, block_sizes=BlockSizes(8, 8, 8, 8)),
     "GPU block sizes must be powers of two"),
    (dict(backend="tpu", interpret=True, block_sizes=BlockSizes(24, 16, 16, 16)),
     "must divide the largest"),
    (dict(backend="tpu", interpret=True, block_sizes=(8, 8, 8, 8)), "must be a BlockSizes"),
])
def test_bad_inputs_raise(changes, message):
  with pytest.raises(ValueError, match=message):
    _call(**changes)


def test_gpu_kernel_rejects_odd_head_dim():
  args, _, _ = _inputs(3, 1, 1, 4, 1, 1, 24, 4, jnp.float32)
  with pytest.raises(ValueError, match="power-of-two head dim"):
    pallas_kernels.shared_prefix_attention(*args.values(), backend="gpu", interpret=True)


def test_block_sizes_must_be_multiples_of_8():
  with pytest.raises(ValueError, match="multiple of 8"):
    BlockSizes(12, 8, 8, 8)


def test_reference_is_the_two_region_attention():
  """The reference backend is ``lse_attention.two_region_attention`` (query-major), bit for
  bit: one implementation of the context + own-keys log-sum-exp attention."""
  args, _, _ = _inputs(4, 2, 3, 7, 4, 2, 8, 6, jnp.float32)
  lengths = jnp.array([6, 2], jnp.int32)
  out, lse = pallas_kernels.shared_prefix_attention_reference(*args.values(), lengths,
                                                              return_lse=True)
  r, p = 7, 6
  causal = (jnp.arange(r)[None, :] <= jnp.arange(r)[:, None])[None, None]
  ctx_mask = (jnp.arange(p) < lengths[:, None])[:, None, None, :]
  two = jax.jit(functools.partial(pallas_kernels.two_region_attention, layout="query_major"))
  o2, l2 = two(args["q"], args["k_resp"], args["v_resp"], causal, args["k_ctx"], args["v_ctx"],
               ctx_mask)
  chex.assert_shape(o2, (2, 3, 7, 2, 2, 8))
  chex.assert_shape(l2, (2, 3, 7, 2, 2))
  np.testing.assert_array_equal(out, o2.reshape(out.shape))
  np.testing.assert_array_equal(lse, l2.reshape(lse.shape))


def test_two_region_layouts_agree_and_empty_rows_are_zero():
  args, _, _ = _inputs(5, 2, 2, 5, 4, 2, 8, 4, jnp.float32)

  @jax.jit  # the masks and both layouts: one program, not op by op
  def both(args):
    own_mask = (jnp.arange(5)[None, :] <= jnp.arange(5)[:, None])[None, None]
    own_mask = own_mask & (jnp.arange(2)[:, None, None, None] == 0)  # group 1 sees no own key
    ctx_mask = (jnp.arange(4) < jnp.array([4, 0])[:, None])[:, None, None, :]  # group 1: no ctx
    call = lambda layout: pallas_kernels.two_region_attention(
        args["q"], args["k_resp"], args["v_resp"], own_mask, args["k_ctx"], args["v_ctx"],
        ctx_mask, layout=layout)
    return call("query_major"), call("head_major")

  (oq, lq), (oh, lh) = both(args)
  chex.assert_trees_all_equal_shapes_and_dtypes((oq, lq), (oh, lh))
  np.testing.assert_allclose(oh, oq, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(lh, lq, rtol=1e-6)
  assert np.all(np.asarray(oq[1]) == 0) and np.all(np.isneginf(np.asarray(lq[1])))
  expected, _ = jax.jit(_plain_attention, static_argnums=5)(*args.values(), (4, 4))
  _assert_close(oq[0].reshape(expected[0].shape), expected[0], 1e-5, "group 0")


def test_merge_partials_of_one_region_is_that_region():
  rng = np.random.default_rng(6)
  out = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
  lse = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
  merged, total = pallas_kernels.merge_partials([out], [lse], return_lse=True)
  np.testing.assert_array_equal(merged, out)
  np.testing.assert_array_equal(total, lse)


def test_tpu_kernels_compile_in_bf16_under_the_highest_matmul_precision():
  """The Mosaic kernels (forward and the three backward kernels) compile for a v5e chip in
  bf16 while ``jax_default_matmul_precision`` is "highest" (as this test suite sets it):
  their 16-bit products ask for the native precision, which Mosaic accepts, where a float32
  contract precision on bf16 operands is rejected."""
  pytest.importorskip("libtpu", reason="libtpu is part of the test extra")
  from rl_jax.train import topology  # pylint: disable=import-outside-toplevel
  assert jax.config.jax_default_matmul_precision == "highest"
  device = topology.topology_devices("v5e:1x1")[0]
  spec = lambda *shape: jax.ShapeDtypeStruct(
      shape, jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(device))
  G, M, R, N, K, H, P = 1, 4, 256, 8, 2, 128, 512
  args = (spec(G, M, R, N, H), spec(G, P, K, H), spec(G, P, K, H), spec(G, M, R, K, H),
          spec(G, M, R, K, H))
  lengths = jax.ShapeDtypeStruct((G,), jnp.int32,
                                 sharding=jax.sharding.SingleDeviceSharding(device))

  def loss(*a):
    out = pallas_kernels.shared_prefix_attention(*a, backend="tpu")
    return jnp.sum(out.astype(jnp.float32))

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  compiled = grads.lower(*args, lengths).compile()
  assert len(topology.mosaic_kernels(compiled.as_text())) == 4
