"""Aggregation of per-token losses into (sum, denominator) pairs.

Every mode returns a numerator and a denominator whose ratio is the loss. Both are sums over
rows, so adding the pairs of several micro-batches (or devices) and dividing once gives
exactly the full-batch loss.

``aggregate_parts`` is the one implementation; ``aggregate`` (a scalar loss) and the
``aggregation`` stage of ``chain`` both use it. See docs/ALGORITHMS.md, "Aggregation".

Axis letters: B rows, T tokens.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax.numpy as jnp

from rl_jax.losses._utils import Array, check_rank, check_same_shape, safe_divide

__all__ = ["AGG_MODES", "Aggregation", "aggregate", "aggregate_parts", "aggregation"]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
             "seq-mean-token-sum-norm")


def _check_mode(mode: str) -> None:
  if mode not in AGG_MODES:
    raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {list(AGG_MODES)}")


def _check_norm(norm: float | None) -> None:
  if norm is not None and not norm > 0:
    raise ValueError(f"norm must be > 0, got {norm!r}")


def aggregate_parts(per_token: Array, mask: Array, mode: str = "token-mean",
                    norm: float | None = None) -> tuple[Array, Array]:
  """Numerator and denominator of an aggregation mode (verl semantics).

  - token-mean: ``(sum_{i,t} l m, sum m)``.
  - seq-mean-token-mean: ``(sum_i sum_t l m / (sum_t m + 1e-8), B')``.
  - seq-mean-token-sum: ``(sum_i sum_t l m, B')``.
  - seq-mean-token-sum-norm: ``(sum_i sum_t l m / C, B')`` with ``C = norm`` or T.
  B' counts rows with at least one valid token.

  Args:
    per_token: float [B,T].
    mask: bool or float [B,T].
    mode: one of AGG_MODES.
    norm: constant C for seq-mean-token-sum-norm (default T, the padded length; pass the
      maximum response length when micro-batches are padded differently).

  Returns:
    ``(loss_sum, denom)`` scalars.

  References: Sheng et al. 2024, HybridFlow/verl (loss_agg_mode); Liu et al. 2025 (Dr.GRPO).
  """
  _check_mode(mode)
  check_rank("per_token", per_token, (2,))
  check_same_shape("per_token", per_token, mask=mask)
  m = mask.astype(per_token.dtype)
  masked = jnp.where(m > 0, per_token * m, 0.0)
  if mode == "token-mean":
    return jnp.sum(masked), jnp.sum(m)
  row_tokens = jnp.sum(m, axis=1)
  row_sum = jnp.sum(masked, axis=1)
  rows = jnp.sum(row_tokens > 0).astype(per_token.dtype)
  if mode == "seq-mean-token-mean":
    return jnp.sum(row_sum / (row_tokens + 1e-8)), rows
  if mode == "seq-mean-token-sum":
    return jnp.sum(row_sum), rows
  c = per_token.shape[1] if norm is None else norm
  if not c > 0:
    raise ValueError(f"norm must be > 0, got {norm!r}")
  return jnp.sum(row_sum) / c, rows


def aggregate(per_token: Array, mask: Array, mode: str = "token-mean",
              norm: float | None = None) -> Array:
  """Scalar loss ``loss_sum / denom`` of :func:`aggregate_parts`.

  Returns 0.0 (not NaN) when no token is valid.

  References: Sheng et al. 2024, HybridFlow/verl (loss_agg_mode).
  """
  num, den = aggregate_parts(per_token, mask, mode, norm)
  return safe_divide(num, den)


class Aggregation(NamedTuple):
  """The aggregation stage of ``chain``: ``reduce(per_token, mask) -> (loss_sum, denom)``."""

  reduce: Callable[[Array, Array], tuple[Array, Array]]
  mode: str
  norm: float | None = None


def aggregation(mode: str = "token-mean", norm: float | None = None) -> Aggregation:
  """Aggregation stage for ``chain``; see ``aggregate_parts`` for the modes.

  References: Sheng et al. 2024, HybridFlow/verl (loss_agg_mode); Liu et al. 2025 (Dr.GRPO).
  """
  _check_mode(mode)
  _check_norm(norm)
  return Aggregation(lambda per_token, mask: aggregate_parts(per_token, mask, mode, norm),
                     mode, norm)
