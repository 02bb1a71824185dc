"""Typed settings (``rl_jax.settings``): a config section's one home for its fields, defaults,
checks, docs and rules, built once by the setup and read below it instead of the config."""

import dataclasses
import pathlib
import re

import pytest

from rl_jax import config as config_lib
from rl_jax import config_utils, settings
from rl_jax.errors import ConfigError
from rl_jax.settings import RolloutSettings
from tests.tiny import QUICKSTART

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_rollout_section_is_built_from_the_settings_defaults():
  section = config_lib.base_config().rollout
  fields = {f.name: f for f in dataclasses.fields(RolloutSettings)}
  assert set(section.keys()) == set(fields)
  assert settings.from_section(RolloutSettings, "rollout", section) == RolloutSettings()
  for name, f in fields.items():
    assert f.metadata["doc"], name  # every field says what it means
    if f.default is None:  # the command line needs the type of a field without a value
      assert f.metadata["kind"] in (int, float), name
  # a None default is typed on the command line, the others keep their value's type
  c = config_utils.load_config(QUICKSTART, ["rollout.kv_pages=64", "rollout.top_p=0.5"])
  assert c.rollout.kv_pages == 64 and c.rollout.top_p == 0.5


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


# Files that may read the rollout section from a config: the config modules, the setup
# (train/context.py builds Setup.rollout), the dry run's edit of the config before it builds
# the setup (train/topology.py ``build``, ``_planned``), and two helpers that take the whole config
# because they also read sections without settings yet (selection_stage: data and loss;
# on_policy: train).
CONFIG_READERS = {"config.py", "settings.py", "config_utils.py", "config_checks.py",
                  "train/context.py", "train/topology.py", "train/selection_stage.py",
                  "train/on_policy.py"}


def test_below_the_setup_the_rollout_section_is_read_from_its_settings():
  pattern = re.compile(r"\b(config|c|cfg)\.rollout\b")
  readers = sorted(str(p.relative_to(ROOT / "rl_jax")) for p in (ROOT / "rl_jax").rglob("*.py")
                   if pattern.search(p.read_text()))
  assert set(readers) <= CONFIG_READERS, sorted(set(readers) - CONFIG_READERS)


def test_setup_rebuilds_its_settings_with_its_config():
  """``dataclasses.replace(s, config=...)`` reaches ``Setup.rollout`` (as it reaches the
  geometry and the schedule)."""
  from rl_jax.train import context  # pylint: disable=import-outside-toplevel
  c = config_utils.load_config(QUICKSTART, ["sft.steps=0"])
  s = context.build_setup(c)
  assert s.rollout == settings.from_section(RolloutSettings, "rollout", c.rollout)
  c2 = c.copy_and_resolve_references()
  c2.rollout.temperature = 0.5
  s2 = dataclasses.replace(s, config=c2)
  assert s2.rollout.temperature == 0.5 and s.rollout.temperature == c.rollout.temperature
