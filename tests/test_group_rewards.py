"""Rewards that are not a per-row rule: group functions (``reward.group_fn``, majority vote)
and named reward components (a verifier returning ``{name: float}``) through GDPO."""

import collections
import os

import numpy as np
import pytest

from rl_jax import checkpoint, config_utils, losses, metrics, train
from rl_jax.data import group_rewards, rewards as rewards_lib
from rl_jax.errors import RLJaxError
from rl_jax.train import learner, producer, resume
from rl_jax.train import queue as queue_lib
from tests import group_reward_fns
from tests.tiny import QUICKSTART, TINY_MODEL

G, M = 4, 4
TINY = TINY_MODEL + [
    "sft.steps=0", "train.steps=2", f"train.batch_groups={G}", f"rollout.n={M}",
    "rollout.temperature=1.0", "train.eval_every=0", "train.checkpoint_every=0",
    "log.tensorboard=False"]


def _config(overrides=()):
  return config_utils.load_config(QUICKSTART, TINY + list(overrides))


def _vote(completions):
  """Majority vote by hand: count the answers, the most frequent wins, the first seen wins a
  tie; completions without an answer (None) neither vote nor score."""
  counts, first = collections.Counter(), {}
  for i, a in enumerate(completions):
    if a is not None:
      counts[a] += 1
      first.setdefault(a, i)
  if not counts:
    return [0.0] * len(completions)
  best = max(counts.values())
  label = min((a for a in counts if counts[a] == best), key=first.get)
  return [float(a == label) for a in completions]


@pytest.mark.parametrize("group, expected", [
    (["0123", "0123", "0132", "0123"], [1, 1, 0, 1]),
    (["012", "021", "021", "012"], [1, 0, 0, 1]),  # a tie: the answer seen first wins
    (["abc", " abc\n", "acb", "the answer is \\boxed{acb}"], [1, 1, 0, 0]),  # tie again
    (["so 1,000", "#### 1000", "\\boxed{7}", "no answer here"], [1, 1, 0, 0]),
    (["", "  ", "two words", "x y"], [0, 0, 0, 0]),  # nobody votes
])
def test_majority_vote_matches_a_hand_count(group, expected):
  keys = [group_rewards.answer_key(c) for c in group]
  assert group_rewards.majority_vote(group) == _vote(keys) == [float(e) for e in expected]


def test_majority_vote_on_random_groups_matches_a_hand_count():
  rng = np.random.default_rng(0)
  for _ in range(200):
    group = ["".join(rng.choice(list("012"), 2)) for _ in range(rng.integers(1, 9))]
    assert group_rewards.majority_vote(group) == _vote(group)


def test_user_group_fn_by_import_path_trains_and_reaches_the_metrics(tmp_path):
  group_reward_fns.CALLS.clear()
  train.train(_config(["reward.group_fn=tests.group_reward_fns:first_char_parity"]),
              str(tmp_path), progress=False)
  rows = [r for r in metrics.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
          if "reward_mean" in r]
  assert len(rows) == 2
  calls = group_reward_fns.CALLS[1:]  # the first call checks the function at setup
  assert len(calls) == 2 * G
  for step, row in enumerate(rows):
    got = np.asarray(calls[step * G:(step + 1) * G], np.float32)
    np.testing.assert_allclose(row["reward_mean"], got.mean(), rtol=1e-6)


def test_majority_vote_trains_on_sorting():
  s = train.build_setup(_config(["reward.group_fn=majority_vote"]))
  t = train.make_trainer(s)
  state = train.begin_rl(s, train.init_state(s))
  scored, _ = producer.produce(t, t.layout.sampler_params(state.params), state.producer,
                               step=0, version=0, lo=0, hi=G)
  text = producer.decode(s, scored.tokens, scored.mask)
  want = [group_rewards.majority_vote(text[g * M:(g + 1) * M]) for g in range(G)]
  np.testing.assert_array_equal(scored.rewards, np.asarray(want, np.float32))


@pytest.mark.parametrize("overrides, message", [
    (["reward.group_fn=tests.group_reward_fns:one_short"],
     "reward.group_fn='tests.group_reward_fns:one_short' returned 3 rewards for a group of 4 "
     "completions ([0.0, 0.0, 0.0]); it must return one per completion"),
    (["reward.group_fn=tests.group_reward_fns:nothing"], "has no attribute 'nothing'"),
    (["reward.group_fn=vote"], "config.reward.group_fn must be '', a built-in"),
    (["reward.group_fn=majority_vote", "env.name=calculator"], "not supported with env.name"),
])
def test_bad_group_fns_fail_in_one_line(overrides, message):
  with pytest.raises(RLJaxError) as e:
    train.build_setup(_config(overrides))
  assert message in str(e.value) and "\n" not in str(e.value)


def test_group_values_are_checked():
  check = group_rewards.check_group_values
  assert check([1, 0.5, {"a": 1}], 3, "f") == [1.0, 0.5, {"a": 1.0}]
  for bad, what in (([1.0, float("nan")], "returned nan for completion 1"),
                    ([1.0, "1"], "returned '1' for completion 1"),
                    ([1.0, {"a": float("inf")}], "for completion 1"),
                    (0.5, "must return a sequence of 2")):
    with pytest.raises(RLJaxError, match="f returned") as e:
      check(bad, 2, "f")
    assert what in str(e.value)


def test_a_failing_group_call_scores_zero_and_keeps_its_error():
  """A call that raises scores its group 0, is counted, and its text is kept for the note
  the run prints (``rewards.note_failures``); the other groups score as returned."""
  def fn(group, example):
    if example == "bad":
      raise ValueError(f"cannot score {example}")
    return [1.0] * len(group)

  values, stats = group_rewards.score_groups(fn, ["a", "b", "c", "d"], ["ok", "bad"], 2, "f")
  assert values == [1.0, 1.0, None, None]
  assert stats == {"exceptions": 1, "timeouts": 0, "errors": ["ValueError: cannot score bad"]}


