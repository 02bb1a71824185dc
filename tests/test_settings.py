"""Typed settings (``rl_jax.settings``): a config section's one home for its fields, defaults,
checks, docs and rules, built once by the setup and read below it instead of the config."""

import dataclasses
import functools
import pathlib
import re
import tokenize

import pytest

from rl_jax import config as config_lib
from rl_jax import config_utils, settings
from rl_jax.errors import ConfigError
from rl_jax.settings import RolloutSettings
from tests.tiny import QUICKSTART

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("section,cls", sorted(settings.SECTIONS.items()))
def test_a_section_is_built_from_its_settings_defaults(section, cls):
  config = config_lib.base_config()[section]
  fields = {f.name: f for f in dataclasses.fields(cls)}
  assert set(config.keys()) == set(fields)
  assert settings.from_section(cls, section, config) == cls()
  for name, f in fields.items():
    assert f.metadata["doc"], name  # every field says what it means
    if f.default is None:  # the command line needs the type of a field without a value
      assert f.metadata["kind"] in (int, float, str, bool), name


def test_none_defaults_parse_with_their_kind():
  # a None default is typed on the command line, the others keep their value's type
  c = config_utils.load_config(QUICKSTART, ["rollout.kv_pages=64", "rollout.top_p=0.5",
                                            "optim.value_lr=3e-4", "log.wandb_name=run1"])
  assert c.rollout.kv_pages == 64 and c.rollout.top_p == 0.5
  assert c.optim.value_lr == 3e-4 and c.log.wandb_name == "run1"
  c = config_utils.load_config(QUICKSTART, ["env.enable_thinking=False", "data.selector=none",
                                            "distributed.num_processes=2"])
  assert c.env.enable_thinking is False and c.distributed.num_processes == 2
  assert c.data.selector is None  # a default with a kind may be set to None ...
  assert settings.from_section(settings.DataSettings, "data", c.data).selector == "none"


@pytest.mark.parametrize("override,words", [
    ("rollout.n=0", "config.rollout.n must be a positive int, got 0"),
    ("rollout.top_p=1.5", "config.rollout.top_p"),
    ("rollout.page_size=48", "config.rollout.page_size"),
    ("rollout.kv_memory_fraction=1.5", "config.rollout.kv_memory_fraction"),
    ("rollout.max_staleness=-2", "config.rollout.max_staleness"),
])
def test_a_bad_rollout_value_is_one_line_from_validate_and_from_the_settings(override, words):
  c = config_utils.load_config(QUICKSTART, [override])
  with pytest.raises(ConfigError, match=re.escape(words)) as e:
    config_lib.validate(c)
  assert "\n" not in str(e.value)
  with pytest.raises(ConfigError, match=re.escape(words)):
    settings.from_section(RolloutSettings, "rollout", c.rollout)


@pytest.mark.parametrize("values,words", [
    (dict(speculative=True, temperature=0.0), "needs rollout.temperature > 0"),
    (dict(speculative=True, partial=True), "cannot be combined"),
])
def test_rules_between_rollout_fields_live_on_the_settings(values, words):
  with pytest.raises(ConfigError, match=words):
    RolloutSettings(**values)
  c = config_utils.load_config(QUICKSTART, [f"rollout.{k}={v}" for k, v in values.items()])
  with pytest.raises(ConfigError, match=words):
    config_lib.validate(c)


def test_settings_are_frozen_and_an_unknown_key_is_one_line():
  r = RolloutSettings()
  with pytest.raises(dataclasses.FrozenInstanceError):
    r.n = 4  # type: ignore[misc]
  section = config_lib.base_config().rollout
  section.unlock()
  section.nn = 4
  with pytest.raises(ConfigError, match="config.rollout has no field 'nn'"):
    settings.from_section(RolloutSettings, "rollout", section)
  assert RolloutSettings(temperature=0.0).sample_temperature == 1.0  # greedy: plain softmax
  assert RolloutSettings(temperature=0.7).sample_temperature == 0.7


