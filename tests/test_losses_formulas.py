"""Hand-computed cases and property tests for the plain formulas in rl_jax.losses."""

import functools
import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rl_jax import losses

SETTINGS = settings(max_examples=25, deadline=None)
FLOATS = st.floats(-5.0, 5.0, allow_nan=False, width=32)
# multiples of 1/8 in [-5, 5]: a shift by one of them is exact in float32 (a shift that rounds
# rewards together, as 1 + 1e-8 == 1 does, changes the group and is not a counterexample)
EIGHTHS = st.integers(-40, 40).map(lambda i: i / 8)


def close(a, b, tol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


# ------------------------------------------------------------------------- advantages
def test_grpo_hand_case():
  a = losses.grpo_advantages(jnp.array([[1.0, 0.0, 0.0, 1.0]]))
  std = math.sqrt(1.0 / 3.0)  # unbiased: sum of 4 * 0.25 over 3
  close(a, [[0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6)]])


def test_dr_grpo_and_rloo_hand_cases():
  close(losses.grpo_advantages(jnp.array([[1.0, 0.0, 0.0, 1.0]]), scale="none"),
        [[0.5, -0.5, -0.5, 0.5]])
  close(losses.rloo_advantages(jnp.array([[1.0, 0.0, 0.0]])), [[1.0, -0.5, -0.5]])


def test_group_of_one_and_nan_rewards():
  close(losses.grpo_advantages(jnp.array([[3.0]])), [[3.0 / (1.0 + 1e-6)]])
  close(losses.rloo_advantages(jnp.array([[3.0]])), [[3.0]])
  a = losses.grpo_advantages(jnp.array([[1.0, jnp.nan, 0.0]]))
  s = math.sqrt(0.5)
  close(a, [[0.5 / (s + 1e-6), 0.0, -0.5 / (s + 1e-6)]])
  assert np.all(np.isfinite(losses.rloo_advantages(jnp.array([[jnp.inf, 1.0, 2.0]]))))


@SETTINGS
@given(hnp.arrays(np.float32, (3, 4), elements=EIGHTHS), EIGHTHS)
def test_grpo_shift_invariant_and_zero_for_constant(r, c):
  f = jax.jit(losses.grpo_advantages)
  close(f(jnp.asarray(r) + c), f(jnp.asarray(r)), tol=2e-3)
  close(f(jnp.full((3, 4), c)), np.zeros((3, 4)))


@SETTINGS
@given(hnp.arrays(np.float32, (2, 5), elements=FLOATS))
def test_rloo_is_leave_one_out(r):
  ref = np.stack([[r[g, i] - np.mean(np.delete(r[g], i)) for i in range(5)] for g in range(2)])
  close(jax.jit(losses.rloo_advantages)(jnp.asarray(r)), ref, tol=1e-4)


def test_reinforce_pp_baseline_matches_token_expanded_whitening():
  r = np.array([[1.0, 0.0], [1.0, 1.0]], np.float32)
  lengths = np.array([[1, 3], [2, 2]])
  a = r - r.mean(axis=1, keepdims=True)
  tokens = np.concatenate([np.full(l, v) for v, l in zip(a.ravel(), lengths.ravel())])
  ref = (a - tokens.mean()) / np.sqrt(tokens.var(ddof=1) + 1e-8)
  out = jax.jit(losses.reinforce_pp_baseline_advantages)(jnp.asarray(r), jnp.asarray(lengths))
  close(out, ref)
  # hand values: mu = -1/8, var = 0.125
  close(ref[0, 0], 0.625 / math.sqrt(0.125))


