"""Tasks from outside rl_jax: ``env.name=my_env:make`` on a file beside the user's config
trains (its own settings in ``env.kwargs``, set from the command line), ``env.gym_id`` and
``env.verifiers`` reach the adapters, every bad import path or task is one ``error:`` line
before anything compiles, and GiGPO's step groups follow the state keys environments report
(the same state reached by different action histories shares a step group)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from rl_jax import config as config_lib
from rl_jax import config_utils, imports, losses, metrics, settings, train
from rl_jax.envs import Message, StepResult
from rl_jax.errors import ConfigError
from rl_jax.rollout.agent_records import AgentRollout, env_seed
from rl_jax.train import agent_stage, loop, producer, state as state_lib
from rl_jax.train.context import build_setup
from tests import envs_fixtures
from tests.tiny import ROOT, TINY_MODEL

AGENT_QUICKSTART = os.path.join(ROOT, "configs", "agent_quickstart.py")
TINY = TINY_MODEL + [
    "env.max_turns=2", "env.max_total_tokens=24", "env.max_turn_tokens=3",
    "env.max_obs_tokens=12", "env.n_train=16", "env.n_eval=4", "data.eval_size=4",
    "sft.steps=0", "train.steps=1", "train.batch_groups=4", "rollout.n=4",
    "rollout.temperature=1.0", "train.eval_every=0", "train.checkpoint_every=0",
    "log.tensorboard=False"]
PINNED_ID = 1678995450  # agent_stage.state_id(("pos", "x", 3))

# the user's task, in a file outside rl_jax: "count" (any answer, ``kwargs.turns`` turns,
# reward 1 for a turn holding a digit) whose state is the number of turns taken, so every
# trajectory reaches the state of turn u by its own action history
MY_ENV = '''
from rl_jax.envs import EnvSpec, Message, StepResult


class Count:
  tools = ()

  def __init__(self, turns):
    self.turns, self.taken = turns, 0

  def state_key(self):
    return ("turn", self.taken)

  def reset(self, example, seed):
    self.taken = 0
    return [Message("user", "go")]

  def step(self, action):
    self.taken += 1
    done = self.taken >= self.turns
    reward = float(any(c.isdigit() for c in action))
    return StepResult(() if done else (Message("user", "ok"),), reward, done,
                      state_key=("turn", self.taken))


def make(config):
  train = [{"id": i} for i in range(config.n_train)]
  return EnvSpec("count", lambda ex: Count(config.kwargs.turns), train, train[:4])


def raises(config):
  raise ValueError("boom")


def reads_a_missing_setting(config):
  return config.kwargs.max_n


def wrong_type(config):
  return {"train": []}


def empty(config):
  return EnvSpec("empty", lambda ex: Count(1))


def bad_reset(config):
  class Broken(Count):
    def reset(self, example, seed):
      raise KeyError("seed")
  return EnvSpec("broken", lambda ex: Broken(1), [{"id": 0}])


def text_reset(config):
  class Texting(Count):
    def reset(self, example, seed):
      return "go"
  return EnvSpec("text_reset", lambda ex: Texting(1), [{"id": 0}])


def bad_key(config):
  class Keyed(Count):
    def state_key(self):
      return ["a", "list"]
  return EnvSpec("bad_key", lambda ex: Keyed(1), [{"id": 0}])


def not_a_taskset(config):
  return ["what is 1+1?"]


def tasks(config):
  import verifiers.v1 as vf

  class QAData(vf.TaskData):
    answer: str

  class QATask(vf.Task[QAData, vf.State, vf.TaskConfig]):

    @vf.reward
    async def exact(self, task, trace) -> float:
      return float(trace.last_reply == task.answer)

  class QATaskset(vf.Taskset[QATask, vf.TasksetConfig]):

    def load(self):
      for q, a in (("What is 12*34?", "408"), ("What is 7*8?", "56")):
        yield QATask(QAData(prompt=q, answer=a))

  return QATaskset(vf.TasksetConfig())
'''
RUN_CONFIG = f'''
from rl_jax import config_utils


def get_config(arg=None):
  config = config_utils.load_config_file({AGENT_QUICKSTART!r}, "guess")
  config.env.name = "my_env:make"
  return config
'''


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
  """A directory outside rl_jax holding my_env.py, a broken module and run.py (a config that
  selects ``env.name=my_env:make``); the modules it adds to sys.modules are dropped after."""
  d = tmp_path_factory.mktemp("user")
  (d / "my_env.py").write_text(MY_ENV)
  (d / "broken_env.py").write_text("import math\nx = 1 / 0\n")
  (d / "run.py").write_text(RUN_CONFIG)
  before = set(sys.modules)
  yield d
  for name in set(sys.modules) - before:
    if name in ("my_env", "broken_env"):
      del sys.modules[name]


def _config(user_dir, overrides=()):
  """run.py (found beside it: my_env) with the tiny settings, ``env.kwargs.turns=2`` a new key
  from the command line."""
  return config_utils.load_config(str(user_dir / "run.py"),
                                  TINY + ["env.kwargs.turns=2"] + list(overrides))


def test_a_task_from_a_file_beside_the_config_trains(user_dir, tmp_path, monkeypatch):
  """``env.name=my_env:make`` trains with GiGPO; the per-turn state ids are the keys the
  environment reported: within a group, turn 1 of every sample is one step group although
  the samples reached it by different actions (their token histories differ)."""
  seen = []
  turn_fields = agent_stage.turn_fields

  def spy(out, U, R):
    fields = turn_fields(out, U, R)
    seen.append((out, fields))
    return fields

  monkeypatch.setattr(agent_stage, "turn_fields", spy)
  config = _config(user_dir, ["loss.advantage=gigpo"])
  assert config.env.kwargs.turns == 2
  train.train(config, str(tmp_path), progress=False)
  rows = [r for r in metrics.read_jsonl(str(tmp_path / "metrics.jsonl")) if r["phase"] == "rl"]
  assert len(rows) == 1 and all(np.isfinite(r["loss"]) for r in rows)
  assert all(1.0 <= r["turns_mean"] <= 2.0 for r in rows)
  assert len(seen) == 1
  out, fields = seen[0]
  assert isinstance(out, agent_stage.KeyedRollout)
  states, M = fields["turn_states"], 4
  two = out.num_turns == 2
  assert two.any()
  assert (states[:, 0] == agent_stage.state_id(("turn", 0))).all()
  assert (states[two, 1] == agent_stage.state_id(("turn", 1))).all()
  assert (states[~two, 1] == -1).all()
  # different paths: in some group two samples that reach turn 1 sampled different turn-0 ids
  first = [tuple(out.tokens[b][out.model_mask[b] & (out.turn[b] == 0)]) for b in range(len(two))]
  assert any(len({first[b] for b in range(g * M, g * M + M) if two[b]}) > 1
             for g in range(len(two) // M))


def test_gymnasium_by_id(user_dir, tmp_path):
  """``env.gym_id=FrozenLake-v1`` (no env.name: it becomes "gymnasium") builds the
  adapter's task with episode seeds as examples and plays a rollout; every first turn starts
  from the state "at 0"."""
  del user_dir
  config = config_utils.load_config(AGENT_QUICKSTART, TINY + [
      "env.name=", "env.gym_id=FrozenLake-v1", "env.kwargs.is_slippery=False",
      "env.system_prompt="])
  s = build_setup(config)
  assert s.env.name == "gymnasium" and s.task.name == "gymnasium:FrozenLake-v1"
  assert [e.data for e in s.train_examples[:2]] == [{"seed": 0}, {"seed": 1}]
  assert s.eval_examples[0].data == {"seed": 16}
  tr = loop.make_trainer(s)
  try:
    st = state_lib.init_state(s)
    scored, _ = producer.produce(tr, tr.layout.sampler_params(st.params), st.producer, step=0,
                                 version=0, lo=0, hi=s.geometry.groups)
  finally:
    for e in tr.agent:
      e.close()
  assert (scored.turns["turn_states"][:, 0] == agent_stage.state_id("at 0")).all()
  assert np.isfinite(scored.rewards).all()


def test_verifiers_taskset_by_import_path(user_dir):
  """``env.verifiers=my_env:tasks`` reaches the verifiers adapter: with a checkpoint's chat
  template its examples render; with the char tokenizer's built-in format, one line."""
  config = _config(user_dir, ["env.name=", "env.verifiers=my_env:tasks"])
  config_lib.validate(config)
  assert config.env.name == "verifiers"
  model_dir = envs_fixtures.write_checkpoint(user_dir / "ckpt", "qwen3_tools")
  from rl_jax.data.tokenizers import HFTokenizer  # pylint: disable=import-outside-toplevel
  from rl_jax.envs.chat import ChatFormat  # pylint: disable=import-outside-toplevel
  fmt = ChatFormat.from_pretrained(str(model_dir), HFTokenizer(str(model_dir)), with_tools=True)
  spec = agent_stage.env_task(settings.from_section(settings.EnvSettings, "env", config.env),
                              settings.from_section(settings.DataSettings, "data", config.data),
                              config.sft.steps, fmt)
  assert spec.name == "verifiers:my_env:tasks" and len(spec.train) == 2
  examples = agent_stage.env_examples(spec, spec.train, fmt)
  assert "What is 12*34?" in examples[0].prompt
  env, _ = spec.start(spec.train[1])
  assert env.step("56").reward == 1.0
  with pytest.raises(ConfigError) as e:
    build_setup(_config(user_dir, ["env.name=", "env.verifiers=my_env:tasks"]))
  assert "chat template" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides,needle", [
    (["env.name=my_env"], "config.env.name must be"),
    (["env.name=my_env.make"], "config.env.name must be"),
    (["env.name=no_such_module_xyz:make"], "no module named 'no_such_module_xyz'"),
    (["env.name=my_env:missing"], "module 'my_env' ("),
    (["env.name=my_env:raises"], "env.name='my_env:raises': calling raises raised "
                                 "ValueError: boom"),
    (["env.name=my_env:reads_a_missing_setting"], "raised AttributeError: \"'max_n'\" (no env "
     "setting or env.kwargs key 'max_n': the user's own settings go in env.kwargs, e.g. "
     "--config.env.kwargs.max_n=VALUE)"),
    (["env.name=my_env:wrong_type"], "returned a dict, not an rl_jax.envs.EnvSpec"),
    (["env.name=my_env:empty"], "has no train examples"),
    (["env.name=my_env:bad_reset"], "starting its first train example raised KeyError"),
    (["env.name=my_env:text_reset"], "starting its first train example raised TypeError: "
                                     "reset returned a str, not a list of Message"),
    (["env.name=my_env:bad_key"], "state key ['a', 'list'] is a list"),
    (["env.name=broken_env:make"], "importing 'broken_env'"),
    (["sft.steps=2"], "has no expert trajectories"),
    (["env.gym_id=NoSuchGame-v0"], "names another; set env.name='gymnasium'"),
    (["env.name=", "env.gym_id=NoSuchGame-v0"], "gymnasium.make failed"),
    (["env.name=gymnasium"], "env.name='gymnasium' needs env.gym_id"),
    (["env.name=", "env.gym_id=FrozenLake-v1", "env.verifiers=my_env:tasks"], "set one"),
    (["env.name=", "env.verifiers=my_env:not_a_taskset"],
     "returned a list as the train taskset, not a verifiers.v1.Taskset"),
    (["env.name=", "env.verifiers=my_env"], "config.env.verifiers must be an import path"),
])
def test_bad_tasks_fail_in_one_line(user_dir, overrides, needle):
  with pytest.raises(ConfigError) as e:
    build_setup(_config(user_dir, overrides))
  assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_cli_error_line_names_the_path(user_dir, tmp_path):
  """The trainer CLI, run from another directory, finds my_env beside the config file and
  prints the factory's failure as one ``error:`` line (exit 2), nothing compiled."""
  cmd = [sys.executable, "-m", "rl_jax.train", f"--config={user_dir / 'run.py'}",
         f"--workdir={tmp_path / 'w'}", "--config.env.name=my_env:raises"]
  proc = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert lines[-1] == ("error: env.name='my_env:raises': calling raises raised "
                       "ValueError: boom"), proc.stderr


