"""Policy-loss formulas: ratios, clipping, off-policy corrections, value loss.

Plain functions of arrays; the composable stages in ``stages.py`` call these, and
``compose.policy_loss`` is the aggregated clipped loss. See docs/ALGORITHMS.md, "Policy losses".

Axis letters: B rows, T tokens. ``logp`` current policy, ``old_logp`` the policy the ratio is
taken against (the proximal policy for decoupled PPO), ``behaviour_logp`` (mu) the sampler's
log-probs, ``ref_logp`` the reference policy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax.losses._utils import (LOG_RATIO_CLAMP, Array, check_choice, check_same_shape,
                                  clamped_exp, masked_mean, safe_divide)

__all__ = ["DECOUPLED_MODES", "DUAL_CLIP_DEFAULT", "MIS_LEVELS", "MIS_MODES", "RATIO_LEVELS",
           "TIS_LEVELS", "ace_scale", "broadcast_advantages", "check_eps", "check_icepop_band",
           "check_mis_band", "decoupled_weights", "geo_mean_is_weights", "gspo_log_ratio",
           "icepop_weights", "m2po_clip_bound", "m2po_mask", "masked_is_weights",
           "minpro_weights", "ppo_clip_per_token", "resolve_dual_clip", "sequence_log_ratio",
           "truncated_is_weights", "value_loss_per_token"]

DUAL_CLIP_DEFAULT = 3.0
RATIO_LEVELS = ("token", "sequence")  # ppo_clip: PPO token ratio or GSPO sequence ratio
TIS_LEVELS = ("token", "sequence")    # truncated_is_weights levels
DECOUPLED_MODES = ("mask", "clamp")   # decoupled_weights modes
MIS_LEVELS = ("sequence", "token")    # masked_is_weights levels
MIS_MODES = ("weight", "mask")        # masked_is_weights: weight kept rows by rho, or by 1


def broadcast_advantages(advantages: Array, shape: tuple[int, int]) -> Array:
  """Sequence-level [B] or token-level [B,T] advantages -> [B,T]."""
  if advantages.ndim == 1 and advantages.shape[0] == shape[0]:
    return jnp.broadcast_to(advantages[:, None], shape)
  if tuple(advantages.shape) == tuple(shape):
    return advantages
  raise ValueError(f"advantages must have shape ({shape[0]},) or {tuple(shape)}, got "
                   f"{tuple(advantages.shape)}")


def resolve_dual_clip(dual_clip) -> float | None:
  """None/False -> off; True -> 3.0; a number must be > 1."""
  if dual_clip is None or dual_clip is False:
    return None
  if dual_clip is True:
    return DUAL_CLIP_DEFAULT
  if not float(dual_clip) > 1.0:
    raise ValueError(f"dual_clip must be > 1 (the bound c), got {dual_clip!r}")
  return float(dual_clip)


def check_eps(eps_low: float, eps_high: float) -> None:
  if not 0.0 <= eps_low < 1.0:
    raise ValueError(f"eps_low must be in [0, 1), got {eps_low!r}")
  if not eps_high >= 0.0:
    raise ValueError(f"eps_high must be >= 0, got {eps_high!r}")


def ppo_clip_per_token(log_ratio: Array, advantages: Array, eps_low: float = 0.2,
                       eps_high: float = 0.2, dual_clip: float | None = None
                       ) -> tuple[Array, Array]:
  """PPO clipped surrogate per token, with clip-higher and optional dual clip.

  ``r = exp(clip(log_ratio, -20, 20))``,
  ``Lc = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``; with dual clip c:
  ``l = where(A < 0, min(-c A, Lc), Lc)``.

  Args:
    log_ratio: float [B,T] ``logp - old_logp`` (carries the gradient).
    advantages: float [B,T].
    eps_low, eps_high: asymmetric clip range (DAPO clip-higher: 0.2, 0.28).
    dual_clip: bound c > 1 or None.

  Returns:
    ``(loss [B,T], clipped [B,T] bool)``; ``clipped`` marks tokens whose loss came from a
    clipped branch (the gradient through the ratio is zero there).

  References: Schulman et al. 2017 (PPO); Ye et al. 2020 (dual clip); Yu et al. 2025 (DAPO).
  """
  ratio = clamped_exp(log_ratio)
  unclipped = -advantages * ratio
  clipped_loss = -advantages * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  loss = jnp.maximum(unclipped, clipped_loss)
  clipped = clipped_loss > unclipped
  if dual_clip is not None:
    cap = -dual_clip * advantages
    dual = (advantages < 0) & (cap < loss)
    loss = jnp.where(dual, cap, loss)
    clipped = clipped | dual
  return loss, clipped


def sequence_log_ratio(logp: Array, old_logp: Array, mask: Array) -> Array:
  """GSPO length-normalised sequence log-ratio ``sum_t m (logp - old) / sum_t m``: [B,T] -> [B].

  References: Zheng et al. 2025, Group Sequence Policy Optimization (GSPO).
  """
  return masked_mean(logp - old_logp, mask, axis=1)


def gspo_log_ratio(logp: Array, old_logp: Array, mask: Array) -> Array:
  """Per-token log-ratio whose value is GSPO's ``log s_i`` and whose gradient is per token.

  ``logp - sg(logp) + sg(clip(log s_i, -20, 20))``.

  Returns:
    float [B,T].

  References: Zheng et al. 2025, Group Sequence Policy Optimization (GSPO-token).
  """
  log_s = jax.lax.stop_gradient(
      jnp.clip(sequence_log_ratio(logp, old_logp, mask), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
  return logp - jax.lax.stop_gradient(logp) + log_s[:, None]


def truncated_is_weights(old_logp: Array, behaviour_logp: Array, mask: Array,
                         cap: float | None = 2.0, level: str = "token") -> Array:
  """Truncated importance weights correcting sampler/trainer mismatch (detached).

  token: ``min(exp(old - mu), C)``; sequence: ``min(exp(sum_t m (old - mu)), C)`` broadcast
  over the row. ``cap=None`` leaves the weight untruncated. Log-weights are clamped to
  [-20, 20] before exp.

  Returns:
    float [B,T] (0 on invalid tokens).

  References: Yao et al. 2025, Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training (TIS).
  """
  check_choice("TIS level", level, TIS_LEVELS)
  d = jnp.where(mask, old_logp - behaviour_logp, 0.0)
  if level == "sequence":
    d = jnp.broadcast_to(jnp.sum(d, axis=1, keepdims=True), d.shape)
  w = clamped_exp(d)
  if cap is not None:
    w = jnp.minimum(w, cap)
  return jax.lax.stop_gradient(jnp.where(mask, w, 0.0))


def decoupled_weights(prox_logp: Array, behaviour_logp: Array, mask: Array,
                      cap: float = 5.0, mode: str = "mask") -> tuple[Array, Array]:
  """AReaL behaviour weights ``w = exp(prox - mu)`` (detached) and the kept-token mask.

  mode "mask": tokens with ``w > cap`` are dropped from the numerator (``keep`` False);
  mode "clamp": ``w = min(w, cap)`` and every valid token is kept.

  Returns:
    ``(w [B,T], keep [B,T] bool)``.

  References: Fu et al. 2025, AReaL: A Large-Scale Asynchronous RL System (decoupled PPO).
  """
  check_choice("decoupled mode", mode, DECOUPLED_MODES)
  w = jax.lax.stop_gradient(clamped_exp(jnp.where(mask, prox_logp - behaviour_logp, 0.0)))
  if mode == "clamp":
    return jnp.where(mask, jnp.minimum(w, cap), 0.0), mask
  keep = mask & (w <= cap)
  return jnp.where(mask, w, 0.0), keep


def check_mis_band(low: float | None, high: float | None) -> None:
  """MIS bounds: ``0 <= low < 1`` and ``high >= 1`` (None: unbounded on that side), so a row
  without mismatch (rho = 1) is always kept."""
  if low is not None and not 0.0 <= low < 1.0:
    raise ValueError(f"mis_low must be in [0, 1) or None (a sequence without mismatch, "
                     f"rho = 1, must be kept), got {low!r}")
  if high is not None and not high >= 1.0:
    raise ValueError(f"mis_high must be >= 1 or None (a sequence without mismatch, rho = 1, "
                     f"must be kept), got {high!r}")


def check_icepop_band(beta: float, alpha: float | None) -> None:
  """IcePop band: ``beta > 1`` and ``0 < alpha < 1`` (None: ``1 / beta``)."""
  if not (isinstance(beta, (int, float)) and beta > 1.0):
    raise ValueError(f"icepop_beta must be > 1 (the band is [alpha, beta] around 1), "
                     f"got {beta!r}")
  if alpha is not None and not 0.0 < alpha < 1.0:
    raise ValueError(f"icepop_alpha must be in (0, 1) or None (= 1/icepop_beta), got {alpha!r}")


def masked_is_weights(old_logp: Array, behaviour_logp: Array, mask: Array,
                      low: float | None = None, high: float | None = 2.0,
                      level: str = "sequence", mode: str = "weight") -> tuple[Array, Array]:
  """Masked importance sampling (MIS): keep a row (or token) only while its trainer/sampler
  ratio lies in ``[low, high]``; weight what is kept by the ratio (detached).

  sequence: ``rho_i = exp(sum_t m_t (old - mu))``, one value per row;
  token: ``rho_t = exp(old_t - mu_t)``. ``keep = m & (low <= rho <= high)``; the weight is
  ``rho`` (``mode="weight"``) or 1 (``mode="mask"``, rejection only). ``low``/``high`` None
  leave that side unbounded. The log-ratio is clamped to [-20, 20] before exp (after the sum,
  for a sequence).

  Args:
    old_logp: float [B,T], the trainer's log-probs of the sampled tokens.
    behaviour_logp: float [B,T], the sampler's (mu).
    mask: bool [B,T].
    low, high: the band (``0 <= low < 1 <= high``).
    level: one of ``MIS_LEVELS``.
    mode: one of ``MIS_MODES``.

  Returns:
    ``(w [B,T], keep [B,T] bool)``; ``w`` is 0 off the mask, ``keep`` a subset of ``mask``.

  References: Liu, Li et al. 2025, When Speed Kills Stability: Demystifying RL Collapse from
  the Training-Inference Mismatch (sequence- and token-level MIS).
  """
  check_choice("MIS level", level, MIS_LEVELS)
  check_choice("MIS mode", mode, MIS_MODES)
  check_mis_band(low, high)
  mask = mask.astype(bool)
  d = jnp.where(mask, old_logp - behaviour_logp, 0.0)
  if level == "sequence":
    d = jnp.broadcast_to(jnp.sum(d, axis=1, keepdims=True), d.shape)
  rho = jax.lax.stop_gradient(clamped_exp(d))
  keep = mask
  if low is not None:
    keep = keep & (rho >= low)
  if high is not None:
    keep = keep & (rho <= high)
  w = rho if mode == "weight" else jnp.ones_like(rho)
  return jnp.where(mask, w, 0.0), keep


def icepop_weights(old_logp: Array, behaviour_logp: Array, mask: Array, beta: float = 5.0,
                   alpha: float | None = None) -> tuple[Array, Array]:
  """IcePop two-sided token mask: ``k_t = exp(old_t - mu_t)``; tokens with ``k_t`` outside
  ``[alpha, beta]`` get no gradient, the others are weighted by ``k_t`` (detached).

  ``w_t = k_t * 1[alpha <= k_t <= beta]``; ``alpha = 1 / beta`` unless given. The token-level
  case of ``masked_is_weights`` with a band on both sides.

  Returns:
    ``(w [B,T], keep [B,T] bool)``; ``w`` is ``k_t`` on valid tokens (0 off the mask), the
    product ``where(keep, w, 0)`` is the IcePop factor.

  References: Ling Team 2025, Every Step Evolves: Scaling Reinforcement Learning for
  Trillion-Scale Thinking Model (Ring-1T; IcePop).
  """
  check_icepop_band(beta, alpha)
  low = 1.0 / beta if alpha is None else alpha
  return masked_is_weights(old_logp, behaviour_logp, mask, low, beta, "token", "weight")


def geo_mean_is_weights(old_logp: Array, behaviour_logp: Array, mask: Array,
                        cap: float | None = None) -> Array:
  """Geometric-mean sequence importance weight (detached), the same for every token of a row.

  ``rho_i = exp(sum_t m_t (old - mu) / sum_t m_t)`` (the geometric mean of the row's token
  ratios, so it does not grow with length), then ``min(rho_i, cap)``; ``cap=None`` leaves it
  untruncated. The mean log-ratio is clamped to [-20, 20] before exp.

  Returns:
    float [B,T] (0 on invalid tokens; a row without valid tokens has weight 0).

  References: Zheng et al. 2025, Group Sequence Policy Optimization (the length-normalised
  sequence ratio), here taken between trainer and sampler as a mismatch weight; Liu, Li et
  al. 2025, When Speed Kills Stability (the sequence-level ratio it normalises).
  """
  if cap is not None and not cap > 0:
    raise ValueError(f"geo_mean_cap must be > 0 or None, got {cap!r}")
  mask = mask.astype(bool)
  log_rho = masked_mean(old_logp - behaviour_logp, mask, axis=1)
  w = clamped_exp(log_rho)
  if cap is not None:
    w = jnp.minimum(w, cap)
  return jax.lax.stop_gradient(jnp.where(mask, w[:, None], 0.0))


def minpro_weights(logp: Array, behaviour_logp: Array, mask: Array) -> Array:
  """MinPRO prefix weight (detached): the smallest token ratio of the tokens before ``t``.

  ``rho_s = exp(logp_s - mu_s)`` (current policy against the sampler),
  ``w_t = min_{s < t, m_s} rho_s`` and ``w_t = 1`` when no valid token precedes ``t`` (the
  empty prefix). It stands in for the cumulative prefix ratio ``prod_{s < t} rho_s`` that
  corrects the state distribution of token ``t``; token ``t``'s own ratio is the policy
  term's. Invalid tokens (padding, observation tokens) neither get a weight nor enter a
  later token's minimum.

  Returns:
    float [B,T] (0 on invalid tokens).

  References: "A Step Back: Prefix Importance Ratio Stabilizes Policy Optimization", 2026
  (MinPRO).
  """
  mask = mask.astype(bool)
  d = jnp.where(mask, jax.lax.stop_gradient(logp - behaviour_logp), jnp.inf)
  running = jax.lax.cummin(d, axis=1)  # min over s <= t
  before = jnp.concatenate([jnp.full_like(running[:, :1], jnp.inf), running[:, :-1]], axis=1)
  empty = before == jnp.inf
  w = jnp.where(empty, 1.0, clamped_exp(jnp.where(empty, 0.0, before)))
  return jnp.where(mask, w, 0.0)


def m2po_mask(delta: Array, mask: Array, tau: float = 0.04) -> Array:
  """M2PO second-moment mask: drop the fewest largest-``delta^2`` tokens so the rest average < tau.

  Sort ``delta^2`` over all valid tokens in descending order; drop the top k with the
  smallest k such that the mean of the kept ``delta^2`` is below ``tau`` (an empty set has
  mean 0). Ties are broken by position, so exactly k tokens are dropped.

  Args:
    delta: float [B,T], ``mu - prox`` per token.
    mask: bool [B,T].
    tau: second-moment threshold.

  Returns:
    bool [B,T] kept tokens (a subset of ``mask``).

  References: Zheng et al. 2025, Prosperity before Collapse: How Far Can Off-Policy RL Reach
  with Stale Data on LLMs? (M2PO).
  """
  check_same_shape("delta", delta, mask=mask)
  mask = mask.astype(bool)
  d2 = jnp.where(mask, jax.lax.stop_gradient(delta) ** 2, 0.0).reshape(-1)
  valid = mask.reshape(-1)
  n = jnp.sum(valid)
  key = jnp.where(valid, -d2, jnp.inf)  # descending d2, invalid last
  order = jnp.argsort(key, stable=True)
  sorted_d2 = d2[order]
  total = jnp.sum(sorted_d2)
  # dropped_k = sum of the k largest, k = 0..size
  dropped = jnp.concatenate([jnp.zeros((1,), d2.dtype), jnp.cumsum(sorted_d2)])
  k = jnp.arange(d2.shape[0] + 1)
  kept_n = (n - k).astype(d2.dtype)
  kept_mean = safe_divide(total - dropped, kept_n)
  ok = (kept_mean < tau) | (kept_n <= 0)
  k_min = jnp.argmax(ok)
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
  keep = valid & (rank >= k_min)
  return keep.reshape(mask.shape)


def m2po_clip_bound(delta: Array, mask: Array, tau: float = 0.04) -> Array:
  """M2PO clip-budget variant: the bound b with ``sum_t min(delta_t^2, b^2) = tau * n``.

  Solved exactly on the sorted ``delta^2``; ``b = inf`` when the unclipped second moment is
  already within budget. The ratio is then clipped PPO-style to ``[e^-b, e^b]`` so only
  tokens whose update would push past the bound (the harmful ones) lose their gradient.

  Returns:
    float scalar ``b`` (may be inf).

  References: Zheng et al. 2025 (M2PO); this clip-budget form is a variant of its mask,
  described in docs/ALGORITHMS.md, "Policy losses".
  """
  check_same_shape("delta", delta, mask=mask)
  mask = mask.astype(bool)
  d2 = jnp.where(mask, jax.lax.stop_gradient(delta) ** 2, 0.0).reshape(-1)
  n = jnp.sum(mask).astype(d2.dtype)
  budget = tau * n
  s = jnp.sort(d2)[::-1]  # descending; invalid entries are 0 and sit at the end
  tail = jnp.sum(s) - jnp.concatenate([jnp.zeros((1,), s.dtype), jnp.cumsum(s)])
  k = jnp.arange(s.shape[0] + 1).astype(s.dtype)
  b2 = safe_divide(budget - tail, k)  # b^2 if exactly the k largest are clipped
  upper = jnp.concatenate([jnp.full((1,), jnp.inf, s.dtype), s])  # s_k (k-th largest)
  lower = jnp.concatenate([s, jnp.zeros((1,), s.dtype)])           # s_{k+1}
  ok = (k > 0) & (b2 >= lower) & (b2 <= upper)
  b2_sol = jnp.max(jnp.where(ok, b2, -1.0))
  within = jnp.sum(s) <= budget
  return jnp.where(within | (b2_sol < 0), jnp.inf, jnp.sqrt(jnp.maximum(b2_sol, 0.0)))


def ace_scale(seq_log_ratio_ref: Array, advantages: Array, alpha: float = 1.0) -> Array:
  """ACE asymmetric confidence factor for negative advantages (detached).

  ``1 + alpha * softplus(c_i)`` where ``A_i < 0`` and 1 elsewhere;
  ``c_i = log pi_theta(y_i) / pi_ref(y_i)`` (sequence sum of token log-ratios). Errors the
  policy grew more confident in than the reference get a larger penalty.

  Args:
    seq_log_ratio_ref: float [B], c_i.
    advantages: float [B,T].
    alpha: strength.

  Returns:
    float [B,T] factor multiplying the per-token policy loss.

  References: Xu et al. 2026, Overconfident Errors Need Stronger Correction: Asymmetric
  Confidence Penalties for RL (ACE).
  """
  c = jax.lax.stop_gradient(seq_log_ratio_ref)[:, None]
  return jnp.where(advantages < 0, 1.0 + alpha * jax.nn.softplus(c), 1.0)


def value_loss_per_token(values: Array, old_values: Array, returns: Array,
                         clip: float | None = 0.2) -> tuple[Array, Array]:
  """Clipped value loss ``0.5 max((v - R)^2, (clip(v, v_old +- eps) - R)^2)``.

  Returns:
    ``(loss [B,T], clipped [B,T] bool)``; ``clip=None`` is the plain squared error.

  References: Schulman et al. 2017 (PPO, baselines value clipping); verl critic loss.
  """
  l1 = (values - returns) ** 2
  if clip is None:
    return 0.5 * l1, jnp.zeros(l1.shape, bool)
  vclip = old_values + jnp.clip(values - old_values, -clip, clip)
  l2 = (vclip - returns) ** 2
  return 0.5 * jnp.maximum(l1, l2), l2 > l1