def test_reinforce_pp_matches_loop_reference():
  rng = np.random.default_rng(0)
  rewards = np.array([1.0, -0.5], np.float32)
  mask = np.array([[1, 1, 1, 0], [1, 0, 1, 1]], bool)
  kl = rng.normal(size=(2, 4)).astype(np.float32)
  beta, gamma = 0.3, 0.9
  ret = np.zeros((2, 4))
  for b in range(2):
    valid = np.flatnonzero(mask[b])
    acc = 0.0
    for j, t in enumerate(valid[::-1]):
      rt = -beta * kl[b, t] + (rewards[b] if j == 0 else 0.0)
      acc = rt + gamma * acc
      ret[b, t] = acc
  v = ret[mask]
  ref = np.where(mask, (ret - v.mean()) / np.sqrt(v.var(ddof=1) + 1e-8), 0.0)
  # one program, not op by op (beta and gamma closed over)
  out = jax.jit(lambda r, m, kl: losses.reinforce_pp_advantages(r, m, kl, beta, gamma))(
      jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(kl))
  close(out, ref, tol=1e-4)


@jax.jit
def _mc_grpo_cases():
  """Every mc_grpo_advantages call of test_mc_grpo_cases, as one program."""
  return (losses.mc_grpo_advantages(jnp.array([[1.0, 0.0, 0.0]])),
          losses.mc_grpo_advantages(jnp.array([[3.0, 1.0, 2.0]])),
          losses.mc_grpo_advantages(jnp.array([[3.0, 1.0, 2.0]]), scale="none"))


def test_mc_grpo_cases():
  tie, mad, none = _mc_grpo_cases()
  adv, rows = tie
  close(adv, [[1000.0, 0.0]], tol=1e-3)
  assert rows.tolist() == [[0, 1]]
  adv, rows = mad
  close(adv, [[1 / 1.001, -1 / 1.001]])
  assert rows.tolist() == [[0, 1]]
  adv, rows = none
  close(adv, [[1.0, -1.0]])


def _gae_loop(r, v, m, gamma, lam):
  adv = np.zeros_like(r)
  for b in range(r.shape[0]):
    nv, na = 0.0, 0.0
    for t in reversed(range(r.shape[1])):
      if not m[b, t]:
        continue
      delta = r[b, t] + gamma * nv - v[b, t]
      na = delta + gamma * lam * na
      nv = v[b, t]
      adv[b, t] = na
  return adv


@jax.jit
def _gae_cases(r, v, m):
  """Every gae_advantages call of test_gae_hand_and_loop, as one program."""
  hand = losses.gae_advantages(jnp.array([[0.0, 0.0, 1.0]]), jnp.array([[0.5, 0.6, 0.7]]),
                               jnp.ones((1, 3), bool), whiten=False)
  masked = losses.gae_advantages(jnp.array([[0.0, 9.0, 1.0]]), jnp.array([[0.5, 9.0, 0.7]]),
                                 jnp.array([[True, False, True]]), whiten=False)
  return (hand, masked, losses.gae_advantages(r, v, m, 0.9, 0.8, whiten=False),
          losses.gae_advantages(r, v, m, 0.9, 0.8))


def test_gae_hand_and_loop():
  rng = np.random.default_rng(1)
  r, v = rng.normal(size=(3, 6)), rng.normal(size=(3, 6))
  m = rng.random((3, 6)) > 0.3
  hand, masked, loop, (white, _) = _gae_cases(jnp.asarray(r, jnp.float32),
                                              jnp.asarray(v, jnp.float32), jnp.asarray(m))
  adv, ret = hand
  close(adv, [[0.5, 0.4, 0.3]])
  close(ret, [[1.0, 1.0, 1.0]])
  adv, _ = masked
  close(adv, [[0.5, 0.0, 0.3]])
  ref = _gae_loop(r, v, m, 0.9, 0.8)
  adv, ret = loop
  close(adv, ref, tol=1e-4)
  close(ret, np.where(m, ref + v, 0.0), tol=1e-4)
  vals = ref[m]
  close(np.asarray(white)[m], (vals - vals.mean()) / np.sqrt(vals.var(ddof=1) + 1e-8), tol=1e-4)


def test_gdpo_matches_numpy():
  rng = np.random.default_rng(2)
  r = rng.normal(size=(2, 3, 2)).astype(np.float32)
  w = np.array([1.0, 0.5], np.float32)
  per = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
  s = (per * w).sum(-1)
  ref = (s - s.mean()) / np.sqrt(s.var(ddof=1) + 1e-8)
  close(jax.jit(losses.gdpo_advantages)(jnp.asarray(r), jnp.asarray(w)), ref, tol=1e-4)