def test_resolver_search_order(tmp_path, monkeypatch):
  """Modules on sys.path first, then the config files' directories, then the working
  directory; sys.path is never changed."""
  monkeypatch.setattr(imports, "_config_dirs", [])
  (tmp_path / "cwd_only_mod_t.py").write_text("def f():\n  return 'cwd'\n")
  path = list(sys.path)
  with pytest.raises(ConfigError, match="no module named 'cwd_only_mod_t'"):
    imports.resolve("cwd_only_mod_t:f", "agent")
  monkeypatch.chdir(tmp_path)
  try:
    assert imports.resolve("cwd_only_mod_t:f", "agent")() == "cwd"
    assert imports.resolve("os.path:join", "x") is os.path.join
    with pytest.raises(ConfigError, match="not a callable"):
      imports.resolve("os:sep", "x")
    assert imports.resolve("os:sep", "x", need_callable=False) == os.sep
  finally:
    sys.modules.pop("cwd_only_mod_t", None)
  assert sys.path == path


# -- state keys: the anchor states of GiGPO --

class Walk:
  """A walk on the integers: "a" moves +1, "b" +2, reward 1 on reaching 4; the state is the
  position. The paths "b, a" and "a, b" reach position 3 by different action histories."""

  tools = ()

  def reset(self, example, seed):
    self.pos = 0
    return [Message("user", "walk")]

  def step(self, action):
    self.pos += {"a": 1, "b": 2}[action]
    return StepResult((Message("user", "ok"),), float(self.pos == 4), False,
                      state_key=("pos", self.pos))


