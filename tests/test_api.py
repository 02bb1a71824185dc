"""rl_jax.api: a GRPO loop written with the primitives reproduces the trainer bit for bit;
gradient accumulation over half-batches equals the full batch; save / load round-trips."""

import os

import jax
import ml_collections
import numpy as np
import pytest

from rl_jax import api, config_utils, train
from rl_jax.errors import ConfigError, RLJaxError
from rl_jax.train import rollouts
from tests.tiny import QUICKSTART, TINY_MODEL

STEPS = 3
# the tiny model and batch of test_train.py's runs (their RL programs, from the compilation
# cache) with the quickstart's task
OVERRIDES = TINY_MODEL + [f"train.steps={STEPS}", "sft.steps=0", "train.batch_groups=4",
                          "rollout.n=4", "train.eval_every=0", "train.checkpoint_every=0",
                          "log.tensorboard=False"]


def _grpo_loop(run: api.Trainer, steps: int) -> list[dict]:
  """The trainer's synchronous GRPO step, written with the primitives."""
  s = run.setup
  G, M = s.train.batch_groups, s.rollout.n
  records = []
  for _ in range(steps):
    examples = run.next_examples(G)
    prompts = [s.tokenizer.encode(e.prompt) for e in examples]
    out = run.sample(prompts, n=M)
    texts = rollouts.decode(s, np.asarray(out.tokens), np.asarray(out.mask))
    rewards, _ = rollouts.score(s, texts, [e.answer for e in examples for _ in range(M)])
    mets = run.forward_backward(run.batch(prompts, out, rewards))
    records.append(dict(mets, **run.optim_step(), reward_mean=float(np.mean(rewards))))
  return records


def _assert_trees_equal(a, b):
  a, b = jax.device_get(a), jax.device_get(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The trainer's run and the primitives' loop from the same config."""
  config = config_utils.load_config(QUICKSTART, OVERRIDES)
  workdir = str(tmp_path_factory.mktemp("trainer"))
  trained = train.train(config, workdir, progress=False)
  run = api.Trainer(config)
  records = _grpo_loop(run, STEPS)
  return trained, run, records, workdir


def test_custom_grpo_loop_matches_the_trainer_bit_for_bit(runs):
  trained, run, records, _ = runs
  assert run.step == int(trained.step) == STEPS
  _assert_trees_equal(run.state.params, trained.params)
  _assert_trees_equal(run.state.opt_state, trained.opt_state)
  _assert_trees_equal(run.state.producer.data, trained.producer.data)  # the same prompts were drawn
  assert all(r["update_skipped"] == 0 for r in records)
  assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in records)


def _batch(run):
  """One step's batch from the current weights, with reward variance in every group."""
  s = run.setup
  G, M = s.train.batch_groups, s.rollout.n
  examples = list(s.train_examples[:G])
  prompts = [s.tokenizer.encode(e.prompt) for e in examples]
  out = run.sample(prompts, n=M, seed=7)
  rewards = np.tile(np.arange(M, dtype=np.float32) % 3, G)  # GRPO needs spread in a group
  return run.batch(prompts, out, rewards)


def _half(b, sl):
  return api.Batch(*(None if x is None else np.asarray(x)[sl] for x in b))


def test_accumulating_two_half_batches_equals_the_full_batch(runs):
  _, run, _, _ = runs
  b = _batch(run)
  old = run.logprobs(b)  # one set of proximal log-probs, as one update of the batch takes
  b = b._replace(old_logp=np.asarray(old))
  full = run.forward_backward(b)
  g_full = jax.device_get(run.gradients)
  run.zero_grad()
  G = b.tokens.shape[0]
  run.forward_backward(_half(b, slice(0, G // 2)))
  run.forward_backward(_half(b, slice(G // 2, G)))
  g_acc = jax.device_get(run.gradients)
  run.zero_grad()
  assert run.gradients is None
  for x, y in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_acc)):
    np.testing.assert_allclose(y, x, rtol=2e-4, atol=1e-7)
  assert max(float(np.max(np.abs(x))) for x in jax.tree.leaves(g_full)) > 1e-4
  assert np.isfinite(full["loss"])
  # the log-probs of the sampled tokens are the sampler's (float rounding), masked to 0
  np.testing.assert_allclose(np.asarray(old), np.asarray(b.behaviour_logp), atol=2e-4)
  with pytest.raises(RLJaxError, match="optim_step without gradients"):
    run.optim_step()
  with pytest.raises(RLJaxError, match="batch shapes differ"):
    run.forward_backward(b._replace(mask=np.asarray(b.mask)[:, :1]))
  with pytest.raises(RLJaxError, match="rewards or advantages"):
    run.forward_backward(b._replace(rewards=None))
  # a prompt longer than the run's compiled prompt length is one error, not a numpy one
  P = run.setup.prompt_len
  with pytest.raises(RLJaxError, match=f"prompt 1 has {P + 1} tokens; the run's programs take "
                                       f"prompts of at most {P}"):
    run.batch([[1]] + [[1] * (P + 1)] * (G - 1), b, np.zeros(b.mask.shape[:2]))
  # rewards that are not numbers, or infinite (NaN alone marks a missing sample)
  prompts, M = [[1]] * G, b.mask.shape[1]
  with pytest.raises(RLJaxError, match="rewards must be numbers"):
    run.batch(prompts, b, ["a"] * (G * M))
  with pytest.raises(RLJaxError, match="reward 3 is infinite"):
    run.batch(prompts, b, [0.0] * 3 + [np.inf] + [0.0] * (G * M - 4))
  for n in (0, -1, "4"):
    with pytest.raises(RLJaxError, match="next_examples takes a positive int count"):
      run.next_examples(n)
  assert run.gradients is None


def test_a_config_without_its_sections_is_one_line():
  """A hand-built config missing whole sections: one line that says where to start, not
  the first missing key."""
  with pytest.raises(ConfigError, match=r"^the config has no section 'data' \(15 of 16 are "
                                        r"missing\): start from rl_jax.config.base_config\(\)"):
    api.Trainer(ml_collections.ConfigDict({"model": {}}))


def test_save_load_round_trips_and_reads_the_trainers_checkpoint(runs, tmp_path):
  trained, run, _, workdir = runs
  path = str(tmp_path / "ckpt")
  run.save(path)
  saved = jax.device_get((run.state.params, run.state.opt_state, run.state.producer.data))
  step = run.step
  _grpo_loop(run, 1)  # move away from the saved state
  assert run.step == step + 1
  run.load(path)
  assert run.step == step
  _assert_trees_equal((run.state.params, run.state.opt_state, run.state.producer.data), saved)
  # the trainer's own checkpoint (same format) gives the trainer's final state
  run.load(os.path.join(workdir, "checkpoints"))
  _assert_trees_equal(run.state.params, trained.params)
  with pytest.raises(RLJaxError, match="no checkpoint"):
    run.load(str(tmp_path / "empty"))
  assert not (tmp_path / "empty").exists()  # a mistyped path is not created