# ------------------------------------------------------------------------ KL, entropy
def test_kl_hand_cases():
  lp, ref = jnp.array([0.0]), jnp.array([math.log(0.5)])
  d = math.log(2.0)
  close(losses.kl_penalty(lp, ref, "k1"), [d])
  close(losses.kl_penalty(lp, ref, "abs"), [d])
  close(losses.kl_penalty(-lp - d, ref * 0, "abs"), [d])
  close(losses.kl_penalty(lp, ref, "k2"), [0.5 * d * d])
  close(losses.kl_penalty(lp, ref, "k3"), [0.5 + d - 1.0])
  # clamps: kl = clip(-d, -20, 20) = 20 -> exp(20) - 21 -> clipped to 10
  close(losses.kl_penalty(jnp.array([-100.0]), jnp.array([0.0]), "k3"), [10.0])
  assert np.isfinite(losses.kl_penalty(jnp.array([100.0]), jnp.array([0.0]), "k3")).all()


@jax.jit
def _kl_reward_and_entropy(z):
  """Both calls of test_kl_reward_and_entropy, as one program."""
  return (losses.kl_reward(jnp.array([[0.0, 1.0]]), jnp.array([[0.2, 0.1]]),
                           jnp.array([[0.0, 0.3]]), jnp.array([[True, True]]), beta=0.5,
                           kind="k1"),
          losses.entropy_from_logits(z, temperature=2.0))


def test_kl_reward_and_entropy():
  z = jnp.array([[1.0, 2.0, 0.5]])
  r, entropy = _kl_reward_and_entropy(z)
  close(r, [[-0.1, 1.1]])
  p = np.exp(np.asarray(z) / 2.0)
  p /= p.sum()
  close(entropy, [-(p * np.log(p)).sum()])


# ------------------------------------------------------------------------ aggregation
@jax.jit
def _aggregation_cases(x, m):
  """Every aggregate call of test_aggregation_hand_cases, as one program: the hand cases,
  then each mode on the all-masked batch."""
  hand = (losses.aggregate(x, m, "token-mean"), losses.aggregate(x, m, "seq-mean-token-mean"),
          losses.aggregate(x, m, "seq-mean-token-sum"),
          losses.aggregate(x, m, "seq-mean-token-sum-norm"),
          losses.aggregate(x, m, "seq-mean-token-sum-norm", norm=7.0))
  return hand, [losses.aggregate(x, jnp.zeros_like(m), mode) for mode in losses.AGG_MODES]


def test_aggregation_hand_cases():
  x = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [7.0, 7.0, 7.0]])
  m = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], bool)
  (token_mean, seq_mean, seq_sum, seq_sum_norm, normed), masked = _aggregation_cases(x, m)
  close(token_mean, 7.0 / 3.0)
  close(seq_mean, (1.5 + 4.0) / 2.0)
  close(seq_sum, 7.0 / 2.0)
  close(seq_sum_norm, 7.0 / 2.0 / 3.0)
  close(normed, 0.5)
  for loss in masked:  # all-masked: defined result 0, never NaN
    assert float(loss) == 0.0


# ---------------------------------------------------------------------- policy losses
@jax.jit
def _ppo_clip_cases(lr, adv):
  """Every ppo_clip_per_token call of test_ppo_clip_hand_cases, as one program."""
  return (losses.ppo_clip_per_token(lr, adv, 0.2, 0.2),
          losses.ppo_clip_per_token(lr, adv, 0.2, 0.2, dual_clip=3.0),
          losses.ppo_clip_per_token(lr, adv, 0.2, 0.28),  # clip-higher
          losses.ppo_clip_per_token(jnp.array([[50.0]]), jnp.array([[-1.0]]), 0.2, 0.2))


