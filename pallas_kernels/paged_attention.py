"""Paged decode attention: one query token per row over its response K/V pages, with lse.

Each row (one sample being decoded) has its response K/V spread over fixed-size pages of a
shared pool; a page table lists the row's pages in order. For each query head the kernel
computes softmax(scale · q·k) · v over the row's valid positions ``start <= pos < length``
and the log-sum-exp of those scores, so the caller can merge the result with attention over
other keys it computes separately (``lse_attention.merge_partials``).

The prompt a group of samples shares is not read here: the caller attends it once per group
(its K/V are stored once, not per sample) and merges that partial result with this one by
log-sum-exp; this kernel only walks each sample's own pages.

Layouts (the pool layout of ``rl_jax/rollout/pages.py``):
  q        [B,K,J,H]      any float dtype
  k_pages  [Pg,K,H,S]     keys length-last: a page holds one kv head's keys as [H,S]
                          (``keys_by_row``: the TPU kernel reads them as [S,H], for a pool
                          laid out with H minor)
  v_pages  [Pg,K,S,H]
  table    int32 [B,nb]   page ids of each row's first nb pages; entry p holds positions
                          p·S .. p·S+S-1 of the row; -1 = no page (its positions
                          are never valid)
  start, length  int32 [B] valid positions of row b: start[b] <= pos < length[b]
  out      float32 [B,K,J,H]   normalised over the valid positions (0 where none)
  lse      float32 [B,K,J]     log sum exp(scale · q·k) over them (-inf where none)
The empty-row convention is ``merge_partials``'s: a part with lse -inf and out 0 has weight
exp(-inf - lse) = 0 in the merge.

Axis letters (the legend of ``rl_jax/__init__.py``): B rows, K kv heads, J query heads per
kv head, H head dim; here also Pg pool pages, S page size (tokens per page, a power of two),
nb page-table entries of a row.

Implementations (``platform``; None follows ``shared_prefix_attention.current_platform``):
  "tpu"  Mosaic: grid (B, K, nb·S/Sb) over key blocks of Sb keys (512, or the whole page
         where pages are shorter: ``tpu_key_block``), with the page table, start and length
         scalar-prefetched into SMEM; the K/V block index maps read the page id from the
         table, so the pipeline copies only the row's own pages into VMEM. The block axis is
         sequential ("arbitrary") and carries the online softmax in VMEM scratch; blocks
         wholly outside [start, length) (or without a page) are skipped with ``pl.when``, and
         the index maps of the blocks outside the live range repeat a live block, so no copy
         is issued for them. The blocks do not grow with the page size, and any page size
         of 512 or more gives the same bits.
  "gpu"  Triton: grid (B, K, C); each program loops (``lax.fori_loop``) over its share of
         the row's live key blocks, loading block c of page ``table[b,p]`` from the pool by
         dynamic indexing and keeping the online softmax in registers. A block is 64 keys,
         or the whole page where pages are shorter (``gpu_key_block``), so the tiles do not
         grow with the page size and any page size of 64 or more gives the same bits. With
         ``splits`` C = 1 (the default) one program walks the whole row; with C > 1 the
         row's live blocks are cut into C consecutive runs, one program each, and their C
         partial softmaxes are merged by log-sum-exp after the kernel (split-K decoding:
         a few long rows then occupy C times as many multiprocessors; ``gpu_splits``).
  "cpu"  the jnp reference (``paged_decode_reference``), or with ``interpret=True`` the TPU
         kernel in the Pallas interpreter.

Limits. TPU: blocks are whole [J,H] tiles and [H,Sb], [Sb,H] key blocks (Sb the whole page
below 512 keys, else 512: a multiple of the 128 lanes), so any J, H and S are legal block
shapes; the table (B·nb int32, flattened) with start and length is held in SMEM, which
bounds B·nb; an entry of -1 inside a row's live range is skipped but still copies page 0.
GPU: H and S must be powers of two; with H and the key block Sb >= 16 the products are
dots with J padded to a power of two >= 16 (Triton's smallest dot), below that broadcast
products summed over [J,H,Sb] (small tiles only).
Scores and softmax are float32; 16-bit pages are multiplied natively (probabilities rounded
to the values' dtype for p·V), float32 ones at ``jax_default_matmul_precision``: the online
softmax and its products are the shared-prefix kernels' (``_tiles``).

Why not the kernels JAX ships (``jax.experimental.pallas.ops.tpu`` ``ragged_paged_attention``
and ``paged_attention``, ``ops.gpu.paged_attention``): none returns the log-sum-exp, so none
can be merged with the prompt read once per group; each wants its own pool layout (K and V
interleaved on the head axis, or head-major pages), where this one reads the pool the CPU
path and the page writes use (keys length-last), so one pool serves every backend; and the
ragged TPU kernel reads ``jax.devices()`` for its block sizes, which a TPU compile from a
CPU host (``train/topology.py``) does not have. The cost: a shared page (a fork's, a prompt
on pages) is read once per sample here, not once per group. On one H200 this kernel reads
39% of the HBM bandwidth (docs/BENCHMARKS.md, "NVIDIA H200"); on TPU it is compiled, not
timed.

Reference: Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving
with PagedAttention"; Milakov & Gimelshein 2018, "Online normalizer calculation for
softmax".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _tiles
from pallas_kernels.lse_attention import merge_partials, partial_softmax
from pallas_kernels.shared_prefix_attention import current_platform

__all__ = ["auto_splits", "gpu_splits", "paged_decode_attention", "paged_decode_reference"]

PLATFORMS = ("tpu", "gpu", "cuda", "rocm", "cpu")
_LANES = 128
_GPU_DOT_MIN = 16  # Triton's dot: every side at least 16
_GPU_KEY_BLOCK = 64  # keys the GPU kernel reads per loop step (pages of more are split)
_TPU_KEY_BLOCK = 512  # keys the TPU kernel reads per grid step (pages of more are split)
_GPU_SPLIT_MIN_BLOCKS = 8  # "auto" splits: at least this many key blocks of a row per program
_GPU_CORES = 132  # "auto" splits without a GPU to ask (an H100/H200's multiprocessors)


# ---------------------------------------------------------------------------------------
# Validation and dispatch.


def _check_inputs(q, k_pages, v_pages, table, start, length):
  """Raises ValueError naming the first problem with the (static) shapes and dtypes."""
  names = ("q", "k_pages", "v_pages", "table", "start", "length")
  for name, x, ndim in zip(names, (q, k_pages, v_pages, table, start, length),
                           (4, 4, 4, 2, 1, 1)):
    if not hasattr(x, "shape") or len(x.shape) != ndim:
      raise ValueError(f"{name} must have {ndim} dims, got shape {getattr(x, 'shape', None)}")
  b, k, _, h = q.shape
  pg, s = k_pages.shape[0], k_pages.shape[-1]
  if k_pages.shape != (pg, k, h, s):
    raise ValueError(f"k_pages shape {k_pages.shape} must be [Pg,K,H,S] with K={k}, H={h}")
  if v_pages.shape != (pg, k, s, h):
    raise ValueError(f"v_pages shape {v_pages.shape} must be [Pg,K,S,H] = {(pg, k, s, h)}")
  if s < 1 or s & (s - 1):
    raise ValueError(f"the page size S must be a power of two, got {s}")
  if table.shape[0] != b or start.shape != (b,) or length.shape != (b,):
    raise ValueError(f"table {table.shape}, start {start.shape}, length {length.shape} must "
                     f"have B={b} rows")
  for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be floating point, got {x.dtype}")
  for name, x in (("table", table), ("start", start), ("length", length)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must be integers, got {x.dtype}")


def _resolve(platform: str | None, interpret: bool) -> str:
  """The implementation to run: "tpu", "gpu" or "reference"."""
  if platform is not None and platform not in PLATFORMS:
    raise ValueError(f"platform must be one of {PLATFORMS} or None, got {platform!r}")
  if not isinstance(interpret, bool):
    raise ValueError(f"interpret must be a bool, got {interpret!r}")
  p = current_platform() if platform is None else platform
  if p == "tpu":
    return "tpu"
  if p in ("gpu", "cuda", "rocm"):
    return "gpu"
  return "tpu" if interpret else "reference"


def _ints(*xs):
  return tuple(jnp.asarray(x).astype(jnp.int32) for x in xs)


# ---------------------------------------------------------------------------------------
# Public API.


def paged_decode_reference(q, k_pages, v_pages, table, start, length, *, scale):
  """Pure-jnp paged decode attention (float32): gathers the row's pages, masked softmax.

  Args:
    q: [B,K,J,H] queries (any float dtype).
    k_pages: [Pg,K,H,S] key pages; v_pages: [Pg,K,S,H] value pages.
    table: int [B,nb] page ids (-1 = no page).
    start, length: int [B] valid positions start <= pos < length.
    scale: a Python float multiplied into the scores q·k (static: part of the program).

  Returns:
    out float32 [B,K,J,H] (0 for a row with no valid key) and lse float32 [B,K,J] (-inf for
    such a row).
  """
  _check_inputs(q, k_pages, v_pages, table, start, length)
  return _reference(q, k_pages, v_pages, *_ints(table, start, length), scale=float(scale))


def paged_decode_attention(q, k_pages, v_pages, table, start, length, *, scale,
                           platform: str | None = None, interpret: bool = False,
                           keys_by_row: bool = False, splits: int | str = 1):
  """Paged decode attention and its log-sum-exp, by a Pallas kernel or the reference.

  Args:
    q, k_pages, v_pages, table, start, length, scale: as in ``paged_decode_reference``.
      Positions on entries with table -1 are never valid; positions past nb·S do not exist.
    platform: "tpu", "gpu" (or "cuda"/"rocm"), "cpu", or None for the platform the program
      is traced for (``pallas_kernels.current_platform``: ``target_platform``'s, else
      ``jax.default_backend()``). "cpu" runs the reference unless ``interpret``.
    interpret: run the kernel in the Pallas interpreter (any host); on "cpu" (or None on a
      CPU host) it selects the TPU kernel.
    keys_by_row: TPU kernel: read each key page as [S,H] (``k_pages`` with its last two axes
      swapped) instead of [H,S]. Mosaic reads its operands in their row-major layout, so
      this costs nothing where ``k_pages`` is laid out with H minor (``pages.h_minor``:
      XLA:TPU's default layout for [..,H,S] when S is below the 128 lanes and H a multiple
      of them) and saves the copy of the whole pool into the [H,S] layout that the kernel
      would need per call. The same values either way; the other implementations ignore it.
    splits: GPU kernel: programs per (row, kv head), each walking one consecutive run of the
      row's live key blocks, merged by log-sum-exp (1: one program walks the row); "auto":
      ``gpu_splits`` of the shapes and the GPU's multiprocessors. Changes float rounding,
      not the result; the other implementations ignore it.

  Returns:
    out float32 [B,K,J,H] normalised over the row's valid positions (0 where a row has
    none) and lse float32 [B,K,J] (-inf where none): ``merge_partials``' conventions.

  Raises:
    ValueError: on inconsistent shapes or dtypes, a page size that is not a power of two,
      an unknown platform, ``splits`` not a positive int or "auto", or (GPU) a head dim that
      is not a power of two.
  """
  _check_inputs(q, k_pages, v_pages, table, start, length)
  if splits != "auto" and (isinstance(splits, bool) or not isinstance(splits, int)
                           or splits < 1):
    raise ValueError(f"splits must be a positive int or 'auto', got {splits!r}")
  impl = _resolve(platform, interpret)
  h = q.shape[-1]
  if impl == "gpu" and h & (h - 1):
    raise ValueError(f"the GPU kernel needs a power-of-two head dim, got H={h}")
  args = (q, k_pages, v_pages, *_ints(table, start, length))
  if impl == "reference":
    return _reference(*args, scale=float(scale))
  if impl == "gpu":
    if splits == "auto":
      splits = auto_splits(q.shape[0], q.shape[1], table.shape[1], k_pages.shape[-1])
    return _gpu_attention(*args, scale=float(scale), interpret=interpret, splits=splits)
  return _tpu_attention(*args, scale=float(scale), interpret=interpret,
                        keys_by_row=bool(keys_by_row))


# ---------------------------------------------------------------------------------------
# Reference.


@functools.partial(jax.jit, static_argnames=("scale",))
def _reference(q, k_pages, v_pages, table, start, length, *, scale):
  b_, k_, j_, h_ = q.shape
  nb, s_ = table.shape[1], k_pages.shape[-1]
  idx = jnp.maximum(table, 0)
  k = jnp.moveaxis(k_pages[idx], 1, -2).reshape(b_, k_, h_, nb * s_)  # [B,K,H,nb·S]
  v = jnp.moveaxis(v_pages[idx], 1, 2).reshape(b_, k_, nb * s_, h_)  # [B,K,nb·S,H]
  f32 = lambda x: x.astype(jnp.float32)
  einsum = functools.partial(jnp.einsum, precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
  scores = einsum("bkjh,bkhn->bkjn", f32(q), f32(k)) * scale
  pos = jnp.arange(nb * s_)
  valid = ((pos >= start[:, None]) & (pos < length[:, None])
           & jnp.repeat(table >= 0, s_, axis=1))  # [B,nb·S]
  p, lse = partial_softmax(scores, valid[:, None, None, :])
  return einsum("bkjn,bknh->bkjh", p, f32(v)), lse


def _compute_dtype(q, k_pages, v_pages):
  return jnp.promote_types(q.dtype, jnp.promote_types(k_pages.dtype, v_pages.dtype))


# ---------------------------------------------------------------------------------------
# TPU (Mosaic): key blocks walked by the grid.


def _block_entry(i, start, length, blocks: int, sb: int):
  """Key block whose K/V grid step i holds, in [0, blocks): i itself inside the row's live
  range (the blocks with a position in [start, length)), the first live block before it and
  the last one after it, so steps outside the range repeat a block the pipeline already
  holds (no copy). A row with no valid position stays on one block. Block i covers
  positions i·sb .. i·sb+sb-1: part i % (S/sb) of table entry i // (S/sb)."""
  last = jnp.minimum(lax.div(jnp.maximum(length - 1, 0), sb), blocks - 1)
  first = jnp.minimum(lax.div(jnp.maximum(start, 0), sb), last)
  return jnp.minimum(jnp.maximum(i, first), last)


