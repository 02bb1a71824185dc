"""Prompt selection (rl_jax.data.selection): uniform sampler, GRESO, Beta posterior, DAPO."""

import chex
import numpy as np
import pytest

from rl_jax.data import selection as sel


# ------------------------------------------------------------------ uniform sampler
def test_sampler_epochs_and_exact_resume():
  state = sel.sampler_init(seed=7)
  first, state = sel.sampler_next(state, 10, 4)
  second, state = sel.sampler_next(state, 10, 4)
  third, state = sel.sampler_next(state, 10, 4)  # crosses into epoch 1
  epoch0 = np.concatenate([first, second, third[:2]])
  assert sorted(epoch0.tolist()) == list(range(10))
  assert state == sel.SamplerState(7, 1, 2)
  # Resume from a serialised state gives the same continuation.
  saved = state._asdict()
  a, _ = sel.sampler_next(state, 10, 5)
  b, _ = sel.sampler_next(sel.SamplerState(**saved), 10, 5)
  np.testing.assert_array_equal(a, b)
  # Another seed gives another order.
  other, _ = sel.sampler_next(sel.sampler_init(8), 10, 10)
  assert other.tolist() != sel.sampler_next(sel.sampler_init(7), 10, 10)[0].tolist()
  with pytest.raises(ValueError, match="dataset is empty"):
    sel.sampler_next(state, 0, 1)


def test_sampler_batch_larger_than_dataset():
  idx, state = sel.sampler_next(sel.sampler_init(0), 3, 7)
  chex.assert_shape(idx, (7,))
  chex.assert_type(idx, np.int64)
  assert sorted(idx[:3].tolist()) == [0, 1, 2]
  assert sorted(idx[3:6].tolist()) == [0, 1, 2] and state.epoch == 2 and state.position == 1


# ------------------------------------------------------------------ DAPO
def test_dynamic_sampling_mask():
  r = np.array([[1, 1, 1], [0, 1, 0], [0, 0, 0], [0.1, 0.1, 0.1], [0.5, -0.5, 0.5]])
  assert sel.dynamic_sampling_mask(r).tolist() == [False, True, False, False, True]
  assert sel.zero_variance_kind(r).tolist() == [1, 0, -1, -1, 0]
  chex.assert_shape([sel.dynamic_sampling_mask(r), sel.zero_variance_kind(r)], (5,))  # [G]
  with pytest.raises(ValueError, match=r"\[G, M\]"):
    sel.dynamic_sampling_mask(np.zeros(3))


# ------------------------------------------------------------------ GRESO
def test_greso_skip_probability_formula():
  state = sel.greso_init(5)._replace(
      streak=np.array([0, 1, 2, 10, 3], np.int32), kind=np.array([0, 1, 1, 1, -1], np.int8),
      p_easy=0.5, p_hard=0.8)
  got = sel.greso_skip_prob(state, np.arange(5))
  # c=0 never skipped; 1−0.5; 1−0.25; 1−max(0.5^10, 0.01) = 0.99; hard uses p_hard: 1−0.8^3.
  np.testing.assert_allclose(got, [0.0, 0.5, 0.75, 0.99, 1 - 0.8**3])


def test_greso_unseen_prompts_never_skipped():
  state = sel.greso_init(50, seed=3)
  for step in range(20):
    assert sel.greso_keep(state, np.arange(50), step).all()


def test_greso_keep_rate_matches_probability():
  state = sel.greso_init(4000)._replace(streak=np.ones(4000, np.int32),
                                        kind=np.ones(4000, np.int8))
  keep = sel.greso_keep(state, np.arange(4000), step=0)
  assert abs(keep.mean() - 0.5) < 0.04
  np.testing.assert_array_equal(keep, sel.greso_keep(state, np.arange(4000), step=0))


def test_greso_update_streaks_and_p_adaptation():
  state = sel.greso_init(4)._replace(streak=np.array([2, 1, 3, 0], np.int32),
                                     kind=np.array([1, -1, 1, 0], np.int8))
  rewards = np.array([[1, 1], [1, 1], [0, 1], [0, 0]], np.float32)
  new = sel.greso_update(state, np.arange(4), rewards)
  # easy again -> 3; hard then easy -> restart at 1; mixed -> 0; unseen then hard -> 1.
  assert new.streak.tolist() == [3, 1, 0, 1] and new.kind.tolist() == [1, 1, 0, -1]
  # easy ratio 2/4 > 0.083 -> p_easy down; hard ratio 1/4 > 0.167 -> p_hard down.
  assert new.p_easy == pytest.approx(0.49) and new.p_hard == pytest.approx(0.49)
  assert state.streak.tolist() == [2, 1, 3, 0]  # input untouched
  mixed = sel.greso_update(state, np.arange(4), np.tile([[0.0, 1.0]], (4, 1)))
  assert mixed.p_easy == pytest.approx(0.51) and mixed.p_hard == pytest.approx(0.51)


