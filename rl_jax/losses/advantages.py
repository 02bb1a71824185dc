"""Advantage estimators: plain functions from rewards to advantages.

Axis letters: G groups (one prompt each), M samples per prompt (MC-GRPO draws M and trains
M - 1 of them), B rows, T tokens, C reward components. The estimator form of each
(``ObjectiveInputs -> Advantages``) is in ``estimators.py``; docs/ALGORITHMS.md,
"Advantages", derives them.

Non-finite rewards (NaN, +-inf) are treated as missing samples by every group estimator
here: they are left out of every group statistic and their advantage is exactly 0. This is
the defined result for bad rewards; the loss never sees a NaN from them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax.losses._utils import (Array, check_choice, check_rank, check_same_shape,
                                  masked_whiten, safe_divide)

__all__ = ["gae_advantages", "gdpo_advantages", "grpo_advantages", "mc_grpo_advantages",
           "reinforce_pp_advantages", "reinforce_pp_baseline_advantages", "rloo_advantages"]


def _group_stats(rewards: Array) -> tuple[Array, Array, Array, Array]:
  """Per-group count, mean and unbiased std over the finite entries of ``rewards [G,M]``.

  Returns ``(valid [G,M], n [G,1], mean [G,1], std [G,1])`` with the verl convention that a
  group with one valid sample has mean 0 and std 1.
  """
  valid = jnp.isfinite(rewards)
  r = jnp.where(valid, rewards, 0.0)
  n = jnp.sum(valid, axis=-1, keepdims=True).astype(r.dtype)
  mean = safe_divide(jnp.sum(r, axis=-1, keepdims=True), n)
  var = safe_divide(jnp.sum(jnp.where(valid, (r - mean) ** 2, 0.0), axis=-1, keepdims=True),
                    n - 1.0)
  single = n <= 1
  mean = jnp.where(single, 0.0, mean)
  std = jnp.where(single, 1.0, jnp.sqrt(var))
  return valid, n, mean, std


def grpo_advantages(rewards: Array, scale: str = "std", eps: float = 1e-6) -> Array:
  """Group-relative advantages (GRPO; ``scale="none"`` is Dr.GRPO).

  ``A_i = (s_i - mean_g) / (std_g + eps)`` with the unbiased (ddof=1) group std, or
  ``A_i = s_i - mean_g`` when ``scale="none"``. A group with one valid sample has mean 0 and
  std 1 (so ``A = s``).

  Args:
    rewards: float [G,M] sequence rewards, one row per prompt.
    scale: "std" (GRPO) or "none" (Dr.GRPO, no std division).
    eps: added to the std.

  Returns:
    float [G,M] advantages; 0 where the reward is not finite.

  References: Shao et al. 2024, DeepSeekMath (GRPO); Liu et al. 2025, Understanding
  R1-Zero-Like Training (Dr.GRPO).
  """
  check_rank("rewards", rewards, (2,))
  check_choice("scale", scale, ("std", "none"))
  valid, _, mean, std = _group_stats(rewards)
  centred = jnp.where(valid, rewards, 0.0) - mean
  adv = centred / (std + eps) if scale == "std" else centred
  return jnp.where(valid, adv, 0.0)


def rloo_advantages(rewards: Array) -> Array:
  """Leave-one-out baseline: ``A_i = s_i - sum_{j != i} s_j / (M - 1) = M/(M-1) (s_i - mean)``.

  Args:
    rewards: float [G,M].

  Returns:
    float [G,M]; a group with one valid sample keeps ``A = s`` (baseline 0); 0 where the
    reward is not finite (those samples are also left out of the others' baselines).

  References: Ahmadian et al. 2024, Back to Basics: Revisiting REINFORCE Style Optimization
  (RLOO); Kool et al. 2019.
  """
  check_rank("rewards", rewards, (2,))
  valid, n, mean, _ = _group_stats(rewards)
  r = jnp.where(valid, rewards, 0.0)
  factor = jnp.where(n > 1, safe_divide(n, n - 1.0), 1.0)
  return jnp.where(valid, factor * (r - mean), 0.0)


def reinforce_pp_baseline_advantages(rewards: Array, lengths: Array | None = None,
                                     eps: float = 1e-8) -> Array:
  """REINFORCE++-baseline: subtract the group mean, then whiten over all valid tokens.

  ``a_i = s_i - mean_g``; the whitening statistics weight each row by its number of valid
  tokens ``L_i`` (the advantage is broadcast over tokens): ``mu = sum L a / sum L``,
  ``var = sum L (a - mu)^2 / (sum L - 1)``, ``A_i = (a_i - mu) / sqrt(var + eps)``.

  Args:
    rewards: float [G,M].
    lengths: int or float [G,M] valid tokens per row; None weights all rows equally.
    eps: whitening epsilon.

  Returns:
    float [G,M] (constant over each row's tokens); 0 for non-finite rewards and
    zero-length rows.

  References: Hu 2025, REINFORCE++.
  """
  check_rank("rewards", rewards, (2,))
  check_same_shape("rewards", rewards, lengths=lengths)
  valid, _, mean, _ = _group_stats(rewards)
  a = jnp.where(valid, rewards, 0.0) - mean
  w = jnp.ones_like(a) if lengths is None else lengths.astype(a.dtype)
  w = jnp.where(valid, w, 0.0)
  total = jnp.sum(w)
  mu = safe_divide(jnp.sum(w * a), total)
  var = safe_divide(jnp.sum(w * (a - mu) ** 2), total - 1.0)
  var = jnp.where(total > 1, var, 0.0)
  return jnp.where(w > 0, (a - mu) * jax.lax.rsqrt(var + eps), 0.0)


def _reverse_discounted_sum(x: Array, mask: Array, gamma: float) -> Array:
  """``y_t = x_t + gamma * y_{next valid}`` over the valid tokens of each row; 0 elsewhere."""

  def step(carry, inp):
    xt, mt = inp
    y = xt + gamma * carry
    return jnp.where(mt, y, carry), jnp.where(mt, y, 0.0)

  _, ys = jax.lax.scan(step, jnp.zeros(x.shape[:1], x.dtype), (x.T, mask.T), reverse=True)
  return ys.T


def reinforce_pp_advantages(rewards: Array, mask: Array, kl: Array | None = None,
                            kl_beta: float = 0.0, gamma: float = 1.0) -> Array:
  """REINFORCE++ (no critic, no group baseline): discounted token returns, whitened.

  Token reward ``r_t = -kl_beta * kl_t`` plus the sequence reward on the last valid token;
  ``G_t = sum_{u >= t} gamma^(u-t) r_u`` over valid tokens; then whitened over all valid
  tokens of the batch (unbiased variance, eps 1e-8).

  Args:
    rewards: float [B] sequence rewards.
    mask: bool [B,T] valid response tokens.
    kl: optional float [B,T] per-token KL estimate (e.g. ``kl_penalty(old, ref, "k1")``).
    kl_beta: KL coefficient folded into the reward.
    gamma: discount.

  Returns:
    float [B,T] token advantages; 0 on invalid tokens and on rows with non-finite reward.

  References: Hu 2025, REINFORCE++.
  """
  check_rank("rewards", rewards, (1,))
  check_rank("mask", mask, (2,))
  if mask.shape[0] != rewards.shape[0]:
    raise ValueError(f"rewards has {rewards.shape[0]} rows but mask has {mask.shape[0]}")
  check_same_shape("mask", mask, kl=kl)
  mask = mask.astype(bool) & jnp.isfinite(rewards)[:, None]
  t = jnp.arange(mask.shape[1])
  last = jnp.max(jnp.where(mask, t, -1), axis=1, keepdims=True)
  r = jnp.where(t == last, jnp.where(jnp.isfinite(rewards), rewards, 0.0)[:, None], 0.0)
  if kl is not None:
    r = r - kl_beta * jnp.where(mask, kl, 0.0)
  returns = _reverse_discounted_sum(r, mask, gamma)
  return masked_whiten(returns, mask)


def _lower_median(x: Array, n: Array) -> tuple[Array, Array]:
  """Lower median over the first ``n`` sorted (finite) entries of each row of ``x [G,M]``.

  NaNs sort last, so they are never selected. Returns ``(value [G], index [G])``.
  """
  order = jnp.argsort(x, axis=-1, stable=True)
  pos = jnp.maximum((n - 1) // 2, 0)
  idx = jnp.take_along_axis(order, pos[:, None], axis=-1)[:, 0]
  return jnp.take_along_axis(x, idx[:, None], axis=-1)[:, 0], idx


def mc_grpo_advantages(rewards: Array, scale: str = "mad", eps: float = 1e-3
                       ) -> tuple[Array, Array]:
  """MC-GRPO: median baseline, MAD scale, pivot row dropped.

  Draw M samples per prompt, one more than the number that train. ``med`` is the group median,
  ``MAD = median(|s - med|) + eps``, ``A_i = (s_i - med) / MAD`` (``scale="none"``:
  ``A_i = s_i - med``). The row holding the median (the pivot) is dropped, so M - 1 rows train.
  For an even number of valid samples the lower median is used (so the pivot is a sample).

  Args:
    rewards: float [G,M].
    scale: "mad" or "none".
    eps: added to the MAD.

  Returns:
    ``(advantages [G,M-1], rows [G,M-1] int32)``: ``rows`` are the indices into the M
    samples that survive (in their original order). Non-finite rewards are left out of
    the median and MAD and get advantage 0.

  References: Kim 2026, MC-GRPO: Median-Centered Group Relative Policy Optimization for
  Small-Rollout Reinforcement Learning.
  """
  check_rank("rewards", rewards, (2,))
  check_choice("scale", scale, ("mad", "none"))
  if rewards.shape[1] < 2:
    raise ValueError(f"MC-GRPO needs at least 2 samples per group, got {rewards.shape[1]}")
  valid = jnp.isfinite(rewards)
  x = jnp.where(valid, rewards, jnp.nan)
  n = jnp.sum(valid, axis=-1)
  med, pivot = _lower_median(x, n)
  dev = jnp.where(valid, jnp.abs(x - med[:, None]), jnp.nan)
  mad, _ = _lower_median(dev, n)
  centred = jnp.where(valid, x - med[:, None], 0.0)
  adv = centred / (mad[:, None] + eps) if scale == "mad" else centred
  adv = jnp.where(valid, adv, 0.0)
  j = jnp.arange(rewards.shape[1] - 1)[None, :]
  rows = (j + (j >= pivot[:, None])).astype(jnp.int32)
  return jnp.take_along_axis(adv, rows, axis=-1), rows


def gae_advantages(rewards: Array, values: Array, mask: Array, gamma: float = 1.0,
                   lam: float = 1.0, whiten: bool = True) -> tuple[Array, Array]:
  """Generalised advantage estimation over the valid tokens of each row.

  Reverse scan: ``delta_t = r_t + gamma V_{t'} - V_t`` and ``A_t = delta_t + gamma lam
  A_{t'}`` where ``t'`` is the next valid token (``V = A = 0`` past the last one); masked
  tokens are skipped. ``returns = A + V``; then A is whitened over valid tokens.

  Args:
    rewards: float [B,T] token rewards (sequence reward on the last valid token).
    values: float [B,T] value predictions of the old value model.
    mask: bool [B,T].
    gamma, lam: discount and GAE lambda (verl defaults 1.0, 1.0).
    whiten: whiten the advantages (not the returns).

  Returns:
    ``(advantages [B,T], returns [B,T])``, 0 on invalid tokens. Non-finite token rewards
    or values on valid tokens mark the whole row invalid (all zeros).

  References: Schulman et al. 2016, High-Dimensional Continuous Control Using GAE.
  """
  check_rank("rewards", rewards, (2,))
  check_same_shape("rewards", rewards, values=values, mask=mask)
  mask = mask.astype(bool)
  finite = jnp.isfinite(rewards) & jnp.isfinite(values)
  mask = mask & jnp.all(finite | ~mask, axis=1, keepdims=True)
  r = jnp.where(mask, rewards, 0.0)
  v = jnp.where(mask, values, 0.0)

  def step(carry, inp):
    next_v, next_a = carry
    rt, vt, mt = inp
    a = rt + gamma * next_v - vt + gamma * lam * next_a
    carry = (jnp.where(mt, vt, next_v), jnp.where(mt, a, next_a))
    return carry, jnp.where(mt, a, 0.0)

  zeros = jnp.zeros(r.shape[:1], r.dtype)
  _, adv = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, mask.T), reverse=True)
  adv = adv.T
  returns = jnp.where(mask, adv + v, 0.0)
  if whiten:
    adv = masked_whiten(adv, mask)
  return adv, returns


def gdpo_advantages(rewards: Array, weights: Array | None = None, eps: float = 1e-6) -> Array:
  """GDPO: GRPO-normalise each reward component separately, weighted sum, then whiten.

  Args:
    rewards: float [G,M,C], C reward components.
    weights: float [C] component weights (default all 1).
    eps: GRPO std epsilon.

  Returns:
    float [G,M], whitened over the rows whose C components are all finite (0 elsewhere).

  References: Liu et al. 2026, GDPO: Group reward-Decoupled Normalization Policy Optimization
  for Multi-reward RL Optimization.
  """
  check_rank("rewards", rewards, (3,))
  c = rewards.shape[-1]
  w = jnp.ones((c,), rewards.dtype) if weights is None else jnp.asarray(weights, rewards.dtype)
  if w.shape != (c,):
    raise ValueError(f"weights must have shape ({c},), got {tuple(w.shape)}")
  per = jax.vmap(lambda r: grpo_advantages(r, "std", eps), in_axes=-1, out_axes=-1)(rewards)
  valid = jnp.all(jnp.isfinite(rewards), axis=-1)
  combined = jnp.einsum("gmc,c->gm", per, w)
  return masked_whiten(combined, valid)
