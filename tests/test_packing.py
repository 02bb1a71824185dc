"""Several responses per row (``models.packing``) == one response per row == plain forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import models
from rl_jax.models import packing
from tests.test_grouped import _batch, _cfg, _plain_logprobs
from tests.tiny import assert_same_update


def _lengths(mask):
  return mask.sum(axis=-1).astype(np.int32)  # the masks of _batch are prefixes


@pytest.mark.parametrize("seed", range(5))
def test_the_plan_places_every_response_position_once_within_its_rows(seed):
  rng = np.random.default_rng(seed)
  G, M, R = 3, 7, 10
  lengths = rng.integers(0, R + 1, (G, M))
  lengths[0, 0] = R
  rows = packing.row_count(lengths, R)
  src, dst = packing.plan(lengths, R, rows)
  assert src.shape == (G, rows, R) and dst.shape == (G, M, R)
  for g in range(G):
    held = src[g].ravel()
    held = held[held >= 0]
    want = [i * R + j for i in range(M) for j in range(lengths[g, i])]
    assert sorted(held.tolist()) == want  # each response position exactly once
    for i in range(M):
      n = lengths[g, i]
      at = dst[g, i, :n]
      assert (src[g].ravel()[at] == i * R + np.arange(n)).all()  # dst inverts src
      if n:  # a response stays whole, in order, inside one row
        assert at[0] // R == at[-1] // R and (np.diff(at) == 1).all()


def test_first_fit_decreasing_and_the_row_count_rounding():
  assert packing.first_fit_rows(np.array([3, 8, 5, 2, 2]), 10) == [[1, 3], [2, 0, 4]]
  assert packing.row_count(np.array([[3, 8, 5, 2, 2]]), 10) == 2
  # 16 responses: rows in multiples of 2; the most any group needs rounds up: 3 full rows
  # and 13 one-token responses in 2 more make 5, so 6
  lengths = np.full((2, 16), 1)
  lengths[1, :3] = 10
  assert packing.row_count(lengths, 10) == 6
  assert packing.row_count(np.full((1, 16), 10), 10) == 16
  with pytest.raises(ValueError, match="needs 5 rows of 10, more than 2"):
    packing.plan(lengths[1:], 10, 2)


def _args(seed=0, G=3, M=5, P=9, R=8):
  prompts, lengths, resp, mask = _batch(G=G, M=M, P=P, R=R, seed=seed)
  mask[0, 1] = False  # a response with no token
  lp = _lengths(mask)
  src, dst = packing.plan(lp, R, packing.row_count(lp, R))
  return (prompts, lengths, resp, mask), (jnp.asarray(src), jnp.asarray(dst))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_rows_of_several_responses_give_the_log_probs_and_entropies_of_one_per_row(arch):
  cfg = _cfg(arch)
  params = models.init_params(cfg, jax.random.key(1), std=0.2)
  batch, pack = _args()
  assert pack[0].shape[1] < batch[2].shape[1]  # fewer rows than responses
  args = [jnp.asarray(a) for a in batch]
  fn = jax.jit(models.response_logprobs, static_argnums=0,
               static_argnames=("temperature", "with_entropy"))
  lp, ent = fn(cfg, params, *args, temperature=0.7, with_entropy=True, packing=pack)
  lp0, ent0 = fn(cfg, params, *args, temperature=0.7, with_entropy=True)
  plain = _plain_logprobs(cfg, params, *batch, temperature=0.7)
  np.testing.assert_allclose(lp, plain, atol=2e-5)
  np.testing.assert_allclose(lp, lp0, atol=1e-5)
  np.testing.assert_allclose(ent, ent0, atol=1e-5)
  assert np.abs(np.asarray(ent0)).max() > 0.1


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rows_of_several_responses_give_the_gradients_of_one_per_row(arch):
  cfg = _cfg(arch)
  params = models.init_params(cfg, jax.random.key(2), std=0.2)
  batch, pack = _args(seed=3)
  prompts, lengths, resp, mask = (jnp.asarray(a) for a in batch)
  weights = jax.random.normal(jax.random.key(4), resp.shape)

  def loss(p, packed):
    lp = models.response_logprobs(cfg, p, prompts, lengths, resp, mask,
                                  packing=pack if packed else None)
    return jnp.sum(lp * weights)

  g_rows = jax.jit(jax.grad(loss), static_argnums=1)(params, True)
  g_one = jax.jit(jax.grad(loss), static_argnums=1)(params, False)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4),
               g_rows, g_one)


def test_rows_of_several_responses_give_the_values_of_one_per_row():
  cfg = _cfg("llama")
  vparams = models.init_value_params(cfg, jax.random.key(5))
  vparams["head"] = jax.random.normal(jax.random.key(6), vparams["head"].shape)
  batch, pack = _args(seed=2)
  args = [jnp.asarray(a) for a in batch]
  fn = jax.jit(models.response_values, static_argnums=0)
  want = fn(cfg, vparams, *args)
  assert float(jnp.abs(want).max()) > 0.1
  np.testing.assert_allclose(fn(cfg, vparams, *args, packing=pack), want, atol=2e-5)


def test_the_plan_is_ignored_where_rows_cannot_take_several_responses():
  """The Pallas path (the default on TPU and GPU) and the replicated layout run their own
  rows: the same numbers with and without a plan."""
  cfg = _cfg("llama").replace(prefix_attention="kernel")
  assert not models.packs_rows(cfg) and models.packs_rows(_cfg("llama"))
  params = models.init_params(cfg, jax.random.key(1), std=0.2)
  batch, pack = _args()
  args = [jnp.asarray(a) for a in batch]
  for shared in (True, False):
    a = models.response_logprobs(cfg, params, *args, shared_prefix=shared, packing=pack)
    b = models.response_logprobs(cfg, params, *args, shared_prefix=shared)
    np.testing.assert_array_equal(a, b)


R = 16  # the response budget of the trainer cases


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def _trainer(extra, floor, config=None):
  from rl_jax import config_utils, train  # pylint: disable=import-outside-toplevel
  from tests.tiny import QUICKSTART, TINY_MODEL  # pylint: disable=import-outside-toplevel
  budget = [] if config else [f"rollout.max_new_tokens={R}"]
  config = config_utils.load_config(config or QUICKSTART, TINY_MODEL + [
      "sft.steps=0", "train.batch_groups=2", "rollout.n=4", "rollout.temperature=1.0",
      "train.eval_every=0", "log.tensorboard=False", *budget,
      "train.trim_floor=0", f"train.pack_floor={floor}", *extra])
  s = train.build_setup(config)
  return s, train.make_trainer(s)


@pytest.mark.parametrize("extra,passes", [
    # a KL reference pass beside the update's policy pass, the old log-probs from the
    # update's own pass; the passes and the update in two micro-batches of one group
    (["loss.preset=dr_grpo", "loss.kl_beta=0.05", "train.micro_batches=2"], ("ref_logp",)),
    # a critic (one response per row) and a separate old-log-prob pass
    (["loss.preset=ppo"], ("old_logp", "values")),
], ids=["dr_grpo-kl", "ppo"])
def test_the_update_on_rows_of_several_responses_equals_one_response_per_row(extra, passes):
  """The step's log-prob passes and its update on rows of several responses (the packed
  twins of the passes, ``on_rows`` of ``steps._group_pass``) against one response per row."""
  from rl_jax import train  # pylint: disable=import-outside-toplevel
  from rl_jax.train.learner import (  # pylint: disable=import-outside-toplevel
      learner_batch, update_packing)
  from rl_jax.train.producer import produce  # pylint: disable=import-outside-toplevel
  from tests.test_trim import _ended_early  # pylint: disable=import-outside-toplevel
  s, t = _trainer(extra, floor=4)
  _, one = _trainer(extra, floor=0)
  state = train.begin_rl(s, train.init_state(s))
  if state.value_params:  # a critic whose head reads the trunk (it starts at zeros)
    head = state.value_params["head"]
    state = state._replace(value_params={**state.value_params, "head": jax.device_put(
        jax.random.normal(jax.random.key(7), head.shape, head.dtype), head.sharding)})
  scored, _ = produce(t, t.layout.sampler_params(state.params), state.producer, step=0,
                      version=0, lo=0, hi=s.geometry.rows)
  lengths = np.random.default_rng(0).integers(1, 9, size=scored.mask.shape[0])
  lengths[0] = R  # one response runs to the budget: the trained length stays R
  early = _ended_early(scored, lengths, s.tokenizer.pad_id)._replace(
      rewards=np.random.default_rng(1).normal(size=scored.rewards.shape).astype(np.float32))
  b_pack, info_pack = learner_batch(t, state, early)
  b_one, info_one = learner_batch(one, state, early)
  assert b_one.packing is None and info_one.pop("update_rows") == 4
  assert b_pack.packing[0].shape == (2, info_pack.pop("update_rows"), R)
  assert b_pack.packing[0].shape[1] <= 3 and info_pack == info_one
  # the rule (train.pack_floor=4 in t, 0 in one): a quarter of the rows saved, at or over
  # the floor
  rows = lambda tr, lengths, r=R: update_packing(tr, np.array([lengths]), np.array([lengths]), r)
  assert rows(t, [3, 2, 4, 1]).src.shape == (1, 1, R) and rows(one, [3, 2, 4, 1]) is None
  assert rows(t, [3, 2, 3, 1], 3) is None  # a trained length under the floor
  assert rows(t, [R, R, 9, 6]).src.shape == (1, 3, R)  # 3 rows of 4: a quarter saved
  assert rows(t, [R, R, 9, 8]) is None  # 4 rows: nothing saved
  for name in passes:  # the pass ran on the packed rows and gave the same log-probs
    got, want = getattr(b_pack.inputs, name), getattr(b_one.inputs, name)
    assert float(np.abs(np.asarray(want)).max()) > 0.01
    np.testing.assert_allclose(got, want, atol=2e-5, err_msg=name)
  assert t.steps.logprobs.on_rows._cache_size() == 1  # pylint: disable=protected-access
  assert one.steps.logprobs.on_rows._cache_size() == 0  # pylint: disable=protected-access

  carry = (state.params, state.opt_state, state.value_params, state.value_opt_state)
  out_pack = t.steps.rl_update(*_copy(carry), b_pack)
  out_one = one.steps.rl_update(*_copy(carry), b_one)
  assert_same_update(out_pack, out_one, state.params)


def test_multi_turn_trajectories_on_rows_of_several_equal_one_per_row():
  """Trajectories of model and observation tokens (the guess game, 2 turns in 24 tokens)
  keep their observation tokens inside their segment: the update is the same. Some are
  ended after their first turn, so that two fit one row."""
  from rl_jax import train  # pylint: disable=import-outside-toplevel
  from rl_jax.train.learner import learner_batch  # pylint: disable=import-outside-toplevel
  from rl_jax.train.producer import produce  # pylint: disable=import-outside-toplevel
  from tests.test_trim import AGENT, _ended_early  # pylint: disable=import-outside-toplevel
  agent = AGENT[1:] + ["env.max_turn_tokens=2"]
  s, t = _trainer(agent, floor=4, config=AGENT[0])
  _, one = _trainer(agent, floor=0, config=AGENT[0])
  state = train.begin_rl(s, train.init_state(s))
  scored, _ = produce(t, t.layout.sampler_params(state.params), state.producer, step=0,
                      version=0, lo=0, hi=s.geometry.rows)
  ends = scored.mask.shape[1] - np.argmax(scored.mask[:, ::-1], axis=1)
  first = np.argmax(~scored.mask, axis=1)  # the first turn's model tokens
  assert (ends > first + 1).all()  # observation tokens, then a second turn
  scored = _ended_early(scored, np.where(np.arange(len(ends)) % 2 == 1, first, ends),
                        s.tokenizer.pad_id)._replace(
      rewards=np.random.default_rng(1).normal(size=scored.rewards.shape).astype(np.float32))
  b_pack, _ = learner_batch(t, state, scored)
  b_one, _ = learner_batch(one, state, scored)
  assert b_one.packing is None and b_pack.packing[0].shape[1] < 4
  carry = (state.params, state.opt_state, state.value_params, state.value_opt_state)
  out_pack = t.steps.rl_update(*_copy(carry), b_pack)
  out_one = one.steps.rl_update(*_copy(carry), b_one)
  assert_same_update(out_pack, out_one, state.params)


def test_rows_of_several_responses_on_eight_devices_with_two_groups():
  """The trainer's GRPO gradient with a packing plan on its 8-device FSDP mesh (2 groups: the
  groups do not divide the devices) equals the gradient of one response per row off the mesh
  (the gather that unpacks the rows has a scatter-add for its transpose, as the one
  ``grouped.last_prompt_state`` replaced had)."""
  import optax  # pylint: disable=import-outside-toplevel
  from rl_jax import train  # pylint: disable=import-outside-toplevel
  from rl_jax.train import steps  # pylint: disable=import-outside-toplevel
  s, t = _trainer(["mesh.num_devices=8", "loss.preset=grpo"], floor=4)
  assert t.layout.mesh.shape["fsdp"] == 8
  state = train.init_state(s)
  rng = np.random.default_rng(0)
  prompts, lengths, resp, mask = _batch(G=2, M=4, P=s.prompt_len, R=R, seed=6)
  resp, prompts = resp % s.model_cfg.vocab_size, prompts % s.model_cfg.vocab_size
  put = lambda a: t.layout.put(a, 2)
  inputs = train.objective_inputs(
      t, state, *(put(a) for a in (prompts, lengths, resp, mask)), generated_mask=put(mask),
      rewards=put(rng.normal(size=(2, 4)).astype(np.float32)),
      behaviour_logp=put(np.where(mask, -2.0, 0.0).astype(np.float32)))
  ends = _lengths(mask)
  pack = tuple(put(a) for a in packing.plan(ends, R, packing.row_count(ends, R)))
  assert pack[0].shape[1] < 4
  batch = steps.UpdateBatch(*(put(a) for a in (prompts, lengths, resp)), inputs,
                            t.steps.advantages(inputs))
  one = jax.jit(steps.rl_grads(s))(state.params, state.value_params, batch)[3]
  with t.layout.active():  # traced with the mesh's constraints (a program of its own)
    eight = jax.jit(steps.rl_grads(s))(state.params, state.value_params,
                                       batch._replace(packing=pack))[3]
  assert float(optax.tree.norm(one)) > 0.1
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4), eight, one)


def test_pack_floor_is_checked_in_one_line():
  from rl_jax import config_utils, train  # pylint: disable=import-outside-toplevel
  from rl_jax.errors import ConfigError  # pylint: disable=import-outside-toplevel
  from tests.tiny import QUICKSTART  # pylint: disable=import-outside-toplevel
  with pytest.raises(ConfigError, match="train.pack_floor") as e:
    train.build_setup(config_utils.load_config(QUICKSTART, ["train.pack_floor=-1"]))
  assert "\n" not in str(e.value)
