"""Experience replay (``train.replay``, ``rl_jax.train.replay_stage``): the buffer's
admission, eviction and draw distribution, replayed groups reaching the update with their
recorded behaviour log-probs, exact resume, config errors, and no trace when it is off."""

import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from rl_jax import config as base, config_utils, metrics, settings, train
from rl_jax.checkpoint.tree import leaf_paths
from rl_jax.errors import ConfigError
from rl_jax.train import replay_stage, runner
from rl_jax.train.learner import apply_update
from tests.tiny import QUICKSTART, TINY_MODEL, assert_prompts_as_sampled, stopped_at

# rewards with variance from an untrained policy: the parity of each completion's first
# character (tests/group_reward_fns.py)
TINY = TINY_MODEL + [
    "sft.steps=0", "train.batch_groups=4", "rollout.n=4", "rollout.max_new_tokens=4",
    "rollout.temperature=1.0", "train.eval_every=0", "log.tensorboard=False",
    "reward.group_fn=tests.group_reward_fns:first_char_parity",
]
P = 5  # the buffer tests' prompt bucket
REPLAY = ["train.replay.capacity=4", "train.replay.fraction=0.5", "loss.tis_level=token"]


def _config(overrides=()):
  return config_utils.load_config(QUICKSTART, TINY + list(overrides))


def _scored(rewards, M=3, R=2, first=0, P=P):
  """A ``Scored`` of groups with rewards [g,M]; group i's tokens and prompt ids are all
  first + i (its prompt (i % P) + 1 of them)."""
  g = len(rewards)
  idx = np.arange(first, first + g, dtype=np.int32)
  ids = np.repeat(idx, M)
  rows = np.broadcast_to(ids[:, None], (g * M, R))
  return train.Scored(idx, np.repeat(idx[:, None], P, axis=1),
                      (idx % P + 1).astype(np.int32), rows.copy(),
                      np.ones((g * M, R), bool), -rows.astype(np.float32),
                      np.zeros((g * M, R), np.int32), np.asarray(rewards, np.float32),
                      np.zeros(2, np.int64), 0.0, 0, {})


def _buffer(capacity, M=3, R=2):
  c = _config(["train.replay.capacity=%d" % capacity, "loss.tis_level=token",
               f"rollout.n={M}", f"rollout.max_new_tokens={R}"])
  return replay_stage.empty_buffer(settings.from_section(settings.ReplaySettings, "train.replay",
                                                         c.train.replay), base.geometry(c), P)


# ------------------------------------------------------------------------ the buffer alone
def test_only_groups_with_reward_variance_enter_and_the_oldest_leave_first():
  buf = _buffer(4)
  flat = [[1, 1, 1], [0, 0, 0]]
  buf = replay_stage.add(buf, _scored([[0, 1, 0], *flat, [1, 0, 0]], first=0))
  assert int(buf["size"]) == 2 and list(buf["indices"][:2]) == [0, 3]
  buf = replay_stage.add(buf, _scored([[0, 1, 1]] * 3 + flat, first=10))
  assert int(buf["size"]) == 4  # groups 0 and 3, then 10, 11, 12 over the oldest (0)
  assert sorted(buf["indices"]) == [3, 10, 11, 12]
  assert all(float(buf["rewards"][i].std()) > 0 for i in range(4))
  # the rows and the prompt of each held group are its own
  np.testing.assert_array_equal(buf["tokens"][:, 0, 0], buf["indices"])
  np.testing.assert_array_equal(buf["prompts"], np.repeat(buf["indices"][:, None], P, 1))
  np.testing.assert_array_equal(buf["prompt_lens"], buf["indices"] % P + 1)
  part = replay_stage.draw(buf, 2, 0)
  np.testing.assert_array_equal(part["prompts"][:, 0], part["indices"])
  np.testing.assert_array_equal(part["prompt_lens"], part["indices"] % P + 1)
  merged = replay_stage.merge(_scored([[0, 1, 0]], first=20), part, buf, 1)
  np.testing.assert_array_equal(merged.prompts[:, 0], merged.indices)
  np.testing.assert_array_equal(merged.prompt_lens, merged.indices % P + 1)
  assert replay_stage.draw(replay_stage.add(_buffer(4), _scored(flat)), 1, 0) is None


def test_draw_is_uniform_without_replacement():
  """Over many seeds each of the n held groups is drawn with frequency k / n (binomial,
  5 standard deviations), never twice in one draw."""
  buf = replay_stage.add(_buffer(8), _scored([[0, 1, 0]] * 6))
  n, k, trials = 6, 3, 3000
  counts = np.zeros(n)
  for seed in range(trials):
    part = replay_stage.draw(buf, k, train.seed_for(0, seed, train.Stream.REPLAY))
    assert len(set(part["indices"])) == k and part["tokens"].shape == (k * 3, 2)
    counts[part["indices"]] += 1
  p = k / n
  assert np.all(np.abs(counts - trials * p) < 5 * np.sqrt(trials * p * (1 - p))), counts
  assert replay_stage.draw(buf, 7, 0) is None  # fewer than k held: nothing replayed