# Files that may read a section with settings from a config: the config modules, the setup
# (train/context.py builds the settings), and the dry run's edits of the config before it
# builds a setup (train/topology.py); besides, per section: the command line's run before it
# has a setup (train/loop.py: the processes joined, the workdir lock), the W&B run that
# records the whole config (wandb_log).
SETUP = {"config.py", "settings.py", "train/context.py", "train/topology.py"}
CONFIG_READERS = {
    "rollout": SETUP,
    "train": SETUP | {"train/loop.py"},
    "sft": SETUP,
    "log": SETUP | {"wandb_log.py"},
    "reward": SETUP,
    "distributed": SETUP | {"train/loop.py"},
    **{name: SETUP for name in ("eval", "distill", "optim", "loss_extra", "data", "env", "mesh",
                                "dry_run", "model")},
}


@functools.cache
def _code(path: pathlib.Path) -> str:
  """The file's names and operators, without strings and comments (an error message or a
  docstring that names ``config.train.x`` reads nothing); read once per file for all the
  sections' cases."""
  out, last = [], None
  with open(path, "rb") as f:
    for t in tokenize.tokenize(f.readline):
      if t.type in (tokenize.NAME, tokenize.OP):
        out.append((" " if t.type == last == tokenize.NAME else "") + t.string)
        last = t.type
  return "".join(out)


@pytest.mark.parametrize("section", sorted(CONFIG_READERS))
def test_below_the_setup_a_section_is_read_from_its_settings(section):
  pattern = re.compile(rf"(?<![\w.])(config|c|cfg)\.{section}\b")
  readers = sorted(str(p.relative_to(ROOT / "rl_jax")) for p in (ROOT / "rl_jax").rglob("*.py")
                   if pattern.search(_code(p)))
  assert set(readers) <= CONFIG_READERS[section], sorted(set(readers) - CONFIG_READERS[section])


# the modules that may import ml_collections: the config modules, the setup, the command
# line's run, the dry run's config edits and the Python API's entry points
ML_COLLECTIONS = {"config.py", "config_checks.py", "config_utils.py", "settings.py", "api.py",
                  "train/context.py", "train/loop.py", "train/topology.py"}


def test_below_the_setup_nothing_imports_ml_collections():
  pattern = re.compile(r"^\s*(import ml_collections|from ml_collections)", re.M)
  importers = {str(p.relative_to(ROOT / "rl_jax")) for p in (ROOT / "rl_jax").rglob("*.py")
               if pattern.search(p.read_text())}
  assert importers <= ML_COLLECTIONS, sorted(importers - ML_COLLECTIONS)


def test_every_section_with_settings_is_checked_here():
  assert set(CONFIG_READERS) == set(settings.SECTIONS)


@pytest.mark.parametrize("section,cls", sorted(settings.SECTIONS.items()))
def test_each_section_is_its_settings_defaults_and_checks(section, cls):
  config = config_lib.base_config()
  assert settings.from_section(cls, section, config[section]) == cls()
  table = config_lib.checks()
  for key, check in settings.section_checks(section, cls).items():
    assert table[key] is check, key  # the config's check table takes the field's own
  assert not [k for k in table if k.startswith(section + ".")
              and k not in settings.section_checks(section, cls)]


def test_train_rules_live_on_its_settings():
  T, R = settings.TrainSettings, settings.ReplaySettings
  with pytest.raises(ConfigError, match="config.train.offload names 'weights'"):
    T(offload="weights,optimizer")
  assert T(offload=" reference,optimizer,reference").offload_parts == ("optimizer", "reference")
  with pytest.raises(ConfigError, match="rounds to 0 replayed groups"):
    T(batch_groups=8, replay=R(capacity=4, fraction=0.01))
  with pytest.raises(ConfigError, match="fewer groups than a step replays"):
    T(batch_groups=32, replay=R(capacity=4, fraction=0.25))
  assert T(batch_groups=10, replay=R(capacity=4, fraction=0.25)).replay_groups == 3  # 2.5 up
  assert T().replay_groups == 0
  c = config_utils.load_config(QUICKSTART, ["train.offload=weights"])
  with pytest.raises(ConfigError, match="'weights'"):
    config_lib.validate(c)


