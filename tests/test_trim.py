"""The learner's batch cut to the step's longest response (``train.trim_floor``): the length
rule, and that one RL update on the cut batch equals the update on the whole budget (params,
optimizer state, loss and metrics) for objectives that read the reference, a critic and the
budget itself (Dr.GRPO's constant), and for multi-turn trajectories; per-turn inputs keep
the budget."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import config_utils, train
from rl_jax.errors import ConfigError
from rl_jax.train.learner import learner_batch, trained_length
from rl_jax.train.producer import produce
from tests.tiny import QUICKSTART, ROOT, TINY_MODEL, assert_same_update

R = 16  # the response budget of the single-turn runs


@pytest.mark.parametrize("longest,budget,floor,expected", [
    (5, 16, 4, 8), (8, 16, 4, 8), (9, 16, 4, 16), (1, 16, 4, 4), (0, 16, 4, 4),
    (3000, 8192, 1024, 4096), (200, 8192, 1024, 1024), (1500, 1500, 1024, 1500),
    (1100, 1500, 1024, 1500), (700, 1500, 1024, 1024),
    (5, 16, 0, 16),  # 0: off
    (100, 512, 1024, 512),  # a budget at or under the floor is never cut
])
def test_trained_length_is_a_power_of_two_over_the_longest_within_the_budget(
    longest, budget, floor, expected):
  assert trained_length(longest, budget, floor) == expected


def test_trim_floor_is_checked_in_one_line():
  with pytest.raises(ConfigError, match="train.trim_floor") as e:
    train.build_setup(config_utils.load_config(QUICKSTART, ["train.trim_floor=-1"]))
  assert "\n" not in str(e.value)


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def _ended_early(scored, lengths: np.ndarray, pad: int):
  """``scored`` whose row i ends after ``lengths[i]`` tokens: what a sampler that drew EOS
  there returns (the tokens after it padding, masked, with zero log-probs)."""
  keep = np.arange(scored.tokens.shape[1])[None, :] < lengths[:, None]
  return scored._replace(tokens=np.where(keep, scored.tokens, pad).astype(np.int32),
                         mask=scored.mask & keep,
                         logprobs=np.where(keep, scored.logprobs, 0.0).astype(np.float32))


# multi-turn: the guess game of configs/agent_quickstart.py, two turns in a 24-token budget
AGENT = [f"{ROOT}/configs/agent_quickstart.py:guess", "env.guess_n=4", "env.max_turns=2",
         "env.max_total_tokens=24", "env.max_turn_tokens=3", "env.max_obs_tokens=12",
         "env.n_train=64", "data.eval_size=4"]


@pytest.mark.parametrize("config,extra,cut", [
    # seq-mean-token-sum-norm (C = the budget), old_logp from the update's own pass, and a
    # reference pass
    (QUICKSTART, ["loss.preset=dr_grpo", "loss.kl_beta=0.05", f"rollout.max_new_tokens={R}"],
     8),
    # a critic (values, GAE over the tokens) and a separate old_logp pass
    (QUICKSTART, ["loss.preset=ppo", f"rollout.max_new_tokens={R}"], 8),
    # trajectories of model and observation tokens: cut after the last model token
    (AGENT[0], AGENT[1:], None),
    # GiGPO reads per-turn inputs, whose token ids index the whole trajectory: never cut
    (AGENT[0], AGENT[1:] + ["loss.advantage=gigpo"], 24),
], ids=["dr_grpo-kl", "ppo", "multi-turn", "gigpo"])
def test_update_on_the_cut_batch_equals_the_whole_budget(config, extra, cut):
  config = config_utils.load_config(config, TINY_MODEL + [
      "sft.steps=0", "train.steps=2", "train.batch_groups=2", "rollout.n=4",
      "rollout.temperature=1.0", "train.eval_every=0", "log.tensorboard=False",
      "train.trim_floor=4", *extra])
  s = train.build_setup(config)
  t = train.make_trainer(s)
  budget = s.geometry.new_tokens
  state = train.begin_rl(s, train.init_state(s))
  scored, _ = produce(t, t.layout.sampler_params(state.params), state.producer, step=0,
                      version=0, lo=0, hi=s.geometry.rows)
  sampled = budget - np.argmax(scored.mask[:, ::-1], axis=1)  # each row's extent
  assert sampled.max() > 8  # a random policy: most samples run long
  lengths = np.minimum(np.random.default_rng(0).integers(1, 8, size=sampled.shape), sampled)
  lengths[int(np.argmax(sampled))] = 7  # the longest: the passes run on 8 tokens
  early = _ended_early(scored, lengths, s.tokenizer.pad_id)._replace(  # rewards to learn from
      rewards=np.random.default_rng(1).normal(size=scored.rewards.shape).astype(np.float32))
  whole = t._replace(setup=dataclasses.replace(s, train=dataclasses.replace(s.train,
                                                                             trim_floor=0)))
  if cut is None:  # the power of two (at least 4) over the last model token of any row
    last = max(int(np.nonzero(row)[0].max()) + 1 for row in early.mask if row.any())
    cut = max(4, 2 ** int(np.ceil(np.log2(last))))
    assert cut < budget
  b_cut, info_cut = learner_batch(t, state, early)
  b_all, info_all = learner_batch(whole, state, early)
  assert b_cut.tokens.shape == (2, 4, cut) and b_all.tokens.shape == (2, 4, budget)
  assert info_cut.pop("update_length") == cut and info_all.pop("update_length") == budget
  assert info_cut == info_all
  if cut == budget:
    return

  carry = (state.params, state.opt_state, state.value_params, state.value_opt_state)
  out_cut = t.steps.rl_update(*_copy(carry), b_cut)
  out_all = t.steps.rl_update(*_copy(carry), b_all)
  assert_same_update(out_cut, out_all, state.params)
