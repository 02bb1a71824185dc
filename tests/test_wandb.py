"""Weights & Biases logging is optional: off by default (wandb never imported), a clear
one-line error when it is on and wandb is missing, and what a sink logs (to a stand-in
``wandb`` module, since the service cannot run here)."""

import json
import sys
import types

import pytest

from rl_jax import config_utils, metrics, train, wandb_log
from rl_jax.errors import ConfigError
from tests.tiny import QUICKSTART


def _config(overrides=()):
  return config_utils.load_config(QUICKSTART, list(overrides))


def test_off_by_default_needs_no_wandb(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "wandb", None)  # importing it would fail
  config = _config()
  assert config.log.wandb is False
  wandb_log.check(config)
  assert wandb_log.sinks(config, str(tmp_path)) == []


def test_on_without_wandb_fails_in_one_line_before_compiling(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "wandb", None)
  with pytest.raises(ConfigError, match="log.wandb=True needs the wandb package") as e:
    train.train(_config(["log.wandb=True"]), str(tmp_path / "run"), progress=False)
  assert "\n" not in str(e.value)
  assert not (tmp_path / "run").exists()  # stopped before the run started


class _FakeRun:
  def __init__(self, calls):
    self.calls = calls

  def log(self, values, step):
    self.calls.append(("log", step, values))

  def finish(self):
    self.calls.append(("finish",))


def _fake_wandb(calls):
  module = types.ModuleType("wandb")
  module.util = types.SimpleNamespace(generate_id=lambda: f"id{len(calls)}")
  def init(**kw):
    calls.append(("init", kw))
    return _FakeRun(calls)
  module.init = init
  return module


def test_sink_logs_numeric_metrics_at_their_step_and_resumes_the_run(monkeypatch, tmp_path):
  calls = []
  monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
  config = _config(["log.wandb=True", "log.wandb_name=sorting"])
  for attempt in range(2):  # a second writer on the same workdir (a resume)
    writer = metrics.MetricsWriter(str(tmp_path), tensorboard=False,
                                   sinks=wandb_log.sinks(config, str(tmp_path)))
    writer.write(3 + attempt, {"phase": "rl", "reward_mean": 0.5, "update_skipped": 0})
    writer.close()
  inits = [c[1] for c in calls if c[0] == "init"]
  assert [i["id"] for i in inits] == ["id0", "id0"]  # the same W&B run after a resume
  assert inits[0]["project"] == "rl_jax" and inits[0]["name"] == "sorting"
  assert inits[0]["resume"] == "allow" and inits[0]["config"]["rollout"]["n"] == 8
  logs = [c for c in calls if c[0] == "log"]
  assert logs == [("log", 3, {"reward_mean": 0.5, "update_skipped": 0}),
                  ("log", 4, {"reward_mean": 0.5, "update_skipped": 0})]
  assert sum(c[0] == "finish" for c in calls) == 2
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [3, 4]