def test_compile_cache_default_is_read_when_a_config_is_built(monkeypatch):
  monkeypatch.setenv("RL_JAX_COMPILE_CACHE", "/tmp/shared_cache")
  assert config_lib.base_config().train.compile_cache == "/tmp/shared_cache"
  assert settings.TrainSettings().compile_cache == "/tmp/shared_cache"
  monkeypatch.delenv("RL_JAX_COMPILE_CACHE")
  assert config_lib.base_config().train.compile_cache == "compile_cache"


def test_the_setup_holds_settings_not_the_config():
  """``build_setup`` turns each section into its settings once; the setup keeps no config,
  and ``dataclasses.replace`` on a section derives the geometry, schedule and selection
  again."""
  from rl_jax.train import context  # pylint: disable=import-outside-toplevel
  c = config_utils.load_config(QUICKSTART, ["sft.steps=0"])
  s = context.build_setup(c)
  assert "config" not in {f.name for f in dataclasses.fields(s)}
  for name in settings.SETUP_SECTIONS:
    cls = settings.SECTIONS[name]
    assert getattr(s, name) == settings.from_section(cls, name, c[name]), name
  s2 = dataclasses.replace(s, rollout=dataclasses.replace(s.rollout, n=2, max_new_tokens=5),
                           data=dataclasses.replace(s.data, overlong_buffer=2))
  assert (s2.geometry.samples, s2.geometry.new_tokens) == (2, 5)
  assert (s.geometry.samples, s.geometry.new_tokens) == (c.rollout.n, c.rollout.max_new_tokens)
  assert s2.selection.overlong == 2 and s.selection.overlong == 0
  s3 = dataclasses.replace(s, train=dataclasses.replace(s.train, mode="async", async_lag=2))
  assert s3.schedule == config_lib.Schedule(2, 2, True) and s.schedule.lag == 0


def test_reward_rules_live_on_its_settings():
  from rl_jax.data import group_rewards  # pylint: disable=import-outside-toplevel
  assert set(settings.GROUP_FNS) == set(group_rewards.GROUP_FNS)
  R = settings.RewardSettings
  with pytest.raises(ConfigError, match="needs reward.judge_template"):
    R(judge_path="/judge")
  with pytest.raises(ConfigError, match="needs reward.judge_path"):
    R(judge_template="judge.jinja")
  with pytest.raises(ConfigError, match="cannot be combined"):
    R(judge_path="/judge", judge_template="judge.jinja", group_fn="majority_vote")
  c = config_utils.load_config(QUICKSTART, ["reward.group_fn=not an import path"])
  with pytest.raises(ConfigError, match="config.reward.group_fn must be ''"):
    config_lib.validate(c)


def test_env_data_and_mesh_rules_live_on_their_settings():
  E = settings.EnvSettings
  with pytest.raises(ConfigError, match="env.agent='m:play' plays the episodes of a task"):
    E(agent="m:play")
  with pytest.raises(ConfigError, match="env.digits_min=4 exceeds env.digits_max=3"):
    E(name="calculator", digits_min=4, digits_max=3)
  assert E(digits_min=4, digits_max=3).digits_min == 4  # single-turn: not read, not checked
  with pytest.raises(ConfigError, match="env.max_turn_tokens=64 exceeds"):
    E(name="guess", max_turn_tokens=64)
  section = E(name="my_env:make", kwargs={"size": 8}).section()  # what a user's factory gets
  assert section.kwargs.size == 8 and section.get("name") == "my_env:make"
  with pytest.raises(AttributeError):
    section.new_key = 1  # locked against new keys
  assert settings.DataSettings(selector=None).selector == "none"
  c = config_utils.load_config(QUICKSTART, [])
  c.mesh.shape.unlock()
  c.mesh.shape.model = 2
  with pytest.raises(ConfigError) as e:
    config_lib.validate(c)
  assert str(e.value).startswith("config.mesh.shape must name the axes") and "\n" not in str(e.value)
  c = config_utils.load_config(QUICKSTART, ["env.name=calculator", "env.digits_min=5"])
  with pytest.raises(ConfigError, match="env.digits_min=5 exceeds"):
    config_lib.validate(c)
