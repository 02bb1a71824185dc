"""Adaptive group size: the allocation rule on hand cases and against brute force, per-prompt
advantages over ragged groups against plain numpy, no recompilation when the allocation
changes, and bad settings."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import config as config_lib
from rl_jax import config_utils, losses, train
from rl_jax.data import selection
from rl_jax.errors import ConfigError
from rl_jax.train import group_size as gs
from rl_jax.train import selection_stage as ss
from rl_jax.train import startup
from rl_jax.train.rollouts import Scored
from rl_jax.train.state import place_replicated
from tests import tiny
from tests.tiny import QUICKSTART, TINY_MODEL, ParityTask


# ------------------------------------------------------------------ the allocation rule
def test_mixed_prob_matches_its_definition():
  n = np.arange(1, 9)
  np.testing.assert_allclose(gs.mixed_prob(1.0, 1.0, n), (n - 1) / (n + 1))  # uniform p
  # a sharp posterior is a point mass p = 0.3: 1 - p^n - (1-p)^n
  np.testing.assert_allclose(gs.mixed_prob(3e6, 7e6, n), 1 - 0.3**n - 0.7**n, atol=1e-5)
  # Monte Carlo over p ~ Beta(2, 5)
  p = np.random.default_rng(0).beta(2.0, 5.0, 400_000)
  mc = [np.mean(1 - p**k - (1 - p)**k) for k in (2, 6)]
  np.testing.assert_allclose(gs.mixed_prob(2.0, 5.0, np.asarray([2, 6])), mc, atol=3e-3)


_how = tiny.selection_of


def _value(alpha, beta, k, m):
  return float(np.sum(gs.mixed_prob(alpha, beta, k * m)))


@pytest.mark.parametrize("seed", range(6))
def test_allocation_uses_the_budget_and_is_optimal(seed):
  rng = np.random.default_rng(seed)
  G, m = int(rng.integers(2, 5)), int(rng.integers(1, 4))
  C = G + int(rng.integers(0, 6))
  cap = None if seed % 2 else int(rng.integers(-(-C // G), C - G + 2))
  alpha, beta = rng.uniform(0.5, 20, G), rng.uniform(0.5, 20, G)
  k = gs.allocate(alpha, beta, C, m, cap)
  assert k.sum() == C and k.min() >= 1 and (cap is None or k.max() <= cap)
  top = cap or C
  best = max(_value(alpha, beta, np.asarray(c), m)
             for c in itertools.product(range(1, top + 1), repeat=G) if sum(c) == C)
  assert _value(alpha, beta, k, m) == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_allocation_hand_cases():
  m = 4
  # confidently solved, confidently hopeless, uncertain near 0.5, low but non-zero rate
  alpha = np.asarray([2000.0, 1.0, 6.0, 2.0])
  beta = np.asarray([1.0, 2000.0, 6.0, 18.0])
  k = gs.allocate(alpha, beta, 12, m)
  assert k.sum() == 12 and list(k[:2]) == [1, 1]  # solved / hopeless: one chunk
  assert k[3] > k[2] > 1  # the rare successes need the most samples (sGPO: n ~ 1/p)
  # near 0.5 gets the spare chunks before a confidently solved or hopeless prompt
  assert list(gs.allocate([20.0, 2000.0, 1.0], [20.0, 1.0, 2000.0], 5, m)) == [3, 1, 1]
  # ... but a prompt that failed only a few times in 40 is not yet "solved": the rule keeps
  # looking for its rare failures (symmetric in p <-> 1 - p)
  k = gs.allocate([40.0, 1.0, 20.0], [1.0, 40.0, 20.0], 9, m)
  assert min(k[:2]) > k[2] and abs(k[0] - k[1]) <= 1
  # p and 1 - p are the same case; equal posteriors split evenly
  assert list(gs.allocate([3.0, 9.0], [9.0, 3.0], 6, m)) == [3, 3]
  assert list(gs.allocate(np.ones(4), np.ones(4), 8, m)) == [2, 2, 2, 2]
  assert list(gs.allocate(np.ones(3), np.ones(3), 5, m)) == [2, 2, 1]  # ties: earlier first
  assert list(gs.allocate([6.0, 2.0], [6.0, 18.0], 5, m, cap=3)) == [2, 3]  # capped
  with pytest.raises(ValueError):
    gs.allocate(np.ones(3), np.ones(3), 2, m)  # fewer chunks than prompts
  with pytest.raises(ValueError):
    gs.allocate(np.ones(2), np.ones(2), 7, m, cap=3)  # the cap cannot hold the budget


# ------------------------------------------------------------------ per-prompt advantages
def _ragged(seed, G=4, m=2, K=5):
  """C chunks of m samples for G prompts with random chunk counts, interleaved order."""
  rng = np.random.default_rng(seed)
  k = rng.integers(1, K + 1, G)
  groups = rng.permutation(np.repeat(np.arange(G), k)).astype(np.int32)
  C, R = len(groups), 3
  rewards = rng.integers(0, 2, (C, m)).astype(np.float32) + rng.normal(0, 0.1, (C, m))
  rewards[0, 0] = np.nan  # a bad reward: a missing sample of its prompt
  mask = rng.random((C, m, R)) < 0.8
  mask[..., 0] = True
  x = losses.ObjectiveInputs(
      rewards=jnp.asarray(rewards, jnp.float32), mask=jnp.asarray(mask),
      reward_components=jnp.asarray(rewards[..., None], jnp.float32),
      lengths=jnp.asarray(mask.sum(-1), jnp.float32),
      old_logp=jnp.asarray(rng.normal(size=(C, m, R)), jnp.float32),
      behaviour_logp=jnp.asarray(rng.normal(size=(C, m, R)), jnp.float32),
      ref_logp=jnp.asarray(rng.normal(size=(C, m, R)), jnp.float32),
      values=jnp.asarray(rng.normal(size=(C, m, R)), jnp.float32),
      grad_sq_norms=jnp.asarray(rng.uniform(0.5, 2, (C, m)), jnp.float32))
  return x, groups, G, K


ESTIMATORS = {"grpo": losses.grpo(), "dr_grpo": losses.dr_grpo(), "rloo": losses.rloo(),
              "reinforce_pp": losses.reinforce_pp(0.01, 0.9),
              "reinforce_pp_baseline": losses.reinforce_pp_baseline(),
              "mc_grpo": losses.mc_grpo(), "gae": losses.gae(0.9, 0.8), "gdpo": losses.gdpo(),
              "opob": losses.opob(2.0)}


def _estimate(name):
  """What the learner passes (an ``Objective.advantages_from``) for one estimator."""
  return ESTIMATORS[name].compute


def _numpy_group(name, r):
  """Plain numpy advantages of one prompt's finite rewards r [n]."""
  if name == "grpo":
    return (r - r.mean()) / (r.std(ddof=1) + 1e-6)
  if name == "dr_grpo":
    return r - r.mean()
  return len(r) / (len(r) - 1) * (r - r.mean())  # rloo


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("seed", range(3))
def test_per_prompt_advantages_equal_numpy_per_group(name, seed):
  x, groups, G, K = _ragged(seed)
  adv = np.asarray(jax.jit(  # one program, as the trainer runs it
      lambda x: gs.per_prompt_advantages(_estimate(name), x, groups, G, K).advantages)(x))
  rewards = np.asarray(x.rewards)
  for g in range(G):
    rows = rewards[groups == g].reshape(-1)
    got = adv[groups == g].reshape(-1)
    ok = np.isfinite(rows)
    np.testing.assert_allclose(got[ok], _numpy_group(name, rows[ok]), rtol=1e-5, atol=1e-5)
    assert np.all(got[~ok] == 0)


