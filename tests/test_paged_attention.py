"""Paged decode attention: reference vs plain numpy, kernels (Pallas interpreter) vs the
reference, the Mosaic compile for a TPU chip and the Triton lowering for CUDA.

The plain computation below is written independently of the package: for every row it
copies the row's pages out of the pool one by one into a contiguous [K,H,nb·S] / [K,nb·S,H]
cache and runs a masked softmax in float64.

Axis letters: the legend of ``rl_jax/__init__.py`` (B rows, K kv heads, J query heads per kv
head, H head dim); Pg pool pages, S page size, nb page-table entries of a row.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.triton import pallas_call_registration as triton_registration

import pallas_kernels
from pallas_kernels import paged_attention
from rl_jax.train import topology

A = jax.ShapeDtypeStruct
_gpu_attention = paged_attention._gpu_attention  # pylint: disable=protected-access
_tpu_attention = paged_attention._tpu_attention  # pylint: disable=protected-access


def _plain(q, k_pages, v_pages, table, start, length, scale):
  """float64 numpy (out [B,K,J,H], lse [B,K,J]) over each row's valid positions."""
  q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
  table, start, length = (np.asarray(x) for x in (table, start, length))
  b_, k_, j_, h_ = q.shape
  s_, nb = k_pages.shape[-1], table.shape[1]
  out = np.zeros((b_, k_, j_, h_))
  lse = np.full((b_, k_, j_), -np.inf)
  for b in range(b_):
    keys = np.zeros((k_, h_, nb * s_))
    values = np.zeros((k_, nb * s_, h_))
    valid = np.zeros(nb * s_, bool)
    for e in range(nb):
      page = table[b, e]
      if page < 0:
        continue
      keys[:, :, e * s_:(e + 1) * s_] = k_pages[page]
      values[:, e * s_:(e + 1) * s_, :] = v_pages[page]
      for i in range(s_):
        valid[e * s_ + i] = start[b] <= e * s_ + i < length[b]
    if not valid.any():
      continue
    for kh in range(k_):
      scores = scale * q[b, kh] @ keys[kh][:, valid]  # [J, valid]
      top = scores.max(axis=1, keepdims=True)
      w = np.exp(scores - top)
      out[b, kh] = (w / w.sum(axis=1, keepdims=True)) @ values[kh][valid]
      lse[b, kh] = top[:, 0] + np.log(w.sum(axis=1))
  return out, lse