def test_state_keys_join_different_paths_in_one_step_group():
  """Two trajectories reach position 3 by "b, a" and "a, b": with the keys their environments
  report, the turns that start there share a step group, so GiGPO's step-level advantage
  compares their returns (1 after "a", 0 after "b"); without keys (history hashes) every
  later turn is a step group of its own and gets no step-level advantage."""
  G, M, U, R, seed = 1, 2, 3, 8, 7
  keys = agent_stage.StateKeys()
  paths = (["b", "a", "a"], ["a", "b", "b"])
  rewards = np.zeros((2, U), np.float32)
  for m, actions in enumerate(paths):
    env = keys.wrap(Walk())
    env.reset({}, env_seed(seed, 0, m))
    rewards[m] = [env.step(a).reward for a in actions]
  # the rollout: a token per action (a=5, b=6), an observation token after each
  tokens = np.zeros((2, R), np.int32)
  model = np.zeros((2, R), bool)
  turn = np.full((2, R), -1, np.int32)
  for b, actions in enumerate(paths):
    for u, a in enumerate(actions):
      tokens[b, 2 * u:2 * u + 2] = (5 if a == "a" else 6, 9)
      model[b, 2 * u], turn[b, 2 * u:2 * u + 2] = True, u
  out = AgentRollout(
      tokens=tokens, lengths=np.full(2, 6, np.int32), model_mask=model,
      logprobs=np.zeros((2, R), np.float32), versions=np.zeros((2, R), np.int32), turn=turn,
      turn_rewards=rewards, turn_ends=np.zeros((2, U), np.int32),
      num_turns=np.full(2, 3, np.int32), reward=rewards.sum(1), tool_calls=np.zeros(2, np.int32),
      tool_errors=np.zeros(2, np.int32), timeouts=np.zeros(2, np.int32),
      env_errors=np.zeros(2, np.int32), env_time=np.zeros(2, np.float32),
      truncated_obs=np.zeros(2, bool), truncated_turn=np.zeros(2, bool),
      finish_reason=np.asarray(["max_turns"] * 2), actions=[list(p) for p in paths],
      prompts=[[1, 2]], prompt_index=np.zeros(2, np.int32), group_ids=np.zeros(1, np.int64),
      group_meta=[0], stats={})
  plain = agent_stage.turn_fields(out, U, R)["turn_states"]
  keyed_out = keys.attach(out, seed, U)
  keyed = agent_stage.turn_fields(keyed_out, U, R)["turn_states"]
  assert plain[0, 0] == plain[1, 0] and len(set(plain[:, 1:].ravel())) == 4  # history only
  # positions before turns 1, 2: row 0 at 2 then 3, row 1 at 1 then 3
  assert keyed[0, 2] == keyed[1, 2] == agent_stage.state_id(("pos", 3))
  assert keyed[0, 1] == agent_stage.state_id(("pos", 2)) != keyed[1, 1]
  assert keyed[0, 0] == keyed[1, 0] == plain[0, 0]  # no key for the opening: the history's
  adv = lambda states: np.asarray(losses.step_group_advantages(
      losses.turn_returns(rewards.reshape(G, M, U), 0.95), states.reshape(G, M, U),
      np.ones((G, M, U), bool)))[0]
  assert (adv(plain)[:, 1:] == 0).all()
  np.testing.assert_allclose(adv(keyed)[:, 2], [2 ** -0.5, -2 ** -0.5], rtol=1e-4)
  # end to end: GiGPO's token advantages differ on the turn that starts at the shared state
  inputs = dict(rewards=rewards.sum(1).reshape(G, M), turn_rewards=rewards.reshape(G, M, U),
                turn_ids=turn.reshape(G, M, R), mask=model.reshape(G, M, R))
  plain_adv = losses.gigpo_advantages(turn_states=plain.reshape(G, M, U), **inputs)
  keyed_adv = losses.gigpo_advantages(turn_states=keyed.reshape(G, M, U), **inputs)
  assert np.asarray(keyed_adv)[0, 0, 4] > np.asarray(plain_adv)[0, 0, 4]  # row 0, turn 2


def test_state_id_is_stable_and_typed():
  assert agent_stage.state_id(1) == agent_stage.state_id(1.0) == agent_stage.state_id(True)
  assert agent_stage.state_id(np.int64(3)) == agent_stage.state_id(3)
  assert agent_stage.state_id("3") != agent_stage.state_id(3)
  assert agent_stage.state_id(("a", (1, None))) != agent_stage.state_id(("a", 1, None))
  assert agent_stage.state_id(frozenset({1, 2})) == agent_stage.state_id(frozenset({2, 1}))
  assert 0 <= agent_stage.state_id(("pos", 3)) < 2 ** 31
  # pinned: the same in every process and run (Python's hash of a str is salted per process)
  assert agent_stage.state_id(("pos", "x", 3)) == PINNED_ID
  with pytest.raises(TypeError, match="is a dict"):
    agent_stage.state_id({"a": 1})
