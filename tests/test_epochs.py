"""``train.epochs`` = μ passes over each step's batch: the learner equals a plain loop over the
same per-pass permutations with the proximal log-probs of the first pass; objectives that
cannot take several passes are refused in one line."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import config as config_lib
from rl_jax import config_utils, settings, train
from rl_jax.errors import ConfigError
from rl_jax.train import context, learner, on_policy
from tests.tiny import QUICKSTART, TINY_MODEL, ParityTask

G, M = 4, 2
TINY = TINY_MODEL + [
    "sft.steps=0", "train.steps=2", f"train.batch_groups={G}", f"rollout.n={M}",
    "rollout.temperature=1.0", "train.eval_every=0", "log.tensorboard=False",
    "train.old_logp_pass=auto", "optim.lr=1e-2",
]


def _config(overrides):
  return config_utils.load_config(QUICKSTART, TINY + list(overrides))


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def test_pass_orders():
  assert learner.pass_orders(0, 5, G, 1) == [None]  # one pass: the collected order
  orders = learner.pass_orders(3, 5, 8, 3)
  assert len(orders) == 3
  for o in orders:
    assert sorted(o.tolist()) == list(range(8))
  again = learner.pass_orders(3, 5, 8, 3)
  assert all(np.array_equal(a, b) for a, b in zip(orders, again))  # seeded
  other_step = learner.pass_orders(3, 6, 8, 3)
  assert not all(np.array_equal(a, b) for a, b in zip(orders, other_step))


def test_two_epochs_equal_a_hand_written_loop():
  """μ = 2, two minibatches: ``apply_update`` equals four ``rl_update`` calls on the groups
  taken in each pass's permutation, every call reading the same proximal log-probs."""
  s = train.build_setup(_config(["loss.preset=dapo", "train.epochs=2", "train.minibatches=2"]))
  s = dataclasses.replace(s, task=ParityTask(s.task))
  t = train.make_trainer(s)
  assert not t.steps.old_logp_in_update  # several passes: old_logp from a separate pass
  state = train.begin_rl(s, train.init_state(s))
  batch, _, _ = train.collect(t, state)
  assert batch.inputs.old_logp is not None
  orders = learner.pass_orders(s.train.seed, int(state.step), G, 2)
  assert not np.array_equal(orders[0], orders[1]), "pick a seed whose passes differ"

  carry = _copy((state.params, state.opt_state, state.value_params, state.value_opt_state))
  host = jax.tree.map(np.asarray, batch)
  size = G // 2
  hand_mets = []
  for order in orders:
    mets = []
    for i in range(2):
      rows = order[i * size:(i + 1) * size]
      mb = jax.device_put(jax.tree.map(lambda a: a[rows], host), t.layout.rows(size))
      *carry, m = t.steps.rl_update(*carry, mb)
      mets.append(jax.device_get(m))
    hand_mets.append({k: np.mean([m[k] for m in mets]) for k in mets[0]})

  before = jax.tree.map(np.asarray, state.params)
  new_state, out = learner.apply_update(t, state._replace(
      params=_copy(state.params), opt_state=_copy(state.opt_state)), batch)
  moved = max(float(np.max(np.abs(np.asarray(a) - b)))
              for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(before)))
  assert moved > 1e-5, "the update did not move the policy; the comparison would be empty"
  chex.assert_trees_all_close(new_state.params, carry[0], rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(new_state.opt_state, carry[1], rtol=1e-6, atol=1e-7)
  for k in hand_mets[1]:  # the plain names are the last pass's
    np.testing.assert_allclose(out[k], hand_mets[1][k], rtol=1e-6, atol=1e-7, err_msg=k)
  for p, want in enumerate(hand_mets, 1):
    for k in learner.PASS_METRICS:
      if k in want:
        np.testing.assert_allclose(out[f"{k}_pass{p}"], want[k], rtol=1e-6, atol=1e-7)
  assert out["approx_kl_pass2"] > out["approx_kl_pass1"]  # the second pass is off-policy


@pytest.mark.parametrize("epochs,expected", [(1, True), (2, False)])
def test_several_epochs_turn_off_the_on_policy_shortcut(epochs, expected):
  config = _config(["loss.preset=grpo", f"train.epochs={epochs}"])
  train = settings.from_section(settings.TrainSettings, "train", config.train)
  own = on_policy.old_logp_in_update(train, config_lib.schedule(config).overlapped,
                                     config.rollout.partial, context.make_objective(config))
  assert own == expected


def test_an_objective_that_cannot_take_several_passes_is_refused():
  config = _config(["loss.preset=dapo", "loss.policy=reinforce", "train.epochs=2"])
  config_lib.validate(config)
  with pytest.raises(ConfigError, match="train.epochs=2") as e:
    context.make_objective(config)
  assert "\n" not in str(e.value) and "-A*logp" in str(e.value)
  # the same objective with one pass, and the ratio form with two, are accepted
  context.make_objective(_config(["loss.preset=dapo", "loss.policy=reinforce"]))
  context.make_objective(_config(["loss.preset=dapo", "loss.policy=reinforce_ratio",
                                  "train.epochs=2"]))


def test_bad_epochs_value_fails_in_one_line():
  with pytest.raises(ConfigError, match="train.epochs") as e:
    config_lib.validate(_config(["train.epochs=0"]))
  assert "\n" not in str(e.value)