def _case(seed, b_, k_, j_, h_, s_, nb, pg, start, length, dtype=jnp.float32, holes=(),
          shared=False):
  """Random q / pools and a shuffled page table: entries holding a position below
  ``length`` get pages (rows share pages when ``shared``), the rest -1; ``holes`` (b, e)
  entries are set to -1."""
  rng = np.random.default_rng(seed)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32)).astype(dtype)
  table = np.full((b_, nb), -1, np.int32)
  ids = rng.permutation(pg)
  used = 0
  for b in range(b_):
    for e in range(-(-length[b] // s_)):
      table[b, e] = rng.integers(pg) if shared else ids[used]
      used += 1
  for b, e in holes:
    table[b, e] = -1
  return (normal(b_, k_, j_, h_), normal(pg, k_, h_, s_), normal(pg, k_, s_, h_),
          jnp.asarray(table), jnp.asarray(start, jnp.int32), jnp.asarray(length, jnp.int32))


def _close(got, expected, atol):
  assert got[0].dtype == got[1].dtype == jnp.float32
  out, lse = (np.asarray(x, np.float64) for x in got)
  e_out, e_lse = expected
  np.testing.assert_allclose(out, e_out, atol=atol, rtol=0)
  assert np.array_equal(np.isneginf(lse), np.isneginf(e_lse))
  np.testing.assert_allclose(np.where(np.isfinite(e_lse), lse, 0),
                             np.where(np.isfinite(e_lse), e_lse, 0), atol=atol, rtol=0)


# (seed, B, K, J, H, S, nb, Pg, start, length, holes). Rows: full, sliding window, empty
# (length 0), window past an unfilled tail (-1 entries past the length), a -1 entry inside
# [start, length), a single position.
REFERENCE_CASES = [
    (0, 4, 2, 3, 8, 1, 6, 40, [0, 2, 0, 1], [6, 5, 0, 3], ()),
    (1, 4, 1, 2, 8, 4, 4, 24, [0, 3, 0, 10], [16, 13, 0, 11], ()),
    (2, 3, 2, 1, 16, 8, 3, 12, [0, 9, 4], [20, 24, 12], [(2, 1)]),
    (3, 2, 2, 4, 8, 16, 2, 6, [0, 31], [17, 32], ()),
]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=lambda c: f"S{c[5]}")
def test_reference_matches_plain_numpy(case):
  seed, b_, k_, j_, h_, s_, nb, pg, start, length, holes = case
  args = _case(seed, b_, k_, j_, h_, s_, nb, pg, start, length, holes=holes)
  expected = _plain(*args, 0.3)
  got = pallas_kernels.paged_decode_reference(*args, scale=0.3)
  _close(got, expected, 1e-5)
  assert np.all(np.asarray(got[0])[np.asarray(length) == 0] == 0)


# (seed, B, K, J, H, S, nb, Pg, start, length, holes, shared pages)
KERNEL_CASES = [
    # shuffled pages, one row empty, a sliding window, a row ending mid-page
    (4, 4, 2, 4, 16, 8, 4, 24, [0, 11, 0, 0], [32, 29, 0, 9], [], False),
    # pages shared between rows, a -1 inside the window, J = 3, a window wholly past
    # the first pages
    (5, 3, 2, 3, 8, 4, 5, 9, [2, 13, 0], [20, 19, 7], [(0, 2)], True),
]


def _kernel(platform, keys_by_row=False):
  def attn(*args):
    return pallas_kernels.paged_decode_attention(*args, scale=0.25, platform=platform,
                                                 interpret=True, keys_by_row=keys_by_row)
  return attn


@pytest.mark.parametrize("platform,keys_by_row", [("tpu", False), ("tpu", True),
                                                  ("gpu", False)],
                         ids=["tpu", "tpu-keys-by-row", "gpu"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=["window", "shared"])
def test_kernel_matches_reference(platform, keys_by_row, case):
  """``keys_by_row``: the TPU kernel reads the key pages as [S,H] (the pool's last two axes
  swapped, as ``rollout.decode`` passes a pool that XLA:TPU lays out with H minor)."""
  seed, b_, k_, j_, h_, s_, nb, pg, start, length, holes, shared = case
  args = _case(seed, b_, k_, j_, h_, s_, nb, pg, start, length, holes=holes, shared=shared)
  expected = pallas_kernels.paged_decode_reference(*args, scale=0.25)
  got = _kernel(platform, keys_by_row)(*args)
  _close(got, [np.asarray(x, np.float64) for x in expected], 1e-5)


def test_gpu_kernel_dot_path_matches_reference():
  """H and S of at least 16: the Triton kernel's dot path (query heads padded to 16)."""
  args = _case(6, 3, 1, 2, 16, 16, 3, 8, [0, 20, 0], [40, 48, 0])
  expected = pallas_kernels.paged_decode_reference(*args, scale=0.25)
  _close(_kernel("gpu")(*args), [np.asarray(x, np.float64) for x in expected], 1e-5)


_KERNELS = {"gpu": _gpu_attention, "tpu": _tpu_attention}


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("h_,s_,block", [(8, 16, 4), (16, 64, 16)], ids=["sum", "dot"])
def test_kernel_reads_a_long_page_in_key_blocks(platform, h_, s_, block):
  """Pages longer than the kernel's key block (one worst-case page per sample) are read a
  block at a time (the Triton kernel's loop steps, the Mosaic kernel's grid steps): rows
  starting and ending mid-block and mid-page, a sliding window that skips whole blocks, an
  empty row, a -1 entry."""
  args = _case(9, 4, 2, 3, h_, s_, 3, 9, [0, s_ + block + 1, 0, 2], [3 * s_, 2 * s_ + 3, 0,
                                                                       s_ - 1], holes=[(0, 1)])
  expected = _plain(*args, 0.25)
  got = _KERNELS[platform](*args, scale=0.25, interpret=True, block=block)
  _close(got, expected, 1e-5)
  assert paged_attention.gpu_key_block(8192) == 64 and paged_attention.gpu_key_block(16) == 16
  assert paged_attention.tpu_key_block(32768) == 512 and paged_attention.tpu_key_block(64) == 64


@pytest.mark.parametrize("platform,block", [("gpu", 64), ("tpu", 512)])
def test_kernel_gives_the_same_bits_for_any_page_size_of_its_key_block_or_more(platform,
                                                                                block):
  """The same rows' keys paged by the kernel's key block (64 keys on GPU, 512 on TPU) and
  held as one page of 4 blocks per row (the worst-case slot layout): the kernel folds the
  same key blocks in the same order, so the outputs are bit-identical (sampling draws the
  same tokens whatever ``page_size`` of at least one block)."""
  b_, k_, j_, h_, n = 3, 2, 2, 16, 4 * block
  rng = np.random.default_rng(10)
  q = jnp.asarray(rng.standard_normal((b_, k_, j_, h_), np.float32))
  keys = rng.standard_normal((b_, k_, h_, n), np.float32)
  values = rng.standard_normal((b_, k_, n, h_), np.float32)
  start = jnp.asarray([0, block + 6, 5], jnp.int32)
  length = jnp.asarray([n, 3 * block + 8, block], jnp.int32)
  outs = []
  for s_ in (block, n):
    per = n // s_  # pages per row, rows' pages interleaved in the pool
    pk = keys.reshape(b_, k_, h_, per, s_).transpose(3, 0, 1, 2, 4).reshape(-1, k_, h_, s_)
    pv = values.reshape(b_, k_, per, s_, h_).transpose(2, 0, 1, 3, 4).reshape(-1, k_, s_, h_)
    table = jnp.asarray(np.arange(per)[None, :] * b_ + np.arange(b_)[:, None], jnp.int32)
    outs.append(_KERNELS[platform](q, jnp.asarray(pk), jnp.asarray(pv), table, start, length,
                                   scale=0.25, interpret=True))
  assert all(np.array_equal(a, b) for a, b in zip(*outs))
  one_page_each = np.arange(b_, dtype=np.int32)[:, None]
  _close(outs[0], _plain(q, keys, values, one_page_each, start, length, 0.25), 1e-5)


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("h_,s_,block", [(8, 16, 4), (16, 64, 16)], ids=["sum", "dot"])
def test_gpu_kernel_splits_a_row_over_programs(h_, s_, block, splits):
  """``splits`` C > 1: each row's live key blocks cut into C consecutive runs, one program
  each, merged by log-sum-exp. Rows: the whole table (12 blocks), a window starting and
  ending mid-block, a row of fewer live blocks than programs (some programs empty), an empty
  row, a -1 entry inside a row."""
  args = _case(11, 5, 2, 3, h_, s_, 3, 15, [0, block + 3, 2, 0, 0],
               [3 * s_, 2 * s_ + block + 5, 2 * block, 0, 2 * s_ + 1], holes=[(4, 1)])
  expected = _plain(*args, 0.25)
  got = _gpu_attention(*args, scale=0.25, interpret=True, block=block, splits=splits)
  _close(got, expected, 1e-5)
  via_api = pallas_kernels.paged_decode_attention(*args, scale=0.25, platform="gpu",
                                                  interpret=True, splits=splits)
  _close(via_api, expected, 1e-5)


def test_gpu_splits_fill_the_multiprocessors_with_enough_blocks_each():
  """``splits="auto"``: the smallest power of two giving two programs per multiprocessor,
  or the largest that leaves every program 8 of the table's key blocks."""
  cases = [((16 * 8, 128, 132), 4),  # 16 rows of one 8192-key page, 8 kv heads, an H200
           ((64 * 8, 128, 132), 1),  # already 512 programs
           ((16 * 8, 8, 132), 1),  # 8 blocks: too few to share
           ((1, 1024, 132), 128),  # one row, one kv head: 128 programs of 8 blocks
           ((4, 1 << 20, 108), 64)]
  assert [paged_attention.gpu_splits(*a) for a, _ in cases] == [c for _, c in cases]


def test_tpu_kernel_bf16_and_mixed_dtypes():
  args = _case(7, 2, 2, 2, 16, 8, 3, 8, [0, 5], [24, 17], dtype=jnp.bfloat16)
  expected = _plain(*args, 0.25)
  _close(_kernel("tpu")(*args), expected, 2e-2)
  mixed = (args[0].astype(jnp.float32), *args[1:])  # float32 queries on bf16 pages
  _close(_kernel("tpu")(*mixed), _plain(*mixed, 0.25), 1e-5)


def test_platform_dispatch_and_merge_with_a_prompt_part():
  """On this CPU host the default is the reference; under ``target_platform("tpu")`` (and
  ``interpret``) the Mosaic kernel. Merged by ``merge_partials`` with a prompt part, the
  result is attention over prompt + valid response keys; an empty response part leaves the
  prompt part unchanged."""
  args = _case(8, 3, 1, 2, 8, 4, 3, 10, [0, 5, 0], [12, 9, 0])
  ref = pallas_kernels.paged_decode_reference(*args, scale=0.5)
  default = pallas_kernels.paged_decode_attention(*args, scale=0.5)
  for a, b in zip(default, ref):
    np.testing.assert_array_equal(a, b)
  with pallas_kernels.target_platform("tpu"):
    assert "pallas_call" in str(jax.make_jaxpr(
        lambda *a: pallas_kernels.paged_decode_attention(*a, scale=0.5, interpret=True))(*args))
  assert "pallas_call" not in str(jax.make_jaxpr(
      lambda *a: pallas_kernels.paged_decode_attention(*a, scale=0.5))(*args))

  q, k_pages, v_pages, table, start, length = args
  rng = np.random.default_rng(9)
  k_pre = rng.standard_normal((3, 1, 8, 5))  # [B,K,H,P] prompt keys, length-last
  v_pre = rng.standard_normal((3, 1, 5, 8))
  s_pre = 0.5 * np.einsum("bkjh,bkhp->bkjp", np.asarray(q, np.float64), k_pre)
  lse_pre = np.log(np.exp(s_pre).sum(-1))
  out_pre = np.einsum("bkjp,bkph->bkjh", np.exp(s_pre - lse_pre[..., None]), v_pre)
  merged = np.asarray(jax.jit(pallas_kernels.merge_partials)(  # one program, not op by op
      [jnp.asarray(out_pre, jnp.float32), ref[0]], [jnp.asarray(lse_pre, jnp.float32), ref[1]]))
  # numpy copies for the numpy computation below (jax indexing would compile op by op)
  q, k_pages, v_pages, table, start, length = (np.asarray(x) for x in args)
  # the whole attention: prompt keys then the row's valid response keys, in numpy
  for b in range(3):
    resp = [(table[b, i // 4], i % 4) for i in range(int(start[b]), int(length[b]))]
    keys = np.concatenate([k_pre[b, 0].T] + [np.asarray(k_pages[p, 0, :, o])[None]
                                              for p, o in resp])
    vals = np.concatenate([v_pre[b, 0]] + [np.asarray(v_pages[p, 0, o])[None] for p, o in resp])
    s = 0.5 * np.asarray(q[b, 0], np.float64) @ keys.T
    w = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(merged[b, 0], (w / w.sum(-1, keepdims=True)) @ vals, atol=1e-5)
  np.testing.assert_allclose(merged[2], out_pre[2], atol=1e-6)  # length 0: prompt only


@pytest.mark.parametrize("changes,message", [
    (dict(q=jnp.zeros((2, 1, 2))), "q must have 4 dims"),
    (dict(k_pages=jnp.zeros((6, 1, 4, 4))), "k_pages shape"),
    (dict(v_pages=jnp.zeros((6, 1, 8, 4))), "v_pages shape"),
    (dict(k_pages=jnp.zeros((6, 1, 8, 3)), v_pages=jnp.zeros((6, 1, 3, 8))), "power of two"),
    (dict(start=jnp.zeros((3,), jnp.int32)), "B=2 rows"),
    (dict(table=jnp.zeros((2, 2))), "table must be integers"),
    (dict(platform="metal"), "platform must be one of"),
    (dict(splits=0), "splits must be a positive int or 'auto'"),
    (dict(splits="many"), "splits must be a positive int or 'auto'"),
    (dict(platform="gpu", q=jnp.zeros((2, 1, 2, 12)), k_pages=jnp.zeros((6, 1, 12, 4)),
          v_pages=jnp.zeros((6, 1, 4, 12))), "power-of-two head dim"),
])
def test_bad_inputs_raise(changes, message):
  args = dict(zip(("q", "k_pages", "v_pages", "table", "start", "length"),
                  _case(10, 2, 1, 2, 8, 4, 2, 6, [0, 0], [8, 3])))
  kwargs = {k: changes.pop(k) for k in ("platform", "splits") if k in changes}
  args.update(changes)
  with pytest.raises(ValueError, match=message):
    pallas_kernels.paged_decode_attention(*args.values(), scale=1.0, **kwargs)


# ---------------------------------------------------------------------------------------
# Compiling and lowering for the real targets (shapes only, no data).

# B=16 rows, K=8 kv heads, J=4, H=128, pages of S=64 tokens, nb=8 entries, Pg=256 pages.
REAL = (16, 8, 4, 128, 64, 8, 256)


def _abstract(b_, k_, j_, h_, s_, nb, pg, dtype=jnp.bfloat16, sharding=None):
  spec = lambda shape, dt: A(shape, dt, sharding=sharding)
  return (spec((b_, k_, j_, h_), dtype), spec((pg, k_, h_, s_), dtype),
          spec((pg, k_, s_, h_), dtype), spec((b_, nb), jnp.int32), spec((b_,), jnp.int32),
          spec((b_,), jnp.int32))


def _attention_for(platform, h_, keys_by_row=False, splits=1):
  def attn(*args):
    return pallas_kernels.paged_decode_attention(*args, scale=h_ ** -0.5, platform=platform,
                                                 keys_by_row=keys_by_row, splits=splits)
  return attn


# one page of 32K tokens per row (the worst-case slot layout at 32K new tokens): read whole,
# its K/V blocks overflowed the v5e's scoped VMEM; read in key blocks it compiles
LONG_PAGE = (16, 8, 4, 128, 32768, 1, 8)


@pytest.mark.parametrize("shape,keys_by_row", [(REAL, False), (REAL, True),
                                               (LONG_PAGE, False)],
                         ids=["pages", "pages-keys-by-row", "one-32k-page"])
def test_tpu_kernel_compiles_with_mosaic_for_a_v5e_chip(shape, keys_by_row):
  pytest.importorskip("libtpu", reason="libtpu is part of the test extra")
  device = topology.topology_devices("v5e:1x1")[0]
  args = _abstract(*shape, sharding=jax.sharding.SingleDeviceSharding(device))
  compiled = jax.jit(_attention_for("tpu", shape[3], keys_by_row)).lower(*args).compile()
  assert topology.mosaic_kernels(compiled.as_text()) == ["paged_decode_attention"]
  out, lse = compiled.out_info
  assert out.shape == shape[:4] and lse.shape == shape[:3]
  assert out.dtype == lse.dtype == jnp.float32


_TRITON = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("shape,splits", [(REAL, 1), ((4, 2, 3, 64, 8, 4, 16), 1),
                                          (LONG_PAGE, "auto")],
                         ids=["dot", "small", "one-32k-page-split"])
def test_gpu_kernel_lowers_for_cuda(shape, splits, monkeypatch):
  """jax.export for CUDA, with MLIR's verifier run on the Triton module Pallas builds (the
  long rows split over programs: 16 rows x 8 kv heads x 4 programs)."""
  lowering = triton_registration.lowering
  lower = lowering.lower_jaxpr_to_triton_module
  verified = []

  def lower_and_verify(*a, **kw):
    result = lower(*a, **kw)
    result.module.operation.verify()
    verified.append(True)
    return result

  monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
  exported = jax.export.export(
      jax.jit(_attention_for("gpu", shape[3], splits=splits)), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON)])(
          *_abstract(*shape))
  assert exported.mlir_module().count(_TRITON) == 1 and verified == [True]
  assert [a.shape for a in exported.out_avals] == [shape[:4], shape[:3]]


def test_block_index_map_skips_blocks_outside_the_window():
  """The key block the TPU kernel's K/V blocks hold at each grid step: blocks before the
  live range repeat the first live one, blocks past it the last one (no copy), an empty
  row stays on one block."""
  entry = paged_attention._block_entry  # pylint: disable=protected-access
  # (start, length) with blocks of 8 keys, 4 of them
  for (start, length), expect in [((9, 27), [1, 1, 2, 3]), ((0, 5), [0, 0, 0, 0]),
                                   ((0, 0), [0, 0, 0, 0]), ((16, 16), [1, 1, 1, 1]),
                                   ((0, 99), [0, 1, 2, 3]), ((40, 50), [3, 3, 3, 3])]:
    got = [int(entry(jnp.int32(p), jnp.int32(start), jnp.int32(length), 4, 8))
           for p in range(4)]
    assert got == expect, (start, length, got)
