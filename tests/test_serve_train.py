"""Training an agent written against the OpenAI API (``env.agent``): its episodes run as
sessions of the server over the trainer's engine.

One short run of the agentic quickstart with ``tests.openai_agents:calculator_agent``
(a supervised warm start, two GRPO steps, evaluation through the agent), then, from the
run's exported policy, the same episodes through HTTP sessions and through an in-process
environment that implements the agent's logic: identical tokens, log-probs and rewards.
"""

import os
import re

import jax
import numpy as np
import pytest

from rl_jax import config_utils, metrics, models, train
from rl_jax.envs import Message, StepResult
from rl_jax.errors import ConfigError, RLJaxError
from rl_jax.rollout.agent_records import EpisodeSpec
from rl_jax.serve.sessions import assistant_reply
from rl_jax.train import agent_stage
from rl_jax.train.context import build_setup
from tests import openai_agents
from tests.tiny import ROOT

pytest.importorskip("fastapi")

AGENT_QUICKSTART = os.path.join(ROOT, "configs", "agent_quickstart.py")
RUN = ["env.agent=tests.openai_agents:calculator_agent", "sft.steps=24", "train.steps=2",
       "train.eval_every=1000", "data.eval_size=16", "train.checkpoint_every=1000"]


def _config(*overrides):
  return config_utils.load_config(AGENT_QUICKSTART, RUN + list(overrides))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("agent_sessions"))
  train.train(_config(), workdir, progress=False)
  return workdir


def test_an_openai_agent_trains_through_sessions(run):
  rows = metrics.read_jsonl(os.path.join(run, "metrics.jsonl"))
  rl = [r for r in rows if r["phase"] == "rl"]
  assert [r["step"] for r in rl] == [25, 26]
  for r in rl:
    assert r["sessions"] >= 16 * 8 and r["agent_errors"] == 0 and r["session_rewrites"] == 0
    assert r["tool_calls"] > 0 and 1.0 <= r["turns_mean"] <= 3.0  # the agent ran its tool
    assert r["mismatch_max"] < 1e-4  # the trainer scores the ids the sessions sampled
  assert 0.0 <= rows[-1]["eval_accuracy"] <= 1.0  # evaluated through the agent too
  assert os.path.exists(os.path.join(run, "hf", "rl_jax_tokenizer.json"))


class MirrorEnv:
  """``calculator_agent``'s logic as an in-process environment: the reply's tool calls as
  the server parses them, the tool's answer as a tool message, at most 3 turns."""

  tools = ()

  def reset(self, example, seed):
    del seed
    self.example, self.turns = example, 0
    return [Message("user", example["prompt"])]

  def step(self, action):
    self.turns += 1
    content, calls = assistant_reply(action, "compact")
    if not calls:
      return StepResult((), float((content or "").strip() == self.example["answer"]), True,
                        {"tool_calls": 0})
    if self.turns >= 3:
      return StepResult((), 0.0, True, {"tool_calls": len(calls)})
    answer = openai_agents.multiply(calls[0][1].get("expr", ""))
    return StepResult((Message("tool", answer, "calc"),), 0.0, False,
                      {"tool_calls": len(calls)})


def test_sessions_sample_what_an_in_process_environment_samples(run):
  """The run's policy, 6 episodes × 8 samples at temperature 0.7: through HTTP sessions
  and through MirrorEnv, the same tokens, observation ids, log-probs and rewards (lockstep
  scheduling, so the decode batches are the same too)."""
  s = build_setup(_config())
  _, params = models.load_hf(os.path.join(run, "hf"))
  examples = s.train_examples[:6]
  outs = []
  for make in (None, MirrorEnv):
    engine = agent_stage.make_engine(s, 0.7)
    engine.deterministic, engine.ttl = True, None
    if make is None:
      specs = agent_stage.episodes(s, examples, range(6))
    else:
      specs = [EpisodeSpec(make, ex.data, i) for i, ex in enumerate(examples)]
    outs.append(engine.rollout(jax.device_get(params), specs, first_uid=100))
    engine.close()
  http, local = outs
  assert http.tool_calls.sum() > 0 and http.num_turns.max() >= 2  # multi-turn episodes
  for name in ("tokens", "model_mask", "versions", "reward", "num_turns"):
    np.testing.assert_array_equal(getattr(http, name), getattr(local, name), err_msg=name)
  np.testing.assert_array_equal(http.logprobs, local.logprobs)


def test_an_agent_that_never_asks_is_one_line():
  """An agent function that returns before its first request gives its episode no prompt:
  a ConfigError (one ``error:`` line from the CLI), not a RuntimeError's traceback."""
  s = build_setup(_config("env.agent=tests.openai_agents:silent_agent"))
  engine = agent_stage.make_engine(s, 1.0)
  params = models.init_params(s.model_cfg, jax.random.key(0))
  with pytest.raises(ConfigError, match="the agent function returned before its first "
                                        "request"):
    engine.rollout(params, agent_stage.episodes(s, s.train_examples[:1], range(1)))
  engine.close()


@pytest.mark.parametrize("agent,counter", [("crashing_agent", "agent_errors"),
                                           ("non_number_agent", "agent_errors"),
                                           ("rewriting_agent", "session_rewrites")])
def test_a_failing_agent_fails_its_episodes_not_the_run(agent, counter):
  """An agent that raises after its first request, one that returns NaN (which once kept
  its episodes open with no agent to answer, and the rollout hung) or a string (which
  ``float`` would read), and one that rewrites its conversation (answered 400): their
  episodes end with reward 0 and are counted; the rollout completes."""
  s = build_setup(_config(f"env.agent=tests.openai_agents:{agent}"))
  engine = agent_stage.make_engine(s, 1.0)
  params = models.init_params(s.model_cfg, jax.random.key(0))
  out = engine.rollout(params, agent_stage.episodes(s, s.train_examples[:2], range(2)))
  engine.close()
  stats = s.task.stats()
  assert stats[counter] == 2 * 8 and stats["sessions"] == 2 * 8
  assert not out.reward.any() and out.num_turns.max() == 1


def test_agent_config_errors_are_one_line():
  with pytest.raises(ConfigError, match="env.agent"):
    build_setup(config_utils.load_config(AGENT_QUICKSTART, ["env.agent=no_such_module:fn"]))
  with pytest.raises(ConfigError, match=re.escape(
      "env.agent='os:getcwd' must take (base_url, api_key, example); its signature is ()")):
    build_setup(config_utils.load_config(AGENT_QUICKSTART, ["env.agent=os:getcwd"]))
  with pytest.raises(ConfigError, match="env.agent"):
    build_setup(config_utils.load_config(AGENT_QUICKSTART, ["env.agent=not a path"]))
  with pytest.raises(ConfigError, match="env.agent"):
    build_setup(config_utils.load_config(AGENT_QUICKSTART, [
        "env.name=", "env.agent=tests.openai_agents:calculator_agent"]))


@pytest.mark.slow  # a one-step run; the sessions' checks of their own: the tests above
def test_an_agent_that_opens_with_another_prompt_is_one_line(tmp_path):
  """The trainer packs prompts from the task, so a session must open with the task's
  prompt for its example; the line says so, not that the tokenizer is at fault."""
  with pytest.raises(RLJaxError, match=r"env.agent='tests.openai_agents:greeting_agent': the "
                     r"first request of example \d+'s sessions does not render to the prompt "
                     "env.name='calculator' gives that example"):
    train.train(_config("env.agent=tests.openai_agents:greeting_agent", "train.steps=1",
                        "sft.steps=0", "train.eval_every=0"), str(tmp_path), progress=False)
