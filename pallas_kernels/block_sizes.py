"""Block sizes for the shared-prefix attention kernels, one table per backend.

A block size is a number of rows (query tokens or key tokens) a kernel step works on. The
head dimension is never split: it is always the full last dimension of a block, which also
keeps TPU blocks legal for head dims below 128.

Constraints:
  TPU (Mosaic): the second-to-last block dim must be a multiple of 8 or the full dim, the
    last a multiple of 128 or the full dim (the log-sum-exp rows use the query block as
    their last dim, so query blocks are multiples of 128 unless they cover all of R).
  GPU (Triton): every loaded tile has a power-of-two number of elements, and a dot needs
    each side at least 16, so all sizes are powers of two >= 16.
``fit`` adapts the sizes to one problem (short responses get one whole-length block).

References: DualKV shared-prefix attention (amazon-science/dualkv-flash-attn-for-rl);
FlashAttention-2 (Dao, 2023) for the block decomposition.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["BlockSizes", "DEFAULT_BLOCK_SIZES", "FittedBlocks", "fit"]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Rows per kernel step.

  Attributes:
    block_q: query rows per step in the forward and dq kernels.
    block_kv: key rows per step (context and response keys) in the forward and dq kernels.
    block_q_bwd: query rows per step in the dK/dV kernels.
    block_kv_bwd: key rows per step (the dK/dV output block) in the dK/dV kernels.
  """

  block_q: int
  block_kv: int
  block_q_bwd: int
  block_kv_bwd: int

  def __post_init__(self):
    for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 8 or value % 8:
        raise ValueError(f"BlockSizes.{name} must be a positive multiple of 8, got {value!r}")

  @property
  def largest(self) -> int:
    return max(self.block_q, self.block_kv, self.block_q_bwd, self.block_kv_bwd)

  def check(self, backend: str) -> None:
    """Raises ValueError if these sizes cannot tile a problem on ``backend``."""
    sizes = (self.block_q, self.block_kv, self.block_q_bwd, self.block_kv_bwd)
    if backend == "gpu" and any(s < 16 or s & (s - 1) for s in sizes):
      raise ValueError(f"GPU block sizes must be powers of two >= 16, got {self}")
    if any(self.largest % s for s in sizes):
      raise ValueError(f"every block size must divide the largest one, got {self}")


# Defaults per backend. TPU: 512-row blocks keep the MXU busy and the per-step overhead
# (~0.35 us) small; a [512, 512] f32 score tile is 1 MiB of VMEM. GPU: 64-row tiles keep the
# f32 accumulators of the backward kernels in registers for head dims up to 128.
DEFAULT_BLOCK_SIZES: dict[str, BlockSizes] = {
    "tpu": BlockSizes(block_q=512, block_kv=512, block_q_bwd=512, block_kv_bwd=512),
    "gpu": BlockSizes(block_q=64, block_kv=64, block_q_bwd=64, block_kv_bwd=64),
}


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _next_pow2(x: int) -> int:
  return 1 << max(x - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class FittedBlocks:
  """Block sizes fitted to one problem, with the padded lengths they tile exactly.

  Attributes:
    sizes: the block sizes to use (each divides ``r_pad``; the kv sizes divide ``p_pad``).
    r_pad: padded response length R' >= R.
    p_pad: padded context length P' >= P.
  """

  sizes: BlockSizes
  r_pad: int
  p_pad: int


def fit(sizes: BlockSizes, *, r: int, p: int, backend: str) -> FittedBlocks:
  """Fits block sizes to response length ``r`` and context length ``p``.

  Short responses (no longer than the largest block) use one block of the whole padded
  response for every block size, which is always a legal block shape; longer ones are
  padded to a multiple of the largest block (which every block divides, see
  ``BlockSizes.check``). The context is padded to a multiple of the key blocks; padded keys are
  masked like any key past the context length.

  Args:
    sizes: requested block sizes.
    r: response length R.
    p: context length P.
    backend: "tpu" or "gpu".

  Returns:
    The fitted block sizes and padded lengths R', P'.
  """
  short = _round_up(r, 8) if backend == "tpu" else _next_pow2(max(r, 16))
  if short <= sizes.largest:
    sizes = BlockSizes(short, short, short, short)
    r_pad = short
  else:
    r_pad = _round_up(r, sizes.largest)
  p_pad = _round_up(max(p, 1), math.lcm(sizes.block_kv, sizes.block_kv_bwd))
  return FittedBlocks(sizes, r_pad, p_pad)
