"""Multi-turn (agentic) trajectories: the turn fields of ObjectiveInputs and GiGPO, checked
against a plain-python loop written from the paper's definitions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import losses


def close(a, b, tol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


# --------------------------------------------------------------------- reference loop
def _mean_std(xs):
  """Mean and unbiased std of a list (std None for fewer than two values)."""
  mean = sum(xs) / len(xs)
  if len(xs) < 2:
    return mean, None
  return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def reference_gigpo(rewards, turn_rewards, turn_states, turn_ids, mask, omega, gamma, std,
                    eps=1e-6):
  """GiGPO token advantages by explicit loops (float64)."""
  g_n, m_n, u_n = turn_rewards.shape
  r_n = mask.shape[-1]
  ok = lambda v: math.isfinite(float(v))
  episode = np.zeros((g_n, m_n))
  for g in range(g_n):
    vals = [float(rewards[g, m]) for m in range(m_n) if ok(rewards[g, m])]
    mean, sd = _mean_std(vals) if len(vals) > 1 else (0.0, 1.0)
    for m in range(m_n):
      if ok(rewards[g, m]):
        c = float(rewards[g, m]) - mean
        episode[g, m] = c / (sd + eps) if std else c
  ret = np.zeros((g_n, m_n, u_n))
  for g in range(g_n):
    for m in range(m_n):
      for u in range(u_n):
        ret[g, m, u] = sum(gamma ** (k - u) * float(turn_rewards[g, m, k])
                           for k in range(u, u_n) if ok(turn_rewards[g, m, k]))
  step = np.zeros((g_n, m_n, u_n))
  for g in range(g_n):
    groups = {}
    for m in range(m_n):
      for u in range(u_n):
        if ok(turn_rewards[g, m, u]) and turn_states[g, m, u] >= 0 and ok(rewards[g, m]):
          groups.setdefault(int(turn_states[g, m, u]), []).append((m, u))
    for members in groups.values():
      if len(members) < 2:
        continue
      mean, sd = _mean_std([ret[g, m, u] for m, u in members])
      for m, u in members:
        c = ret[g, m, u] - mean
        step[g, m, u] = c / (sd + eps) if std else c
  out = np.zeros((g_n, m_n, r_n))
  for g in range(g_n):
    for m in range(m_n):
      for t in range(r_n):
        if mask[g, m, t]:
          u = int(turn_ids[g, m, t])
          out[g, m, t] = episode[g, m] + omega * (step[g, m, u] if 0 <= u < u_n else 0.0)
  return out


# ------------------------------------------------------------------------ random cases
def make_agentic(seed, g=3, m=4, u=5, r=28, n_states=3, nan_rows=True):
  """Random interleaved trajectories: observation tokens (turn id -1) then model tokens of
  each turn, a random number of turns per row (absent turns: NaN reward, state -1), some
  NaN turn rewards among present turns, state ids from a small range (so step groups of
  one, several, and repeats within a row all occur) and optionally a NaN return."""
  rng = np.random.default_rng(seed)
  turn_rewards = rng.normal(size=(g, m, u)).astype(np.float32)
  turn_states = rng.integers(0, n_states, size=(g, m, u)).astype(np.int32)
  turn_ids = np.full((g, m, r), -1, np.int32)
  mask = np.zeros((g, m, r), bool)
  for gi in range(g):
    for mi in range(m):
      n_turns = int(rng.integers(1, u + 1))
      turn_rewards[gi, mi, n_turns:] = np.nan
      turn_states[gi, mi, n_turns:] = -1
      t = 0
      for ui in range(n_turns):
        t += int(rng.integers(0, 3))  # observation tokens
        n_tok = int(rng.integers(1, 4))
        turn_ids[gi, mi, t:t + n_tok] = ui
        mask[gi, mi, t:t + n_tok] = rng.random(min(n_tok, max(r - t, 0))) < 0.9
        t += n_tok
  turn_rewards[rng.random((g, m, u)) < 0.1] = np.nan
  turn_states[rng.random((g, m, u)) < 0.05] = -1
  rewards = np.nansum(turn_rewards, axis=-1)
  if nan_rows:
    rewards[0, 1] = np.nan
  return losses.ObjectiveInputs(
      rewards=jnp.asarray(rewards), mask=jnp.asarray(mask),
      turn_rewards=jnp.asarray(turn_rewards), turn_ids=jnp.asarray(turn_ids),
      turn_states=jnp.asarray(turn_states))


def ref_of(x, omega, gamma, std):
  return reference_gigpo(*(np.asarray(a) for a in (x.rewards, x.turn_rewards, x.turn_states,
                                                    x.turn_ids, x.mask)), omega, gamma, std)


@pytest.mark.parametrize("seed,omega,gamma,std", [
    (0, 1.0, 0.95, True), (1, 1.0, 0.95, False), (2, 0.5, 1.0, True), (3, 2.0, 0.0, True),
    (4, 1.0, 0.8, False), (5, 1.0, 0.95, True)])
def test_gigpo_matches_loop_reference(seed, omega, gamma, std):
  x = make_agentic(seed, n_states=2 + seed % 3)
  est = losses.gigpo(omega, gamma, "std" if std else "none")
  got = est.compute(x).advantages
  assert got.shape == x.mask.shape
  close(got, ref_of(x, omega, gamma, std), tol=1e-4)


def test_hand_case():
  # one prompt, two trajectories of two turns; both start from state 5, then differ
  x = losses.ObjectiveInputs(
      rewards=jnp.array([[1.0, 0.0]]), mask=jnp.array([[[True, False, True],
                                                        [True, False, True]]]),
      turn_rewards=jnp.array([[[0.0, 1.0], [0.0, 0.0]]]),
      turn_ids=jnp.array([[[0, -1, 1], [0, -1, 1]]]),
      turn_states=jnp.array([[[5, 7], [5, 9]]], jnp.int32))
  # returns with gamma 0.5: [[0.5, 1], [0, 0]]; state 5 groups {0.5, 0}: centred +-0.25;
  # states 7 and 9 are singletons: 0. Episode: rewards [1, 0] centred +-0.5.
  got = losses.gigpo(1.0, 0.5, "none").compute(x).advantages
  close(got, [[[0.75, 0.0, 0.5], [-0.75, 0.0, -0.5]]])
  s = math.sqrt(0.125)  # unbiased std of {0.5, 0}; episode std sqrt(0.5)
  e = 0.5 / (math.sqrt(0.5) + 1e-6)
  got = losses.gigpo(2.0, 0.5, "std").compute(x).advantages
  close(got, [[[e + 2 * 0.25 / (s + 1e-6), 0.0, e], [-e - 2 * 0.25 / (s + 1e-6), 0.0, -e]]])


def test_turn_returns_hand_case():
  close(losses.turn_returns(jnp.array([1.0, jnp.nan, 2.0]), 0.5), [1.5, 1.0, 2.0])
  close(losses.turn_returns(jnp.array([[1.0, 2.0, 3.0]]), 1.0), [[6.0, 5.0, 3.0]])
  close(losses.turn_returns(jnp.array([1.0, 2.0]), 0.0), [1.0, 2.0])


# ----------------------------------------------------------------------- degenerate
def test_all_states_distinct_gives_grpo_per_token():
  x = make_agentic(6)
  g, m, u = x.turn_rewards.shape
  x = x._replace(turn_states=jnp.arange(g * m * u, dtype=jnp.int32).reshape(g, m, u))
  ret = losses.turn_returns(x.turn_rewards, 0.95)
  step = losses.step_group_advantages(ret, x.turn_states, jnp.ones((g, m, u), bool))
  assert np.all(np.asarray(step) == 0.0)
  want = jnp.where(x.mask, losses.grpo_advantages(x.rewards)[..., None], 0.0)
  close(losses.gigpo(1.0).compute(x).advantages, want)


def test_omega_zero_is_grpo_per_token():
  x = make_agentic(7)
  want = jnp.where(x.mask, losses.grpo_advantages(x.rewards, "none")[..., None], 0.0)
  close(losses.gigpo(0.0, scale="none").compute(x).advantages, want)


def test_equal_returns_in_a_step_group_give_zero_not_inf():
  # every turn from state 0 with the same return: std 0, guarded by eps; nothing blows up
  tr = jnp.ones((1, 3, 2))
  step = losses.step_group_advantages(losses.turn_returns(tr, 1.0),
                                      jnp.array([[[0, 1], [0, 1], [0, 1]]], jnp.int32),
                                      jnp.ones((1, 3, 2), bool))
  assert np.all(np.asarray(step) == 0.0)


def test_nan_return_row_is_zero_and_leaves_step_groups():
  x = make_agentic(8, nan_rows=True)
  adv = np.asarray(losses.gigpo().compute(x).advantages)
  assert np.all(np.isfinite(adv))
  assert np.all(adv[0, 1] == 0.0)
  assert np.all(adv[~np.asarray(x.mask)] == 0.0)


def test_summed_turn_rewards_with_grpo_equal_gigpo_without_step_term():
  """Trajectory-level GRPO (the default) on the summed per-turn rewards."""
  x = make_agentic(9, nan_rows=False)
  total = jnp.nansum(x.turn_rewards, axis=-1)
  close(losses.turn_returns(x.turn_rewards, 1.0)[..., 0], total)
  grpo = losses.get_objective("dapo").advantages(total)
  close(grpo, losses.grpo_advantages(total))
  per_token = losses.gigpo(0.0).compute(x._replace(rewards=total)).advantages
  close(per_token, jnp.where(x.mask, grpo[..., None], 0.0))


# ------------------------------------------------------------------- jit and registry
def test_jittable():
  x = make_agentic(10)
  est = losses.gigpo(1.0, 0.9)
  close(jax.jit(est.compute)(x).advantages, est.compute(x).advantages)


def test_registered_and_reads_the_turn_fields():
  assert "gigpo" in losses.ADVANTAGES
  assert set(losses.TURN_FIELDS) <= set(losses.INPUT_FIELDS)
  assert losses.ObjectiveInputs(jnp.zeros((1, 1)), jnp.ones((1, 1, 1), bool)).turn_ids is None
  assert losses.PRESET_KNOB_DEFAULTS["gigpo_omega"] == 1.0
  assert losses.PRESET_KNOB_DEFAULTS["gigpo_gamma"] == 0.95
  assert losses.PRESET_KNOB_DEFAULTS["gigpo_std"] is True
  obj = losses.get_objective("dapo", advantage="gigpo")
  assert obj.estimator == "gigpo"
  assert obj.estimator_needs == frozenset(losses.TURN_FIELDS)
  assert obj.needs == frozenset({"old_logp", *losses.TURN_FIELDS})
  assert losses.gigpo().needs == ("turn_rewards", "turn_ids", "turn_states")


def test_knobs_reach_the_estimator_and_the_loss_runs():
  x = make_agentic(11)
  x = x._replace(old_logp=jnp.full(x.mask.shape, -1.0))
  for knobs, std in [(dict(gigpo_omega=0.5, gigpo_gamma=0.7, gigpo_std=False), False),
                     (dict(gigpo_omega=1.5, gigpo_gamma=1.0), True)]:
    obj = losses.get_objective("grpo", advantage="gigpo", kl_beta=0.0, **knobs)
    adv = obj.advantages_from(x)
    close(adv.advantages, ref_of(x, knobs["gigpo_omega"], knobs["gigpo_gamma"], std), 1e-4)
    batch = obj.prepare(losses.loss_batch(x, adv))
    logp = jnp.where(batch.mask, batch.old_logp, 0.0) + 0.05
    assert np.isfinite(float(losses.finalize(*obj.loss(logp, batch)[:2])))
  for f in losses.TURN_FIELDS:
    with pytest.raises(ValueError, match=f):
      obj.advantages_from(x._replace(**{f: None}))
  with pytest.raises(ValueError, match="gamma"):
    losses.get_objective("dapo", advantage="gigpo", gigpo_gamma=1.5)


def test_jitted_gigpo_equals_eager_bit_for_bit():
  """GiGPO as the trainer runs it (one jitted program) gives the eager values exactly."""
  x = make_agentic(5)
  obj = losses.get_objective("dapo", advantage="gigpo")
  eager, jitted = obj.advantages_from(x), jax.jit(obj.advantages_from)(x)
  np.testing.assert_array_equal(np.asarray(eager.advantages), np.asarray(jitted.advantages))


def test_check_inputs_rejects_bad_turn_fields():
  x = make_agentic(12)
  bad = [
      (x._replace(turn_states=x.turn_states[..., :-1]), "turn_states"),
      (x._replace(turn_rewards=x.turn_rewards[0]), "turn_rewards"),
      (x._replace(turn_ids=x.turn_ids[..., :-1]), "turn_ids"),
      (x._replace(turn_ids=x.turn_ids.astype(jnp.float32)), "turn_ids"),
      (x._replace(turn_states=x.turn_states.astype(jnp.float32)), "turn_states"),
  ]
  for inputs, name in bad:
    with pytest.raises(ValueError, match=name):
      losses.check_inputs(inputs)
  losses.check_inputs(x, losses.TURN_FIELDS)