def test_ppo_clip_hand_cases():
  lr = jnp.log(jnp.array([[1.5, 0.5, 5.0, 1.1]]))
  adv = jnp.array([[1.0, -1.0, -1.0, 1.0]])
  plain, dual, higher, clamp = _ppo_clip_cases(lr, adv)
  loss, clipped = plain
  close(loss, [[-1.2, 0.8, 5.0, -1.1]])
  assert clipped.tolist() == [[True, True, False, False]]
  loss, _ = dual
  close(loss, [[-1.2, 0.8, 3.0, -1.1]])
  loss, _ = higher
  close(loss, [[-1.28, 0.8, 5.0, -1.1]])
  # log-ratio clamp at 20
  loss, _ = clamp
  close(loss, [[math.exp(20.0)]], tol=1e-4)


def test_policy_loss_gspo_hand_case():
  logp = jnp.log(jnp.array([[0.5, 0.5, 0.9]]))
  old = jnp.log(jnp.array([[0.25, 0.5, 0.1]]))
  m = jnp.array([[True, True, False]])
  loss, metrics = jax.jit(  # one program, not op by op
      lambda logp, old, m: losses.policy_loss(logp, old, jnp.array([1.0]), m, 0.2, 0.2,
                                              ratio_level="sequence"))(logp, old, m)
  s = math.exp(math.log(2.0) / 2.0)  # geometric mean ratio over the 2 valid tokens = 1.414
  close(loss, -min(s, 1.2))
  close(metrics["clip_frac"], 1.0)


@SETTINGS
@given(hnp.arrays(np.float32, (2, 3), elements=FLOATS),
       hnp.arrays(np.float32, (2, 3), elements=st.floats(-3.0, -0.5, width=32)),
       st.sampled_from(list(losses.AGG_MODES)))
def test_clip_equals_unclipped_when_old_is_current(adv, logp, agg):
  m = jnp.array([[1, 1, 0], [1, 1, 1]], bool)
  value, g, value_ref, g_ref = _clip_at_current(jnp.asarray(logp), jnp.asarray(adv), m, agg)
  close(value, value_ref, tol=1e-5)
  close(g, g_ref, tol=1e-5)


@functools.partial(jax.jit, static_argnames="agg")
def _clip_at_current(lp, a, m, agg):
  """The clipped loss at old = logp and its gradient in logp; the unclipped -A·logp's (one
  program per aggregation mode for every example)."""
  f = lambda lp, old: losses.policy_loss(lp, old, a, m, 0.2, 0.28, dual_clip=3.0, agg=agg)[0]
  unclipped = lambda lp: losses.aggregate(-a * lp, m, agg)
  return f(lp, lp), jax.grad(f)(lp, lp), losses.aggregate(-a, m, agg), jax.grad(unclipped)(lp)


def test_truncated_is_and_decoupled_weights():
  old = jnp.log(jnp.array([[0.5, 0.5, 0.9]]))
  mu = jnp.log(jnp.array([[0.1, 0.4, 0.9]]))
  m = jnp.array([[True, True, False]])
  close(losses.truncated_is_weights(old, mu, m, 2.0, "token"), [[2.0, 1.25, 0.0]])
  close(losses.truncated_is_weights(old, mu, m, 8.0, "sequence"), [[6.25, 6.25, 0.0]])
  close(losses.truncated_is_weights(old, mu, m, None, "sequence"), [[6.25, 6.25, 0.0]])
  w, keep = losses.decoupled_weights(old, mu, m, 4.0, "mask")
  close(w, [[5.0, 1.25, 0.0]])
  assert keep.tolist() == [[False, True, False]]
  w, keep = losses.decoupled_weights(old, mu, m, 4.0, "clamp")
  close(w, [[4.0, 1.25, 0.0]])
  assert keep.tolist() == [[True, True, False]]


@jax.jit
def _value_and_ace_cases():
  """Every call of test_value_loss_and_ace_hand_cases, as one program."""
  return (losses.value_loss_per_token(jnp.array([1.0, 0.0]), jnp.array([0.0, 0.0]),
                                      jnp.array([0.0, 1.0]), clip=0.2),
          losses.value_loss_per_token(jnp.array([1.0]), jnp.array([0.0]),
                                      jnp.array([2.0]), clip=0.2),
          losses.ace_scale(jnp.array([0.0, 2.0]), jnp.array([[-1.0], [1.0]]), alpha=0.5))