def _tpu_kernel(table_ref, start_ref, length_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
                m_sc, l_sc, acc_sc, *, scale, nb, sub, dtype, keys_by_row):
  b, i = pl.program_id(0), pl.program_id(2)
  j_, sb = q_ref.shape[0], v_ref.shape[0]
  start, length = start_ref[b], length_ref[b]
  page = table_ref[b * nb + lax.div(i, sub)]
  # m and l live lane-broadcast in [J,128] scratch (lane-dense VMEM); [J,1] values.
  lanes = lambda x: jnp.broadcast_to(x, (j_, _LANES))
  column = lambda ref: ref[...][:, :1]

  @pl.when(i == 0)
  def _init():
    m, l, acc = _tiles.init_carry(j_, q_ref.shape[1])
    m_sc[...], l_sc[...], acc_sc[...] = lanes(m), lanes(l), acc

  @pl.when((i * sb < length) & ((i + 1) * sb > start) & (page >= 0))
  def _block():
    qk = _tiles.scores if keys_by_row else lambda q, k, c: _tiles.matmul(q, k) * c
    s = qk(q_ref[...].astype(dtype), k_ref[...].astype(dtype), scale)  # [J,Sb]
    pos = i * sb + lax.broadcasted_iota(jnp.int32, (j_, sb), 1)
    mask = (pos >= start) & (pos < length)
    m, l, acc = _tiles.online_softmax_step(column(m_sc), column(l_sc), acc_sc[...], s, mask,
                                           v_ref[...].astype(dtype))
    m_sc[...], l_sc[...], acc_sc[...] = lanes(m), lanes(l), acc

  @pl.when(i == nb * sub - 1)
  def _finalize():
    out, lse = _tiles.finalize(column(m_sc), column(l_sc), acc_sc[...])
    o_ref[...] = out
    lse_ref[...] = lanes(lse)