def test_greso_p_stays_in_bounds():
  low = sel.greso_init(2)._replace(p_easy=0.05, p_hard=0.05)
  low = sel.greso_update(low, np.arange(2), np.array([[1, 1], [0, 0]]))
  assert (low.p_easy, low.p_hard) == (0.05, 0.05)
  high = sel.greso_init(2)._replace(p_easy=0.95, p_hard=0.95)
  high = sel.greso_update(high, np.arange(2), np.array([[1, 0], [0, 1]]))
  assert (high.p_easy, high.p_hard) == (0.95, 0.95)


def test_greso_select_fills_batch_and_is_deterministic():
  state = sel.greso_init(20)._replace(streak=np.full(20, 50, np.int32),
                                      kind=np.ones(20, np.int8))
  state.streak[:3] = 0  # three unseen prompts, always kept
  idx, sampler, skipped = sel.greso_select(sel.sampler_init(1), state, 6, step=4)
  chex.assert_shape(idx, (6,))
  assert {0, 1, 2} <= set(idx.tolist()) and skipped > 0
  again = sel.greso_select(sel.sampler_init(1), state, 6, step=4)
  chex.assert_trees_all_equal((idx, sampler), again[:2])


# ------------------------------------------------------------------ Beta posterior
def test_beta_update_formula():
  state = sel.beta_init(3, alpha0=1.0, beta0=1.0, decay=0.5)._replace(
      alpha=np.array([3.0, 1.0, 5.0]), beta=np.array([1.0, 1.0, 1.0]))
  new = sel.beta_update(state, np.array([0, 2, 2]), np.array([2.0, 1.0, 0.0]),
                        np.array([4.0, 2.0, 2.0]))
  # α0: 0.5·3 + 0.5·1 + 2 = 4; β0: 0.5·1 + 0.5·1 + 2 = 3.
  # prompt 1 only decays: (1, 1). prompt 2 twice: α 0.5·5+0.5+1 = 4, β 1 + (1 + 2) = 4.
  np.testing.assert_allclose(new.alpha, [4.0, 1.0, 4.0])
  np.testing.assert_allclose(new.beta, [3.0, 1.0, 4.0])
  with pytest.raises(ValueError, match="successes"):
    sel.beta_update(state, np.array([0]), np.array([3.0]), np.array([2.0]))
  with pytest.raises(ValueError, match="decay"):
    sel.beta_init(3, decay=2.0)


def test_beta_decay_returns_to_prior():
  state = sel.beta_init(1, alpha0=2.0, beta0=3.0, decay=0.5)._replace(
      alpha=np.array([10.0]), beta=np.array([1.0]))
  for _ in range(40):
    state = sel.beta_update(state, np.array([], np.int64), np.array([]), np.array([]))
  np.testing.assert_allclose([state.alpha[0], state.beta[0]], [2.0, 3.0])


@pytest.mark.parametrize("mode", ["thompson", "variance"])
def test_beta_select_prefers_uncertain_prompts(mode):
  state = sel.beta_init(4)._replace(alpha=np.array([1000.0, 1.0, 500.0, 300.0]),
                                    beta=np.array([1.0, 1000.0, 500.0, 700.0]))
  picked = sel.beta_select(state, 2, step=0, mode=mode)
  assert picked.tolist() == [2, 3]
  np.testing.assert_array_equal(picked, sel.beta_select(state, 2, step=0, mode=mode))
  assert sel.beta_select(state, 1, step=0, candidates=np.array([0, 1, 3]),
                         mode=mode).tolist() == [3]
  with pytest.raises(ValueError, match="batch_size"):
    sel.beta_select(state, 5, step=0, mode=mode)
  with pytest.raises(ValueError, match="unknown Beta selection mode"):
    sel.beta_select(state, 1, step=0, mode="ucb")


def test_selector_states_roundtrip_as_trees():
  """A checkpointed state (``_asdict``) restores to an equal tree of [dataset_size] arrays."""
  rewards = np.array([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])  # [G, M]
  greso = sel.greso_update(sel.greso_init(10, seed=2), np.array([1, 4, 7]), rewards)
  beta = sel.beta_update(sel.beta_init(10), np.array([1, 4, 7]), rewards.sum(1),
                         np.full(3, 2.0))
  chex.assert_shape([greso.streak, greso.kind, beta.alpha, beta.beta], (10,))
  chex.assert_trees_all_equal(sel.GresoState(**greso._asdict()), greso)
  chex.assert_trees_all_equal(sel.BetaState(**beta._asdict()), beta)
