"""Stochastic rounding of bfloat16 master weights (``optim.stochastic_rounding``): unbiased,
only ever one of the two neighbouring bfloat16 values, deterministic given the key, and the
key a function of the run's stream and the checkpointed update count."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rl_jax import config_utils, optim, train
from rl_jax.errors import ConfigError
from rl_jax.train import steps
from tests.tiny import QUICKSTART, TINY_MODEL


def _neighbours(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The bfloat16 values either side of float32 ``x`` (toward zero: the top 16 bits; away
  from zero: the next bfloat16), computed on the bit patterns with numpy."""
  bits = x.astype(np.float32).view(np.uint32)
  down = (bits & np.uint32(0xFFFF0000)).view(np.float32)
  up = ((bits & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32)
  return down, up


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
  rng = np.random.default_rng(0)
  x = (rng.normal(size=64) * 10.0 ** rng.integers(-6, 4, size=64)).astype(np.float32)
  n = 4096
  keys = jax.random.split(jax.random.key(1), n)
  draws = np.asarray(jax.vmap(lambda k: optim.stochastic_round(jnp.asarray(x), jnp.bfloat16, k))(
      keys).astype(jnp.float32))  # [n, 64]
  down, up = _neighbours(x)
  assert np.all((draws == down) | (draws == up))
  p_up = (x.astype(np.float64) - down) / (up.astype(np.float64) - down)  # |x| - |down| > 0
  expect = down + p_up * (up.astype(np.float64) - down)
  np.testing.assert_allclose(expect, x, rtol=1e-7)
  sd = np.sqrt(p_up * (1 - p_up)) * np.abs(up.astype(np.float64) - down)
  err = np.abs(draws.astype(np.float64).mean(0) - x)
  assert np.all(err <= 5 * sd / np.sqrt(n) + 1e-30), (err / (sd / np.sqrt(n))).max()
  # round-to-nearest is biased by up to half a step; stochastic rounding's mean is not
  nearest = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
  assert np.mean(np.abs(nearest - x)) > 10 * np.mean(err)


def test_stochastic_rounding_is_deterministic_given_the_key():
  x = jnp.asarray(np.random.default_rng(2).normal(size=(256,)), jnp.float32)
  a = optim.stochastic_round(x, jnp.bfloat16, jax.random.key(3))
  b = optim.stochastic_round(x, jnp.bfloat16, jax.random.key(3))
  c = optim.stochastic_round(x, jnp.bfloat16, jax.random.key(4))
  np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert np.any(np.asarray(a, np.float32) != np.asarray(c, np.float32))
  exact = x.astype(jnp.bfloat16).astype(jnp.float32)  # already bfloat16: unchanged
  np.testing.assert_array_equal(
      np.asarray(optim.stochastic_round(exact, jnp.bfloat16, jax.random.key(5)), np.float32),
      np.asarray(exact))


def test_small_updates_move_bfloat16_weights_in_expectation():
  """An update far below half a bfloat16 step: round-to-nearest drops it, stochastic
  rounding applies it on average (and float32 leaves are updated as optax does)."""
  p = {"w": jnp.full((4096,), 1.0, jnp.bfloat16), "b": jnp.ones((3,), jnp.float32)}
  u = {"w": jnp.full((4096,), 1e-3, jnp.bfloat16), "b": jnp.full((3,), 1e-3, jnp.float32)}
  nearest = optax.apply_updates(p, u)
  assert np.all(np.asarray(nearest["w"], np.float32) == 1.0)  # 1e-3 < 2^-8 / 2: lost
  sr = optim.apply_updates(p, u, jax.random.key(0))
  assert sr["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(sr["b"]), np.asarray(nearest["b"]))
  mean = np.asarray(sr["w"], np.float64).mean()
  step = 2.0 ** -7  # bfloat16 spacing above 1.0
  sd = np.sqrt(1e-3 / step * (1 - 1e-3 / step)) * step / np.sqrt(4096)
  assert abs(mean - (1.0 + float(jnp.bfloat16(1e-3)))) < 5 * sd


def test_rounding_key_follows_the_update_count_and_the_config():
  cfg = lambda extra: config_utils.load_config(
      QUICKSTART, TINY_MODEL + ["model.param_dtype=bfloat16"] + extra)
  s = train.build_setup(cfg(["optim.stochastic_rounding=True"]))
  params = {"w": jnp.ones((3,), jnp.bfloat16)}
  state = s.optimizers.rl.init(params)
  _, later = s.optimizers.rl.update(params, state, params)
  data = lambda k: np.asarray(jax.random.key_data(k))
  assert np.array_equal(data(steps.rounding_key(s, state, 1)),
                        data(steps.rounding_key(s, s.optimizers.rl.init(params), 1)))
  assert not np.array_equal(data(steps.rounding_key(s, state, 1)),
                            data(steps.rounding_key(s, later, 1)))  # next update, next key
  assert not np.array_equal(data(steps.rounding_key(s, state, 1)),
                            data(steps.rounding_key(s, state, 0)))  # another optimizer
  assert steps.rounding_key(train.build_setup(cfg([])), state, 1) is None
  with pytest.raises(ConfigError) as e:  # float32 master weights: nothing to round
    train.build_setup(config_utils.load_config(QUICKSTART, ["optim.stochastic_rounding=True"]))
  assert "\n" not in str(e.value) and "model.param_dtype=bfloat16" in str(e.value)