def tpu_key_block(s: int) -> int:
  """Keys the Mosaic kernel reads per grid step: ``_TPU_KEY_BLOCK`` (512) positions, or the
  whole page when it is shorter. A long page (one worst-case page per sample, say) is read
  in parts: the blocks in VMEM do not grow with the page size (a page of 32K keys of 128
  dims overflowed a v5e's scoped VMEM when read whole), and the online softmax folds the
  same blocks in the same order for any page size of at least 512."""
  return min(s, _TPU_KEY_BLOCK)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "keys_by_row", "block"))
def _tpu_attention(q, k_pages, v_pages, table, start, length, *, scale, interpret,
                   keys_by_row=False, block=None):
  b_, k_, j_, h_ = q.shape
  nb, s_ = table.shape[1], k_pages.shape[-1]
  sb = tpu_key_block(s_) if block is None else block
  sub = s_ // sb  # key blocks per page
  dtype = _compute_dtype(q, k_pages, v_pages)
  if keys_by_row:  # [Pg,K,S,H]: a relabelling of a pool laid out with H minor
    k_pages = jnp.swapaxes(k_pages, -1, -2)

  def q_map(b, h, i, table_ref, start_ref, length_ref):
    return b, h, 0, 0

  def pool_block(b, i, table_ref, start_ref, length_ref):
    """(page, part) of the key block grid step i reads."""
    at = _block_entry(i, start_ref[b], length_ref[b], nb * sub, sb)
    # lax.div / lax.rem: truncating, as Mosaic lowers them (i >= 0)
    return jnp.maximum(table_ref[b * nb + lax.div(at, sub)], 0), lax.rem(at, sub)

  def by_row_map(b, h, i, *refs):  # [Sb,H] blocks
    page, part = pool_block(b, i, *refs)
    return page, h, part, 0

  def by_column_map(b, h, i, *refs):  # [H,Sb] blocks
    page, part = pool_block(b, i, *refs)
    return page, h, 0, part

  k_block = (sb, h_) if keys_by_row else (h_, sb)
  out, lse = pl.pallas_call(
      functools.partial(_tpu_kernel, scale=scale, nb=nb, sub=sub, dtype=dtype,
                        keys_by_row=keys_by_row),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3,
          grid=(b_, k_, nb * sub),
          in_specs=[pl.BlockSpec((None, None, j_, h_), q_map),
                    pl.BlockSpec((None, None) + k_block,
                                 by_row_map if keys_by_row else by_column_map),
                    pl.BlockSpec((None, None, sb, h_), by_row_map)],
          out_specs=[pl.BlockSpec((None, None, j_, h_), q_map),
                     pl.BlockSpec((None, None, j_, _LANES), q_map)],
          scratch_shapes=[pltpu.VMEM((j_, _LANES), jnp.float32),
                          pltpu.VMEM((j_, _LANES), jnp.float32),
                          pltpu.VMEM((j_, h_), jnp.float32)],
      ),
      out_shape=[jax.ShapeDtypeStruct((b_, k_, j_, h_), jnp.float32),
                 jax.ShapeDtypeStruct((b_, k_, j_, _LANES), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="paged_decode_attention",
  )(table.reshape(-1), start, length, q, k_pages, v_pages)
  # the table goes flat into SMEM (a 2-D SMEM array pads its rows); lse comes back
  # lane-broadcast [B,K,J,128] (a lane-dense block, no in-kernel transpose): lane 0 is it
  return out, lse[..., 0]


# ---------------------------------------------------------------------------------------
# GPU (Triton): pages walked by a loop.


def _gpu_kernel(table_ref, start_ref, length_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                scale, dtype, use_dot, block, splits):
  j_, h_ = q_ref.shape
  nb, s_ = table_ref.shape[0], k_ref.shape[-1]
  sub = s_ // block  # key blocks per page
  start, length = start_ref[...], length_ref[...]
  q = q_ref[...].astype(dtype)

  if use_dot:
    qk = lambda k: _tiles.matmul(q, k)  # [J,H] @ [H,Sb]
    pv = None  # the matmul
  else:  # too small for a dot: broadcast products summed
    qf = q.astype(jnp.float32)
    qk = lambda k: jnp.sum(qf[:, :, None] * k.astype(jnp.float32)[None, :, :], axis=1)
    pv = lambda e, v: jnp.sum(e[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)

  def step(i, carry):  # key block i: positions i·Sb ..; part i % sub of entry i // sub
    page = table_ref[i // sub]
    at, cols = jnp.maximum(page, 0), pl.ds((i % sub) * block, block)
    k = k_ref[at, :, cols].astype(dtype)  # [H,Sb]
    v = v_ref[at, cols, :].astype(dtype)  # [Sb,H]
    s = qk(k) * scale
    pos = i * block + lax.broadcasted_iota(jnp.int32, (j_, block), 1)
    mask = (pos >= start) & (pos < length) & (page >= 0)
    return _tiles.online_softmax_step(*carry, s, mask, v, pv)

  first = lax.div(jnp.maximum(start, 0), block)
  end = jnp.maximum(jnp.minimum(lax.div(jnp.maximum(length, 0) + block - 1, block), nb * sub),
                    first)
  if splits > 1:  # this program's run of the live blocks: ceil((end - first) / C) of them
    per = lax.div(end - first + splits - 1, splits)
    first = jnp.minimum(first + pl.program_id(2) * per, end)
    end = jnp.minimum(first + per, end)
  m, l, acc = lax.fori_loop(first, end, step, _tiles.init_carry(j_, h_))
  out, lse = _tiles.finalize(m, l, acc)
  o_ref[...] = out
  lse_ref[...] = lse[:, 0]


def gpu_key_block(s: int) -> int:
  """Keys the Triton kernel reads per loop step: ``_GPU_KEY_BLOCK`` (64) positions, or the
  whole page when it is shorter. A long page (one worst-case page per sample, say) is read
  in parts, so the program's tiles do not grow with the page size, and the online softmax
  folds the same blocks in the same order for any page size of at least 64: the result does
  not depend on how the response is paged."""
  return min(s, _GPU_KEY_BLOCK)


def gpu_splits(programs: int, blocks: int, cores: int) -> int:
  """``splits="auto"``: the smallest power of two C that gives ``programs`` (rows x kv heads)
  x C at least two programs per multiprocessor (``cores``), or, where that C would leave a
  program fewer than ``_GPU_SPLIT_MIN_BLOCKS`` (8) of the ``blocks`` key blocks a row's
  table can hold, the largest C that does not. Shapes only (static): the number of compiled
  programs does not change."""
  c = 1
  while programs * c < 2 * cores and blocks // (2 * c) >= _GPU_SPLIT_MIN_BLOCKS:
    c *= 2
  return c


def auto_splits(rows: int, kv_heads: int, entries: int, page: int) -> int:
  """``splits="auto"`` for B = ``rows`` rows, K kv heads and tables of nb = ``entries``
  pages of S = ``page`` keys: ``gpu_splits`` on this host's GPU (or ``_GPU_CORES``)."""
  return gpu_splits(rows * kv_heads, entries * (page // gpu_key_block(page)), _gpu_cores())


def _gpu_cores() -> int:
  """Multiprocessors of the first GPU, or ``_GPU_CORES`` where there is none to ask (an
  export for CUDA from a CPU host)."""
  try:
    return int(getattr(jax.devices("gpu")[0], "core_count", 0)) or _GPU_CORES
  except RuntimeError:
    return _GPU_CORES


def _merge_splits(out, lse):
  """[B,K,C,J,H], [B,K,C,J] partials of C disjoint key runs -> [B,K,J,H], [B,K,J]."""
  if out.shape[2] == 1:
    return out[:, :, 0], lse[:, :, 0]
  return merge_partials(list(jnp.moveaxis(out, 2, 0)), list(jnp.moveaxis(lse, 2, 0)),
                        return_lse=True)


def _pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block", "splits"))
def _gpu_attention(q, k_pages, v_pages, table, start, length, *, scale, interpret,
                   block=None, splits=1):
  b_, k_, j_, h_ = q.shape
  pg, nb, s_ = k_pages.shape[0], table.shape[1], k_pages.shape[-1]
  block = gpu_key_block(s_) if block is None else block
  use_dot = min(h_, block) >= _GPU_DOT_MIN
  # Triton tiles have power-of-two sides and a dot at least 16 rows: pad the query heads
  # (H and S are powers of two already).
  jp = max(_pow2(j_), _GPU_DOT_MIN) if use_dot else _pow2(j_)
  q = jnp.pad(q, [(0, 0), (0, 0), (0, jp - j_), (0, 0)])
  nbp = _pow2(nb)
  table = jnp.pad(table, [(0, 0), (0, nbp - nb)], constant_values=-1)
  row = lambda b, h, c: (b,)
  out, lse = pl.pallas_call(
      functools.partial(_gpu_kernel, scale=scale, dtype=_compute_dtype(q, k_pages, v_pages),
                        use_dot=use_dot, block=block, splits=splits),
      grid=(b_, k_, splits),
      in_specs=[pl.BlockSpec((None, nbp), lambda b, h, c: (b, 0)),
                pl.BlockSpec((None,), row), pl.BlockSpec((None,), row),
                pl.BlockSpec((None, None, jp, h_), lambda b, h, c: (b, h, 0, 0)),
                pl.BlockSpec((pg, None, h_, s_), lambda b, h, c: (0, h, 0, 0)),
                pl.BlockSpec((pg, None, s_, h_), lambda b, h, c: (0, h, 0, 0))],
      out_specs=[pl.BlockSpec((None, None, None, jp, h_), lambda b, h, c: (b, h, c, 0, 0)),
                 pl.BlockSpec((None, None, None, jp), lambda b, h, c: (b, h, c, 0))],
      out_shape=[jax.ShapeDtypeStruct((b_, k_, splits, jp, h_), jnp.float32),
                 jax.ShapeDtypeStruct((b_, k_, splits, jp), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=4 if h_ <= 64 else 8, num_stages=2),
      interpret=interpret,
      name="paged_decode_attention",
  )(table, start, length, q, k_pages, v_pages)
  return _merge_splits(out[:, :, :, :j_], lse[:, :, :, :j_])