def test_per_prompt_median_baseline_equals_each_group_alone():
  """MC-GRPO per prompt = the estimator on that prompt's samples as one group."""
  x, groups, G, K = _ragged(7)
  out = jax.jit(lambda x: gs.per_prompt_advantages(_estimate("mc_grpo"), x, groups, G, K))(x)
  est = ESTIMATORS["mc_grpo"]
  rewards = np.asarray(x.rewards)
  for g in range(G):
    alone = jax.jit(est.compute)(losses.ObjectiveInputs(
        rewards=jnp.asarray(rewards[groups == g].reshape(1, -1)),
        mask=jnp.ones((1, int(np.sum(groups == g)) * 2, 1), bool)))
    np.testing.assert_allclose(np.asarray(out.advantages)[groups == g].reshape(-1),
                               np.asarray(alone.advantages)[0], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.keep)[groups == g].reshape(-1),
                                  np.asarray(alone.keep)[0])


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
                                  "mc_grpo", "gae", "gdpo", "opob"])
def test_equal_chunks_give_the_plain_layout(name):
  """Every prompt with M/m chunks: the per-prompt path equals the estimator on [G, M]."""
  G, m, k = 3, 2, 2
  x, _, _, _ = _ragged(1, G=G * k, m=m, K=1)  # C = G·k chunks
  groups = np.repeat(np.arange(G), k).astype(np.int32)
  # each side one program (as the trainer runs them), not op by op; K > k: padding
  per = jax.jit(lambda x: gs.per_prompt_advantages(_estimate(name), x, groups, G, k + 2))(x)
  plain = jax.jit(lambda x: _estimate(name)(jax.tree.map(
      lambda a: a.reshape(G, k * m, *a.shape[2:]), x)))(x)
  for got, want in zip(per, plain):
    if want is None:
      assert got is None
      continue
    np.testing.assert_allclose(np.asarray(got).reshape(np.shape(want)), np.asarray(want),
                               rtol=2e-5, atol=2e-5)


