"""The on-policy update takes old_logp from its own policy pass: when that applies, and that
it is the same update (params, loss, metrics) as with the separate log-prob pass."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import config as config_lib
from rl_jax import config_utils, settings, train
from rl_jax.errors import ConfigError
from rl_jax.train import context, on_policy
from tests.tiny import QUICKSTART, TINY_MODEL, ParityTask

TINY = TINY_MODEL + [
    "sft.steps=0", "train.steps=2", "train.batch_groups=2", "rollout.n=4",
    "rollout.temperature=1.0", "train.eval_every=0", "log.tensorboard=False",
    "train.old_logp_pass=auto",  # the base default (the quickstart file pins "separate")
]


def _config(overrides):
  return config_utils.load_config(QUICKSTART, TINY + list(overrides))


@pytest.mark.parametrize("overrides,expected", [
    (["loss.preset=grpo"], True),
    (["loss.preset=dapo"], True),
    (["loss.preset=m2po"], True),  # reads old_logp only at loss time (prepare + ratio)
    (["loss.preset=grpo", "train.old_logp_pass=separate"], False),
    (["loss.preset=grpo", "train.minibatches=2"], False),  # the 2nd minibatch is off-policy
    (["loss.preset=grpo", "rollout.partial=True"], False),
    (["loss.preset=grpo", "train.mode=async"], False),
    (["loss.advantage=reinforce_pp", "loss.kl_beta=0.01"], False),  # estimator reads it
    (["loss.preset=vcpo"], False),  # OPOB baseline reads old_logp
])
def test_when_the_update_takes_old_logp_from_its_own_pass(overrides, expected):
  config = _config(overrides)
  train = settings.from_section(settings.TrainSettings, "train", config.train)
  own = on_policy.old_logp_in_update(train, config_lib.schedule(config).overlapped,
                                     config.rollout.partial, context.make_objective(config))
  assert own == expected


def test_old_logp_pass_value_is_checked_in_one_line():
  with pytest.raises(ConfigError, match="train.old_logp_pass") as e:
    config_lib.validate(_config(["train.old_logp_pass=never"]))
  assert "\n" not in str(e.value)


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


@pytest.mark.parametrize("preset", ["m2po"])  # PPO clip + M2PO's batch-global prepare
def test_own_pass_update_equals_separate_pass_update(preset):
  """One RL update on the same batch: old_logp from a separate teacher-forced pass vs
  stop_gradient of the update's own pass; params, loss and metrics agree to float32
  rounding, and the on-policy path runs no separate pass (old_logp stays None)."""
  setups = {}
  for mode in ("separate", "auto"):
    # the two-region attention and the two-matmul MLP, whose two programs round alike to the
    # tolerances below (with the concatenated attention or the fused MLP Adam's step
    # amplifies their last-bit differences to 3e-5 relative)
    s = train.build_setup(_config([f"loss.preset={preset}", f"train.old_logp_pass={mode}",
                                   "model.prefix_attention=kernel",
                                   "model.fused_mlp=False"]))
    setups[mode] = dataclasses.replace(s, task=ParityTask(s.task))
  sep, own = (train.make_trainer(setups[m]) for m in ("separate", "auto"))
  assert own.steps.old_logp_in_update and not sep.steps.old_logp_in_update
  state = train.begin_rl(setups["separate"], train.init_state(setups["separate"]))
  batch, _, _ = train.collect(sep, state)
  assert batch.inputs.old_logp is not None
  x = batch.inputs
  own_inputs = train.objective_inputs(
      own, state, batch.prompt_tokens, batch.prompt_lengths, batch.tokens, x.mask,
      x.generated_mask, x.rewards, x.behaviour_logp)
  assert own_inputs.old_logp is None  # no separate pass runs
  chex.assert_trees_all_equal(own_inputs, x._replace(old_logp=None))
  own_batch = batch._replace(inputs=own_inputs)

  carry = (state.params, state.opt_state, state.value_params, state.value_opt_state)
  out_sep = sep.steps.rl_update(*_copy(carry), batch)
  out_own = own.steps.rl_update(*_copy(carry), own_batch)
  before = jax.tree.map(np.asarray, state.params)
  moved = max(float(np.max(np.abs(np.asarray(a) - b)))
              for a, b in zip(jax.tree.leaves(out_sep[0]), jax.tree.leaves(before)))
  assert moved > 1e-5, "the update did not move the policy; the comparison would be empty"
  # params: to float32 rounding, but Adam's first step moves each weight by about lr·sign(g),
  # so where a gradient element is tiny the two programs' last-bit differences in it show up
  # in the weight (1 of 3,168 elements of the LM head at 1.8e-6 on this batch): at most 0.1%
  # of a leaf may differ by more than rtol 1e-5 / atol 1e-7, and none by more than 1e-5
  for a, b in zip(jax.tree.leaves(out_own[0]), jax.tree.leaves(out_sep[0])):
    a, b = np.asarray(a), np.asarray(b)
    off = ~np.isclose(a, b, rtol=1e-5, atol=1e-7)
    assert off.mean() <= 1e-3, (off.sum(), off.size)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
  # Adam moments: an element that is a sum with cancellation (an embedding row's gradient)
  # keeps the absolute rounding of its terms, so the tolerance is 1e-4 of the element or of
  # its leaf's largest element (the two programs may add in different orders)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=1e-4, atol=1e-4 * float(np.max(np.abs(b)))), out_own[1], out_sep[1])
  mets_sep, mets_own = jax.device_get(out_sep[4]), jax.device_get(out_own[4])
  assert mets_sep.keys() == mets_own.keys()
  for k in mets_sep:
    np.testing.assert_allclose(mets_own[k], mets_sep[k], rtol=1e-4, atol=1e-6, err_msg=k)
  assert np.isfinite(mets_own["loss"]) and mets_own["update_skipped"] == 0
