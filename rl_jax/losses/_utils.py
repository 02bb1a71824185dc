"""Shared helpers for rl_jax.losses: validation, masked statistics, safe division.

Axis letters: G groups (prompts), M samples per prompt, B rows, T tokens.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["LOG_RATIO_CLAMP", "Array", "check_choice", "check_rank", "check_same_shape",
           "clamped_exp", "masked_mean", "masked_sum", "masked_whiten", "safe_divide"]

Array = jax.Array

LOG_RATIO_CLAMP = 20.0  # log-ratios are clamped to [-20, 20] before exp (docs/ALGORITHMS.md)


def check_rank(name: str, x: Any, ranks: tuple[int, ...]) -> None:
  """Raises ValueError unless ``x`` is an array whose rank is one of ``ranks``."""
  ndim = getattr(x, "ndim", None)
  if ndim is None:
    raise ValueError(f"{name} must be an array, got {type(x).__name__}")
  if ndim not in ranks:
    want = " or ".join(f"rank {r}" for r in ranks)
    raise ValueError(f"{name} must have {want}, got shape {tuple(x.shape)}")


def check_same_shape(ref_name: str, ref: Array, **others: Any) -> None:
  """Raises ValueError if any of ``others`` (not None) differs in shape from ``ref``."""
  for name, x in others.items():
    if x is None:
      continue
    if tuple(x.shape) != tuple(ref.shape):
      raise ValueError(f"{name} has shape {tuple(x.shape)} but {ref_name} has shape "
                       f"{tuple(ref.shape)}")


def check_choice(name: str, value: Any, choices) -> None:
  if value not in choices:
    raise ValueError(f"unknown {name} {value!r}; choose one of {sorted(choices)}")


def safe_divide(num: Array, den: Array) -> Array:
  """``num / den`` with 0 where ``den == 0`` (no NaN, zero gradient there)."""
  ok = den != 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def clamped_exp(log_x: Array) -> Array:
  """``exp(clip(log_x, -20, 20))``: the ratio convention used by every policy loss."""
  return jnp.exp(jnp.clip(log_x, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def masked_sum(x: Array, mask: Array, axis=None) -> Array:
  return jnp.sum(jnp.where(mask, x, 0.0), axis=axis)


def masked_mean(x: Array, mask: Array, axis=None) -> Array:
  """Mean of ``x`` over ``mask``; 0 where the mask is empty."""
  return safe_divide(masked_sum(x, mask, axis), jnp.sum(mask, axis=axis).astype(x.dtype))


def masked_whiten(x: Array, mask: Array, eps: float = 1e-8) -> Array:
  """``(x - mean) / sqrt(var + eps)`` over the masked entries; unbiased variance (verl).

  Entries outside ``mask`` are returned as 0. With fewer than two valid entries the
  variance is taken as 0.

  References: Sheng et al. 2024, HybridFlow/verl (masked_whiten).
  """
  n = jnp.sum(mask).astype(x.dtype)
  mean = safe_divide(masked_sum(x, mask), n)
  var = safe_divide(masked_sum((x - mean) ** 2, mask), n - 1.0)
  var = jnp.where(n > 1, var, 0.0)
  return jnp.where(mask, (x - mean) * jax.lax.rsqrt(var + eps), 0.0)