def test_value_loss_and_ace_hand_cases():
  first, second, s = _value_and_ace_cases()
  loss, clipped = first
  # row 0: (1-0)^2 vs (0.2-0)^2 -> 0.5; row 1: (0-1)^2 = 1 vs same -> 0.5
  close(loss, [0.5, 0.5])
  assert clipped.tolist() == [False, False]
  loss, clipped = second
  close(loss, [0.5 * 1.8 ** 2])
  assert clipped.tolist() == [True]
  close(s, [[1.0 + 0.5 * math.log(2.0)], [1.0]])


# ----------------------------------------------------------------------------- M2PO
def _kept_mean(d2, keep):
  return d2[keep].mean() if keep.any() else 0.0


@SETTINGS
@given(hnp.arrays(np.float32, (3, 5), elements=st.floats(-1.0, 1.0, width=32)),
       hnp.arrays(bool, (3, 5)), st.sampled_from([0.01, 0.04, 0.2]))
def test_m2po_mask_is_minimal(delta, mask, tau):
  keep = np.asarray(jax.jit(losses.m2po_mask, static_argnums=2)(delta, mask, tau))
  assert not (keep & ~mask).any()
  d2 = delta.astype(np.float64) ** 2
  assert _kept_mean(d2, keep) < tau + 1e-7
  dropped = mask & ~keep
  if dropped.any():
    # dropped tokens are the largest ones, and keeping one more breaks the bound
    assert d2[dropped].min() >= d2[keep].max() - 1e-7 if keep.any() else True
    j = np.argwhere(dropped)[np.argmin(d2[dropped])]
    plus = keep.copy()
    plus[tuple(j)] = True
    assert _kept_mean(d2, plus) >= tau - 1e-6


def test_m2po_mask_hand_case():
  delta = jnp.array([[0.5, 0.1, 0.1, 0.3]])  # d2 = .25 .01 .01 .09
  keep = jax.jit(losses.m2po_mask, static_argnums=2)(delta, jnp.ones((1, 4), bool), 0.04)
  # drop .25 -> mean(.01,.01,.09) = .0367 < .04
  assert keep.tolist() == [[False, True, True, True]]


@SETTINGS
@given(hnp.arrays(np.float32, (2, 4), elements=st.floats(-1.0, 1.0, width=32)),
       st.sampled_from([0.01, 0.04]))
def test_m2po_clip_bound_solves_budget(delta, tau):
  mask = np.ones((2, 4), bool)
  b = float(jax.jit(losses.m2po_clip_bound, static_argnums=2)(delta, mask, tau))
  d2 = delta.astype(np.float64).ravel() ** 2
  if math.isinf(b):
    assert d2.sum() <= tau * d2.size + 1e-6
  else:
    np.testing.assert_allclose(np.minimum(d2, b * b).sum(), tau * d2.size, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------ bad inputs
def test_bad_inputs_raise_clear_errors():
  m = jnp.ones((2, 3), bool)
  with pytest.raises(ValueError, match="old_logp has shape"):
    losses.policy_loss(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.zeros(2), m)
  with pytest.raises(ValueError, match="advantages must have shape"):
    losses.policy_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros(3), m)
  with pytest.raises(ValueError, match="dual_clip must be > 1"):
    losses.policy_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros(2), m, dual_clip=0.5)
  with pytest.raises(ValueError, match="aggregation mode"):
    losses.aggregate(jnp.zeros((2, 3)), m, "mean")
  with pytest.raises(ValueError, match="KL kind"):
    losses.kl_penalty(jnp.zeros(3), jnp.zeros(3), "k4")
  with pytest.raises(ValueError, match="rank 2"):
    losses.grpo_advantages(jnp.zeros(4))
  with pytest.raises(ValueError, match="dual_clip is not defined"):
    losses.policy_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros(2), m, dual_clip=3.0,
                       ratio_level="sequence")
  loss, _ = jax.jit(losses.policy_loss)(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros(2),
                                        jnp.zeros((2, 3), bool))  # one program, not op by op
  assert float(loss) == 0.0