def test_prompt_spread_and_regroup_index():
  groups = np.asarray([1, 0, 1, 2], np.int32)
  rewards = np.asarray([[1, 1], [0, 0], [0, 0], [1, 1]], np.float32)
  assert list(gs.prompt_spread(rewards, groups)) == [False, True, False]
  assert gs.zero_variance_fraction(rewards, groups) == pytest.approx(2 / 3)
  gather, scatter = gs.regroup_index(groups, 3, 2, 2)
  assert gather.tolist() == [[2, 3, -1, -1], [0, 1, 4, 5], [6, 7, -1, -1]]
  assert scatter.tolist() == [4, 5, 0, 1, 6, 7, 8, 9]


# ------------------------------------------------------------------ the selection stage
def test_selection_stage_rolls_chunks_and_updates_posteriors_per_prompt():
  N, G, M, R, m = 30, 4, 4, 2, 2
  c = config_lib.base_config()
  c.train.batch_groups, c.rollout.n, c.rollout.max_new_tokens = G, M, R
  c.data.update(group_size="adaptive", group_chunk=m, beta_decay=1.0)
  rng = np.random.default_rng(0)
  sel = {"alpha": rng.uniform(1, 20, N).astype(np.float32),
         "beta": rng.uniform(1, 20, N).astype(np.float32)}
  wins = rng.integers(0, 2, (N, 64)).astype(np.float32)  # reward of prompt i's j-th sample

  def nxt(data, n):
    idx, st = selection.sampler_next(selection.SamplerState(0, int(data[0]), int(data[1])),
                                     N, n)
    return idx, np.asarray([st.epoch, st.position], np.int32)

  calls = []

  def roll(idx, first):
    calls.append((np.asarray(idx), first))
    seen = {}
    rewards = []
    for i in idx:  # a prompt's chunks read its next samples
      rewards.append(wins[i, seen.get(i, 0):seen.get(i, 0) + m])
      seen[i] = seen.get(i, 0) + m
    g = len(idx)
    z = np.zeros((g * m, R))
    return Scored(np.asarray(idx, np.int32), np.asarray(idx, np.int32)[:, None],
                  np.ones(g, np.int32), z.astype(np.int32), z == 0, z, z.astype(np.int32),
                  np.asarray(rewards, np.float32), np.zeros(2, np.int64), 0.1, 0, {})

  out, data, new, stats = ss.select(*_how(c), np.zeros(2, np.int32), sel, nxt, roll, step=0)
  idx, _ = nxt(np.zeros(2, np.int32), G)
  k = gs.allocate(sel["alpha"][idx], sel["beta"][idx], G * M // m, m)
  assert len(calls) == 1 and calls[0][1] == 0
  np.testing.assert_array_equal(calls[0][0], np.repeat(idx, k))  # one roll, chunk by chunk
  np.testing.assert_array_equal(out.groups, np.repeat(np.arange(G), k))
  assert out.rewards.shape == (G * M // m, m) and list(data) == [0, G]
  wins_i = np.asarray([wins[i, :k[j] * m].sum() for j, i in enumerate(idx)])
  np.testing.assert_allclose(new["alpha"][idx], sel["alpha"][idx] + wins_i, rtol=1e-6)
  np.testing.assert_allclose(new["beta"][idx], sel["beta"][idx] + k * m - wins_i, rtol=1e-6)
  rest = np.setdiff1d(np.arange(N), idx)
  np.testing.assert_array_equal(new["alpha"][rest], sel["alpha"][rest])  # decay 1: unchanged
  assert (stats["group_size_min"], stats["group_size_max"]) == (k.min() * m, k.max() * m)
  assert ss.selector_state(_how(c)[0].kind, True, N).keys() == {"alpha", "beta"}


# ------------------------------------------------------------------ the trainer
TINY = TINY_MODEL + [
    "sft.steps=0", "train.steps=8", "train.batch_groups=4", "rollout.n=4",
    "rollout.max_new_tokens=4", "rollout.temperature=1.0", "train.eval_every=0",
    "log.tensorboard=False", "data.group_size=adaptive", "data.group_chunk=2",
    "data.beta_decay=1.0"]


def test_allocation_changes_without_recompiling():
  """Steps whose allocations differ run on the programs compiled by the first step."""
  s = train.build_setup(config_utils.load_config(QUICKSTART, TINY))
  s = dataclasses.replace(s, task=ParityTask(s.task))
  t = train.make_trainer(s)
  state = train.begin_rl(s, train.init_state(s))
  N = len(s.train_examples)  # posteriors far apart, so the prompts of each step differ
  rng = np.random.default_rng(0)
  sel = {"alpha": np.exp(rng.uniform(0, 5, N)).astype(np.float32),
         "beta": np.exp(rng.uniform(0, 5, N)).astype(np.float32)}
  state = state._replace(producer=state.producer._replace(
      selector=jax.tree.map(lambda a: place_replicated(s, a), sel)))
  # the trainer's own compile clock (tracing, lowering and backend compiles, every thread):
  # no listener of the test's own is registered or removed while programs compile
  clock, allocations = startup.compile_clock(), set()
  clock.take()
  for step in range(6):
    if step == 2:
      warm_up = clock.take()
    state, record, data = train.rl_step(t, state)
    state = state._replace(step=state.step + 1, data=jnp.asarray(data))
    assert np.isfinite(record["loss"])
    if step >= 2:
      allocations.add((record["group_size_min"], record["group_size_max"]))
  assert len(allocations) > 1, allocations  # the allocation did change
  assert warm_up > 0 and clock.take() == 0.0  # the first steps compiled (the clock counts)


@pytest.mark.parametrize("overrides,message", [
    (["data.group_chunk=3"], "not divisible by data.group_chunk=3"),
    (["data.group_chunk=8"], "exceeds rollout.n=4"),
    (["data.group_max=5"], "data.group_max=5: need a multiple of 2"),
    (["data.group_max=2"], "data.group_max=2: need a multiple of 2 and >= 4"),
    (["data.selector=greso"], "works with data.selector none or beta"),
    (["loss.preset=dapo"], "dapo (the dapo preset)"),
    (["train.mode=async"], "not supported with train.mode=async"),
    (["rollout.speculative=True"], "not supported with rollout.speculative"),
    (["rollout.n=6", "train.batch_groups=2", "data.group_chunk=4", "train.minibatches=2"],
     "the 3 chunks of a step are not divisible by train.minibatches=2"),
    (["data.group_size=ragged"], "data.group_size"),
])
def test_bad_adaptive_settings_fail_in_one_line(overrides, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
    train.build_setup(config_utils.load_config(QUICKSTART, TINY + overrides))
  assert "\n" not in str(e.value)