def test_mismatched_component_names_fail_in_one_line():
  """A verifier whose rows name their components differently stops the step in one line."""
  s = train.build_setup(_config(["data.task=sorting_parts_mismatch"]))
  assert s.reward_names == ("odd", "length")  # the first example's own answer has no extra
  t = train.make_trainer(s)
  state = train.begin_rl(s, train.init_state(s))
  with pytest.raises(RLJaxError) as e:
    producer.produce(t, t.layout.sampler_params(state.params), state.producer, step=0,
                     version=0, lo=0, hi=G)
  assert ("the task's verifier returned components ['odd', 'length', 'extra'] for row" in
          str(e.value) and "every row needs the same component names" in str(e.value))
  assert "\n" not in str(e.value)


def test_stack_components():
  values = [{"a": 1.0, "b": 0.0}, {"a": 1.0, "c": 0.0}]
  with pytest.raises(RLJaxError) as e:
    rewards_lib.stack_components(values, ("a", "b"), "the task's verifier")
  assert "returned components ['a', 'c'] for row 1" in str(e.value)
  totals, comps = rewards_lib.stack_components([values[0], None, values[0]], ("b", "a"))
  np.testing.assert_array_equal(totals, [1.0, 0.0, 1.0])
  np.testing.assert_array_equal(comps, [[0.0, 1.0], [0.0, 0.0], [0.0, 1.0]])
  assert rewards_lib.compute_rewards(lambda c, r: {"x": 0.25, "y": 0.5}, ["a"], ["b"])[0] == 0.75


def test_verifier_components_reach_gdpo_and_the_metrics():
  """The verifier's components and DAPO's overlong penalty (a component of its own) are the
  GDPO estimator's ``reward_components``; the reward is their sum."""
  s = train.build_setup(_config(["data.task=sorting_parts", "loss.advantage=gdpo",
                                 "data.overlong_buffer=2"]))
  assert s.reward_names == ("odd", "length", "overlong")
  t = train.make_trainer(s)
  state = train.begin_rl(s, train.init_state(s))
  scored, _ = producer.produce(t, t.layout.sampler_params(state.params), state.producer,
                               step=0, version=0, lo=0, hi=G)
  assert scored.components.shape == (G, M, 3)
  np.testing.assert_allclose(scored.rewards, scored.components.sum(-1), atol=1e-6)
  lengths = scored.mask.sum(axis=1).reshape(G, M)
  np.testing.assert_allclose(scored.components[..., 2], np.where(lengths > 3, (3 - lengths) / 2,
                                                                 0.0))
  assert scored.components[..., 0].std() > 0, "pick a seed whose groups differ"
  batch, info = learner.learner_batch(t, state, scored)
  want = losses.gdpo_advantages(np.asarray(scored.components))
  np.testing.assert_allclose(np.asarray(batch.advantages.advantages), np.asarray(want),
                             atol=1e-5)
  np.testing.assert_array_equal(np.asarray(batch.inputs.reward_components), scored.components)
  for k, name in enumerate(s.reward_names):
    assert info[f"reward/{name}"] == pytest.approx(float(scored.components[..., k].mean()))
  assert "reward/odd" not in learner.learner_batch(
      t, state, scored._replace(components=None))[1]


def test_components_round_trip_through_the_checkpointed_queue(tmp_path):
  """An asynchronous run (lag 1) with named components checkpoints its queue with them, and a
  resumed run reads that checkpoint back; runs without components keep the old arrays."""
  over = ["data.task=sorting_parts", "loss.advantage=gdpo", "train.mode=async",
          "train.async_lag=1", "train.checkpoint_every=1"]
  s = train.build_setup(_config(over))
  q = queue_lib.setup_queue(s)
  assert q["components"].shape == (1, G, M, 2)
  assert "components" not in queue_lib.setup_queue(train.build_setup(_config(over[3:])))
  item = dict(indices=np.arange(G, dtype=np.int32), rewards=np.ones((G, M), np.float32),
              components=np.random.default_rng(0).random((G, M, 2)).astype(np.float32))
  for k in ("prompts", "prompt_lens", "tokens", "mask", "logprobs", "versions"):
    item[k] = q[k][0]
  scored = train.Scored(**item, faults=np.zeros(2, np.int64), rollout_s=1.0, version=0,
                        stats={})
  (back,) = queue_lib.from_arrays(queue_lib.to_arrays(q, [scored]))
  np.testing.assert_array_equal(back["components"], item["components"])

  resumed, straight = str(tmp_path / "resumed"), str(tmp_path / "straight")
  train.train(_config(over), resumed, progress=False)
  ckpt = checkpoint.Checkpointer(os.path.join(resumed, "checkpoints"))
  saved = resume.restore_newest(s, ckpt, train.abstract_state(s)).rollout_queue
  assert int(saved["count"]) == 1 and np.asarray(saved["components"]).any()
  train.train(_config(over + ["train.steps=3"]), resumed, progress=False)  # from the queue
  train.train(_config(over + ["train.steps=3"]), straight, progress=False)
  rows = [[r for r in metrics.read_jsonl(os.path.join(d, "metrics.jsonl")) if "reward/odd" in r]
          for d in (resumed, straight)]
  assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]] == [1, 2, 3]
  for name in ("reward_mean", "reward/odd", "reward/length"):
    assert [r[name] for r in rows[0]] == [r[name] for r in rows[1]], name
