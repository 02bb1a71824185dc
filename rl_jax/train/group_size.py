"""Adaptive group size (``data.group_size="adaptive"``): samples per prompt from its success rate.

A step's sample budget is B = G·M rows (``Setup.geometry``: groups × samples). It is cut
into W = B / m chunks of m = ``data.group_chunk`` samples; every chunk is one prompt repeated
m times, so the sampler and the prompt-once layout always see the same [W, m, R] shapes
(nothing recompiles when the allocation changes). Each of the step's G prompts gets
k_i >= 1 chunks (n_i = k_i·m samples, Σ k_i = W, k_i <= Z), chosen to maximise the
expected number of prompts whose samples are not all equal (the only groups GRPO learns
from) under each prompt's Beta(α_i, β_i) posterior on its success rate p_i::

    f(n; α, β) = P(n samples are mixed) = 1 − E[p^n] − E[(1 − p)^n],
    E[p^n] = B(α + n, β) / B(α, β)

f is concave in n, so adding chunks one at a time to the prompt with the largest gain
``f((k+1)m) − f(km)`` is optimal. A prompt near p = 0.5 is mixed after a few samples and
gets few extra chunks; a prompt with small but non-zero p needs about 1/p samples (the
sGPO rule, group size ∝ 1/p) and gets more; reliably solved and hopeless prompts gain
almost nothing. References: sGPO ("Trading Inference FLOPs for Training Efficiency in
RLVR": group size from the inverse success rate); XRPO (Explore-eXploit GRPO: a rollout
allocator favouring prompts with the most uncertainty to resolve).

Advantages are per prompt, across its chunks: the learner regroups the [W, m] rows into
[G, Z·m] with the missing samples' rewards set to NaN (every estimator leaves non-finite
rewards out of its statistics and gives them advantage 0), runs the run's estimator
unchanged, and scatters the result back to [W, m].

Shapes (the package legend, ``rl_jax/__init__.py``): G prompts, M samples per prompt
(plain), W chunks, m chunk size,
Z most chunks of one prompt, R new tokens.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from scipy import special

from rl_jax import losses

__all__ = ["METRICS", "allocate", "mixed_prob",
           "per_prompt_advantages", "prompt_spread", "regroup_index", "regroup_inputs",
           "ungroup", "zero_variance_fraction"]

METRICS = ("group_size_min", "group_size_max", "group_size_mixed_mean")


def mixed_prob(alpha: np.ndarray, beta: np.ndarray, n) -> np.ndarray:
  """f(n) = 1 − B(α+n, β)/B(α, β) − B(α, β+n)/B(α, β): the probability that n >= 1 samples
  of a prompt with success rate p ~ Beta(α, β) are not all equal. Shapes broadcast."""
  a, b = np.asarray(alpha, np.float64), np.asarray(beta, np.float64)
  lb = special.betaln(a, b)
  return 1.0 - np.exp(special.betaln(a + n, b) - lb) - np.exp(special.betaln(a, b + n) - lb)


def allocate(alpha: np.ndarray, beta: np.ndarray, chunks: int, chunk: int,
             cap: int | None = None) -> np.ndarray:
  """Chunks per prompt: k int64 [G], k_i >= 1, Σ k = ``chunks``, k_i <= ``cap``.

  Greedy on the concave gains ``f((k+1)·chunk) − f(k·chunk)`` (``mixed_prob``); ties go to
  the earlier prompt. Args: alpha, beta float [G] posteriors; chunks W; chunk m; cap Z
  (None: no cap).
  """
  alpha, beta = np.asarray(alpha, np.float64), np.asarray(beta, np.float64)
  G = len(alpha)
  cap = chunks if cap is None else int(cap)
  if not G <= chunks <= G * cap:
    raise ValueError(f"cannot give {G} prompts between 1 and {cap} chunks each from {chunks}")
  k = np.ones(G, np.int64)
  for _ in range(chunks - G):
    gain = mixed_prob(alpha, beta, (k + 1) * chunk) - mixed_prob(alpha, beta, k * chunk)
    k[int(np.argmax(np.where(k < cap, gain, -np.inf)))] += 1
  return k


def prompt_spread(rewards: np.ndarray, groups: np.ndarray | None) -> np.ndarray:
  """Whether each prompt's rewards are not all equal: bool [G] from rewards [W, m] and the
  prompt of each chunk ``groups`` int [W] (None: one prompt per row)."""
  if groups is None:
    return np.ptp(rewards, axis=1) > 0
  G = int(groups.max()) + 1
  hi = np.full(G, -np.inf)
  lo = np.full(G, np.inf)
  np.maximum.at(hi, groups, rewards.max(axis=1))
  np.minimum.at(lo, groups, rewards.min(axis=1))
  return hi > lo


def zero_variance_fraction(rewards: np.ndarray, groups: np.ndarray | None) -> float:
  """Fraction of prompts whose rewards are all equal (reward std 0 when ``groups`` is None)."""
  if groups is None:
    return float(np.mean(rewards.std(axis=1) == 0))
  return float(np.mean(~prompt_spread(rewards, groups)))


def regroup_index(groups: np.ndarray, G: int, m: int, Z: int) -> tuple[np.ndarray, np.ndarray]:
  """Where the rows of W chunks (prompt ``groups`` int [W], in order) sit in [G, Z·m].

  Returns (gather int32 [G, Z·m]: the row in [W·m] of each slot, -1 for a missing sample;
  scatter int32 [W·m]: the flat slot in [G·Z·m] of each row). A prompt's chunks fill its
  slots in chunk order.
  """
  groups = np.asarray(groups, np.int64)
  W = len(groups)
  seen = np.zeros(G, np.int64)
  scatter = np.empty(W * m, np.int64)
  for c, g in enumerate(groups):
    if seen[g] >= Z:
      raise ValueError(f"prompt {g} has more than {Z} chunks")
    scatter[c * m:(c + 1) * m] = g * Z * m + seen[g] * m + np.arange(m)
    seen[g] += 1
  gather = np.full(G * Z * m, -1, np.int64)
  gather[scatter] = np.arange(W * m)
  return gather.reshape(G, Z * m).astype(np.int32), scatter.astype(np.int32)


def regroup_inputs(x: losses.ObjectiveInputs, gather) -> losses.ObjectiveInputs:
  """[W, m, ...] objective inputs -> [G, Z·m, ...]: missing samples get NaN rewards (and
  reward components), False masks and zeros elsewhere."""
  gather = jnp.asarray(gather)
  ok = gather >= 0
  idx = jnp.maximum(gather, 0)
  fill = {"rewards": jnp.nan, "reward_components": jnp.nan, "mask": False,
          "generated_mask": False}

  def take(name, a):
    if a is None:
      return None
    flat = a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])
    out = jnp.take(flat, idx, axis=0)
    keep = ok.reshape(ok.shape + (1,) * (out.ndim - 2))
    return jnp.where(keep, out, jnp.asarray(fill.get(name, 0), out.dtype))

  return losses.ObjectiveInputs(**{k: take(k, v) for k, v in x._asdict().items()})


def ungroup(a, scatter, W: int, m: int):
  """[G, Z·m, ...] per-slot values -> the [W, m, ...] rows (``regroup_index``'s scatter)."""
  if a is None:
    return None
  flat = a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])
  return jnp.take(flat, jnp.asarray(scatter), axis=0).reshape(W, m, *a.shape[2:])


def per_prompt_advantages(estimate: Callable, x: losses.ObjectiveInputs, groups: np.ndarray,
                          G: int, Z: int) -> losses.Advantages:
  """An estimator over each prompt's chunks together: ``estimate`` (``ObjectiveInputs ->
  Advantages``, e.g. ``Objective.advantages_from``), inputs [W, m, ...] and the prompt
  ``groups`` int [W] of each chunk -> ``Advantages`` on the [W, m] rows."""
  W, m = x.rewards.shape
  gather, scatter = regroup_index(groups, G, m, Z)
  out = estimate(regroup_inputs(x, gather))
  sharding = getattr(x.rewards, "sharding", None)  # rows split like the inputs' rows

  def back(a):
    a = ungroup(a, scatter, W, m)
    return a if a is None or sharding is None else jax.device_put(a, sharding)

  return losses.Advantages(back(out.advantages), back(out.returns), back(out.keep))
