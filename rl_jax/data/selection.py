"""Prompt selection: uniform epochs, GRESO skipping, Beta-posterior selection, DAPO filter.

Every selector keeps its state in a small NamedTuple of ints, floats and numpy arrays, and
every function is pure: same state (and step) in, same batch and state out. Randomness comes
from ``np.random.default_rng([seed, ...])`` with the seed stored in the state, so a
checkpointed state (``state._asdict()``) resumes exactly (``Cls(**d)`` restores it).

Shapes (the ``rl_jax.data`` legend): G prompts (groups) in a step, M samples per prompt;
per-prompt state has one entry per train prompt, ``[dataset_size]``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = [
    "BetaState", "GresoState", "SamplerState", "beta_init", "beta_scores", "beta_select",
    "beta_update", "dynamic_sampling_mask", "greso_init", "greso_keep", "greso_select",
    "greso_skip_prob", "greso_update", "sampler_init", "sampler_next", "zero_variance_kind",
]


# ------------------------------------------------------------------ uniform sampler
class SamplerState(NamedTuple):
  """Position in an endless sequence of seeded epoch permutations."""

  seed: int
  epoch: int
  position: int


def sampler_init(seed: int = 0) -> SamplerState:
  """A sampler at the start of epoch 0."""
  return SamplerState(int(seed), 0, 0)


def _permutation(seed: int, epoch: int, size: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(size)


def sampler_next(state: SamplerState, dataset_size: int, batch_size: int
                 ) -> tuple[np.ndarray, SamplerState]:
  """The next ``batch_size`` dataset indices, without replacement within an epoch.

  A batch that crosses an epoch boundary finishes one permutation and starts the next.

  Args:
    state: current position.
    dataset_size: number of prompts in the dataset (> 0).
    batch_size: number of indices (> 0).

  Returns:
    (indices int64 [batch_size], new state).
  """
  if dataset_size <= 0:
    raise ValueError(f"dataset is empty (dataset_size={dataset_size})")
  if batch_size <= 0:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  seed, epoch, pos = state
  out = []
  while len(out) < batch_size:
    take = min(batch_size - len(out), dataset_size - pos)
    out.extend(_permutation(seed, epoch, dataset_size)[pos:pos + take].tolist())
    pos += take
    if pos == dataset_size:
      epoch, pos = epoch + 1, 0
  return np.asarray(out, np.int64), SamplerState(seed, epoch, pos)


# ------------------------------------------------------------------ DAPO dynamic sampling
def dynamic_sampling_mask(rewards: np.ndarray) -> np.ndarray:
  """Keep a group iff its rewards are not all equal (reward std > 0).

  Uses max − min > 0, which is exactly std > 0 without float round-off in the std.

  Args:
    rewards: float [G, M].

  Returns:
    bool [G].
  References: Yu et al. 2025, "DAPO", dynamic sampling.
  """
  rewards = np.asarray(rewards)
  if rewards.ndim != 2:
    raise ValueError(f"rewards must be [G, M], got shape {rewards.shape}")
  return np.ptp(rewards, axis=1) > 0


def zero_variance_kind(rewards: np.ndarray, threshold: float = 0.5) -> np.ndarray:
  """Per group: +1 all-correct (all equal and > threshold), −1 all-wrong, 0 mixed.

  Args:
    rewards: float [G, M].
    threshold: reward above which an all-equal group counts as solved.

  Returns:
    int8 [G].
  """
  rewards = np.asarray(rewards)
  zero_var = ~dynamic_sampling_mask(rewards)
  easy = rewards[:, 0] > threshold
  return np.where(zero_var, np.where(easy, 1, -1), 0).astype(np.int8)


# ------------------------------------------------------------------ GRESO
class GresoState(NamedTuple):
  """Per-prompt zero-variance history and the two exploration probabilities.

  streak: int32 [dataset_size], consecutive most recent rollouts of the prompt whose group had zero
    reward variance (0 for unseen prompts and after any mixed group).
  kind: int8 [dataset_size], +1 if that streak is all-correct (easy), −1 all-wrong (hard), 0 none.
  p_easy, p_hard: exploration probabilities p.
  seed: randomness of the skip decisions.
  """

  streak: np.ndarray
  kind: np.ndarray
  p_easy: float
  p_hard: float
  seed: int


def greso_init(dataset_size: int, p: float = 0.5, seed: int = 0) -> GresoState:
  """No history: every prompt is unseen (never skipped)."""
  return GresoState(np.zeros(dataset_size, np.int32), np.zeros(dataset_size, np.int8),
                    float(p), float(p), int(seed))


def greso_skip_prob(state: GresoState, indices: np.ndarray, floor: float = 0.01) -> np.ndarray:
  """Skip probability ``1 − max(p^c, floor)`` of each prompt; 0 when c = 0.

  Args:
    state: GRESO state.
    indices: int [G] prompt indices.
    floor: minimum keep probability (0.01).

  Returns:
    float64 [G].
  References: Zheng et al. 2025, "Act Only When It Pays: Efficient RL for LLM Reasoning via
    Selective Rollouts" (GRESO).
  """
  indices = np.asarray(indices)
  c = state.streak[indices]
  p = np.where(state.kind[indices] > 0, state.p_easy, state.p_hard)
  prob = 1.0 - np.maximum(p**c, floor)
  return np.where(c == 0, 0.0, prob)


def greso_keep(state: GresoState, indices: np.ndarray, step: int, attempt: int = 0,
               floor: float = 0.01) -> np.ndarray:
  """Bernoulli keep decisions (True = roll out) for candidate prompts.

  Args:
    state: GRESO state.
    indices: int [G] candidates.
    step: training step (seeds the draw together with ``state.seed`` and ``attempt``).
    attempt: index of the candidate batch within the step.
    floor: see ``greso_skip_prob``.

  Returns:
    bool [G].
  """
  u = np.random.default_rng([state.seed, step, attempt]).random(len(indices))
  return u >= greso_skip_prob(state, indices, floor)


def greso_update(state: GresoState, indices: np.ndarray, rewards: np.ndarray, *,
                 target_easy: float = 0.083, target_hard: float = 0.167, delta: float = 0.01,
                 p_min: float = 0.05, p_max: float = 0.95, threshold: float = 0.5
                 ) -> GresoState:
  """Record the rolled-out groups and adapt p_easy/p_hard toward the target ratios.

  A zero-variance group extends its prompt's streak (restarting at 1 if the kind changed);
  a mixed group resets it to 0. If the fraction of all-correct groups in this batch exceeds
  ``target_easy``, ``p_easy`` falls by ``delta`` (more skipping), else it rises; likewise
  ``p_hard`` with all-wrong groups; both are clipped to [p_min, p_max].

  Args:
    state: GRESO state.
    indices: int [G] distinct prompt indices rolled out this step.
    rewards: float [G, M] their rewards.
    target_easy, target_hard: target zero-variance ratios.
    delta: adaptation step of p.
    p_min, p_max: bounds of p.
    threshold: see ``zero_variance_kind``.

  Returns:
    The new state (inputs are not modified).
  """
  indices = np.asarray(indices)
  kind = zero_variance_kind(rewards, threshold)
  streak, kinds = state.streak.copy(), state.kind.copy()
  same = kinds[indices] == kind
  streak[indices] = np.where(kind == 0, 0, np.where(same, streak[indices] + 1, 1))
  kinds[indices] = kind
  k = max(len(indices), 1)
  easy_ratio, hard_ratio = np.sum(kind > 0) / k, np.sum(kind < 0) / k
  p_easy = state.p_easy + (-delta if easy_ratio > target_easy else delta)
  p_hard = state.p_hard + (-delta if hard_ratio > target_hard else delta)
  return GresoState(streak, kinds, float(np.clip(p_easy, p_min, p_max)),
                    float(np.clip(p_hard, p_min, p_max)), state.seed)


def greso_select(sampler: SamplerState, state: GresoState, batch_size: int, step: int,
                 max_attempts: int = 10, floor: float = 0.01
                 ) -> tuple[np.ndarray, SamplerState, int]:
  """Draw candidates uniformly and drop GRESO-skipped ones until ``batch_size`` are kept.

  After ``max_attempts`` candidate batches the batch is topped up with skipped candidates
  (first drawn first), so a step never stalls.

  Args:
    sampler: uniform sampler state over the prompts (``dataset_size = len(state.streak)``).
    state: GRESO state.
    batch_size: prompts wanted.
    step: training step (for the random draws).
    max_attempts: candidate batches to draw at most.
    floor: see ``greso_skip_prob``.

  Returns:
    (indices int64 [batch_size], new sampler state, number of skipped candidates).
  """
  kept, skipped = [], []
  for attempt in range(max_attempts):
    cand, sampler = sampler_next(sampler, len(state.streak), batch_size)
    keep = greso_keep(state, cand, step, attempt, floor)
    kept.extend(cand[keep].tolist())
    skipped.extend(cand[~keep].tolist())
    if len(kept) >= batch_size:
      break
  n_skipped = len(skipped)
  out = (kept + skipped)[:batch_size]
  return np.asarray(out, np.int64), sampler, n_skipped


# ------------------------------------------------------------------ Beta posterior
class BetaState(NamedTuple):
  """Per-prompt Beta(alpha, beta) posterior over the success rate.

  alpha, beta: float64 [dataset_size]; alpha0, beta0: the prior; decay: λ; seed: Thompson draws.
  """

  alpha: np.ndarray
  beta: np.ndarray
  alpha0: float
  beta0: float
  decay: float
  seed: int


def beta_init(dataset_size: int, alpha0: float = 1.0, beta0: float = 1.0, decay: float = 0.9,
              seed: int = 0) -> BetaState:
  """Every prompt at the prior Beta(alpha0, beta0)."""
  if not (alpha0 > 0 and beta0 > 0 and 0.0 <= decay <= 1.0):
    raise ValueError(f"need alpha0, beta0 > 0 and decay in [0, 1], got {alpha0}, {beta0}, "
                     f"{decay}")
  return BetaState(np.full(dataset_size, float(alpha0)), np.full(dataset_size, float(beta0)),
                   float(alpha0), float(beta0), float(decay), int(seed))


def beta_update(state: BetaState, indices: np.ndarray, successes: np.ndarray,
                counts: np.ndarray) -> BetaState:
  """One step: decay every prompt toward the prior, then add the new evidence.

  ``α ← λα + (1−λ)α₀ + k`` and ``β ← λβ + (1−λ)β₀ + (n − k)``, where k and n are zero for
  prompts not rolled out this step.

  Args:
    state: Beta state.
    indices: int [G] prompts rolled out (repeats accumulate).
    successes: float [G] k (e.g. the sum of a group's rewards in [0, 1]).
    counts: float [G] n (samples per group).

  Returns:
    The new state.
  References: Beta-posterior prompt selection (VADE / InSight family).
  """
  lam = state.decay
  alpha = lam * state.alpha + (1 - lam) * state.alpha0
  beta = lam * state.beta + (1 - lam) * state.beta0
  k = np.asarray(successes, np.float64)
  n = np.asarray(counts, np.float64)
  if np.any(k < 0) or np.any(k > n):
    raise ValueError("need 0 <= successes <= counts")
  np.add.at(alpha, np.asarray(indices), k)
  np.add.at(beta, np.asarray(indices), n - k)
  return state._replace(alpha=alpha, beta=beta)


def beta_scores(state: BetaState, indices: np.ndarray, step: int,
                mode: str = "thompson") -> np.ndarray:
  """Selection score of each candidate (higher is picked first).

  thompson: ``−|θ − 0.5|`` with ``θ ~ Beta(α, β)`` drawn from ``[seed, step]``.
  variance: ``μ(1 − μ)`` with posterior mean ``μ = α/(α + β)`` (expected reward variance,
    i.e. the GRPO signal of the prompt).

  Args:
    state: Beta state.
    indices: int [G] candidates.
    step: training step (Thompson draws).
    mode: ``"thompson"`` or ``"variance"``.

  Returns:
    float64 [G].
  """
  a, b = state.alpha[indices], state.beta[indices]
  if mode == "thompson":
    theta = np.random.default_rng([state.seed, step]).beta(a, b)
    return -np.abs(theta - 0.5)
  if mode == "variance":
    mu = a / (a + b)
    return mu * (1 - mu)
  raise ValueError(f"unknown Beta selection mode {mode!r}; use 'thompson' or 'variance'")


def beta_select(state: BetaState, batch_size: int, step: int,
                candidates: np.ndarray | None = None, mode: str = "thompson") -> np.ndarray:
  """The ``batch_size`` candidates with the highest scores (ties: lower position first).

  Args:
    state: Beta state.
    batch_size: prompts wanted (≤ number of candidates).
    step: training step.
    candidates: int [num_candidates] pool (default: all ``dataset_size`` prompts).
    mode: see ``beta_scores``.

  Returns:
    int64 [batch_size] prompt indices.
  """
  cand = np.arange(len(state.alpha)) if candidates is None else np.asarray(candidates)
  if not 0 < batch_size <= len(cand):
    raise ValueError(f"batch_size must be in [1, {len(cand)}], got {batch_size}")
  order = np.argsort(-beta_scores(state, cand, step, mode), kind="stable")
  return cand[order[:batch_size]].astype(np.int64)