# --------------------------------------------------------------------------- the trainer
def test_replayed_groups_reach_the_update_with_their_recorded_logprobs(monkeypatch):
  s = train.build_setup(_config(REPLAY + ["train.steps=3"]))
  t = train.make_trainer(s)
  state = train.begin_rl(s, train.init_state(s))
  G, k = 4, 2
  recorded, replayed = {}, 0
  handed = []  # the scored batches the producer hands the learner
  learner_batch = runner.learner_batch

  def spy(t, state, scored, **kw):
    handed.append(scored)
    return learner_batch(t, state, scored, **kw)

  monkeypatch.setattr(runner, "learner_batch", spy)
  for step in range(3):
    batch, info, producer = train.collect(t, state)
    # fresh and replayed groups carry their prompts' ids, as sampled (the learner's input)
    scored = handed[-1]
    assert_prompts_as_sampled(s, scored)
    np.testing.assert_array_equal(np.asarray(batch.prompt_tokens), scored.prompts)
    tokens, logp = (np.asarray(a) for a in (batch.tokens, batch.inputs.behaviour_logp))
    prompts = np.asarray(batch.prompt_tokens)
    key = lambda g: (prompts[g].tobytes(), tokens[g].tobytes())
    fresh = G - int(info["replay_groups"])
    for g in range(fresh, G):  # the replayed groups: what an earlier step recorded
      np.testing.assert_array_equal(logp[g], recorded[key(g)])
    assert info["replay_size"] == int(producer.replay["size"])
    if info["replay_groups"]:
      replayed += 1
      assert info["replay_groups"] == k and info["mean_token_lag"] > 0
      assert info["replay_token_age"] >= 1 and info["rollout_tokens"] <= fresh * 4 * 4
    recorded.update({key(g): logp[g] for g in range(fresh)})
    state, _ = apply_update(t, state, batch)
    state = state._replace(step=state.step + 1, producer=producer)
  assert replayed >= 1


def test_resume_is_bit_exact(tmp_path):
  """A run of 4 steps against one stopped after 2 (its later checkpoints removed) and
  resumed: the same final weights and metrics."""
  cfg = lambda: _config(REPLAY + ["train.steps=4", "train.checkpoint_every=1", "train.keep=10"])
  ref = tmp_path / "ref"
  train.train(cfg(), str(ref), progress=False)
  rows = metrics.read_jsonl(str(ref / "metrics.jsonl"))
  assert any(r.get("replay_groups", 0) > 0 for r in rows[2:])  # replay after the resume
  resumed = tmp_path / "resumed"
  stopped_at(ref, resumed, 2)
  train.train(cfg(), str(resumed), progress=False)
  a, b = (load_file(os.path.join(d, "hf", "model.safetensors")) for d in (ref, resumed))
  assert a.keys() == b.keys()
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  got = metrics.read_jsonl(str(resumed / "metrics.jsonl"))
  assert ([(r.get("reward_mean"), r.get("replay_groups")) for r in got]
          == [(r.get("reward_mean"), r.get("replay_groups")) for r in rows])


# ------------------------------------------------------------------------- config and off
# the quickstart's 32 groups replay round(0.25 x 32) = 8 a step: a capacity of 8 is the one
# problem of each incompatible row
@pytest.mark.parametrize("overrides,word", [
    (["train.replay.capacity=-1"], "train.replay.capacity"),
    (["train.replay.capacity=4", "train.replay.fraction=1.0"], "train.replay.fraction"),
    (["train.replay.capacity=4", "train.replay.fraction=0.01"], "rounds to 0"),
    (["train.replay.capacity=1"], "fewer groups than a step replays"),
    (["train.replay.capacity=8", "rollout.partial=True"], "rollout.partial"),
    (["train.replay.capacity=8", "train.mode=async"], "train.mode=async"),
    (["train.replay.capacity=8", "rollout.speculative=True"], "rollout.speculative"),
    (["train.replay.capacity=8", "data.group_size=adaptive"], "data.group_size=adaptive"),
    (["train.replay.capacity=8", "env.name=calculator"], "env.name"),
    (["train.replay.capacity=8", "loss.preset=dapo"], "data.selector"),
])
def test_bad_replay_settings_fail_in_one_line(overrides, word):
  config = config_utils.load_config(QUICKSTART, overrides)
  with pytest.raises(ConfigError, match=word) as e:
    base.validate(config)
  assert "\n" not in str(e.value)


def test_replay_without_a_correction_is_refused_in_one_line():
  with pytest.raises(ConfigError, match="never reads the behaviour log-probs") as e:
    train.build_setup(_config(["train.replay.capacity=4"]))
  assert "loss.tis_level" in str(e.value) and "\n" not in str(e.value)


def test_off_by_default_leaves_the_producer_state_as_it_was():
  config = _config()
  s = train.build_setup(config)
  assert config.train.replay.capacity == 0 and not replay_stage.enabled(s.train)
  for state in (train.init_state(s), train.abstract_state(s)):
    assert state.producer.replay == {}
    paths, _, _ = leaf_paths(state)
    assert not [p for p in paths if "replay" in p]
    assert [p for p in paths if p.startswith("producer/")] == ["producer/data"]
  jax.clear_caches()
