"""Adapters on the real libraries: gymnasium toy-text environments played in text, and a
verifiers (v1) taskset whose own reward functions score the episodes (in-memory data, no
network, no model)."""

import gymnasium
import pytest
import verifiers.v1 as vf

from rl_jax.envs import Environment, Message
from rl_jax.envs.adapters import (BLACKJACK_CODEC, FROZEN_LAKE_CODEC, GymnasiumTextEnv,
                                  verifiers_spec)
from rl_jax.envs.spec import run_episode
from rl_jax.envs.tools import Calculator


def _scripted(actions):
  it = iter(actions)
  return lambda _messages: next(it)


def test_frozen_lake_in_text():
  env = GymnasiumTextEnv(gymnasium.make("FrozenLake-v1", is_slippery=False), FROZEN_LAKE_CODEC)
  assert isinstance(env, Environment)
  ep = run_episode(env, {}, _scripted(["down", "down", "right", "RIGHT", "down", "right"]))
  assert ep.messages[0].content.endswith("at 0") and "left, down" in ep.messages[0].content
  assert ep.done and ep.total_reward == 1.0 and ep.steps[-1].info["terminated"]
  assert [m.content for m in ep.messages if m.role == "user"][1:] == [
      "at 4", "at 8", "at 9", "at 10", "at 14"]


def test_frozen_lake_invalid_action_and_turn_limit():
  env = GymnasiumTextEnv(lambda: gymnasium.make("FrozenLake-v1", is_slippery=False),
                         FROZEN_LAKE_CODEC, max_turns=2, invalid_reward=-0.5)
  env.reset({}, seed=0)
  res = env.step("jump")
  assert res.messages == (Message("user", "invalid action"),) and res.reward == -0.5
  res = env.step("left")
  assert res.done and res.info["truncated"]


def test_blackjack_is_deterministic_given_the_seed():
  def play(seed):
    env = GymnasiumTextEnv(gymnasium.make("Blackjack-v1"), BLACKJACK_CODEC)
    return run_episode(env, {"seed": 5}, _scripted(["hit", "hit", "hit", "stick"] * 3), seed)
  a, b = play(1), play(1)
  assert a.messages == b.messages and a.total_reward == b.total_reward
  assert a.done and a.messages[0].content.startswith("Blackjack")
  assert "sum " in a.messages[0].content


class _Echo(gymnasium.Env):
  """Text actions: reward 1 for repeating the observed word."""

  def __init__(self):
    self.action_space = gymnasium.spaces.Text(max_length=8)
    self.observation_space = gymnasium.spaces.Text(max_length=8)
    self._word = None

  def reset(self, *, seed=None, options=None):
    super().reset(seed=seed)
    self._word = ["apple", "pear", "fig"][int(self.np_random.integers(3))]
    return self._word, {}

  def step(self, action):
    return "", float(action == self._word), True, False, {}


def test_text_action_space_passes_text_through():
  env = GymnasiumTextEnv(_Echo())
  word = env.reset({}, seed=3)[0].content
  assert env.step(word).reward == 1.0
  env.reset({}, seed=3)
  assert env.step("x" * 20).info["invalid_action"]  # longer than the Text space allows


class QAData(vf.TaskData):
  answer: str


class QATask(vf.Task[QAData, vf.State, vf.TaskConfig]):

  @vf.reward
  async def exact(self, task, trace) -> float:
    return float(trace.last_reply == task.answer)

  @vf.reward(weight=0.5)
  async def used_tool(self, trace) -> float:
    return float(bool(trace.tool_messages))


class QATaskset(vf.Taskset[QATask, vf.TasksetConfig]):
  ROWS = [("What is 12*34?", "408"), ("What is 7*8?", "56")]

  def load(self):
    for q, a in self.ROWS:
      yield QATask(QAData(prompt=q, answer=a, system_prompt="Answer with a number."))


def test_verifiers_taskset_scored_by_its_own_rewards():
  spec = verifiers_spec(QATaskset(vf.TasksetConfig()), tools=[Calculator()])
  assert [e["prompt"] for e in spec.train] == ["What is 12*34?", "What is 7*8?"]
  ex = spec.train[0]
  env, opening = spec.start(ex)
  assert isinstance(env, Environment)
  assert opening == [Message("system", "Answer with a number."),
                     Message("user", "What is 12*34?")]
  call = '<tool_call>{"name": "calc", "arguments": {"expr": "12*34"}}</tool_call>'
  res = env.step(call)
  assert res.messages == (Message("tool", "408", name="calc"),) and not res.done
  res = env.step("408")
  assert res.done and res.reward == pytest.approx(1.5)
  assert res.info["rewards"] == {"exact": 1.0, "used_tool": 0.5}

  env, _ = spec.start(spec.train[1])
  res = env.step("54")
  assert res.done and res.reward == 0.0 and res.info["rewards"] == {"exact": 0.0, "used_tool": 0.0}


def test_verifiers_scoring_inside_a_running_event_loop():
  import asyncio  # pylint: disable=import-outside-toplevel
  spec = verifiers_spec(QATaskset(vf.TasksetConfig()))

  async def main():
    env, _ = spec.start(spec.train[1])
    return env.step("56")
  res = asyncio.run(main())
  assert res.reward == 1.0
