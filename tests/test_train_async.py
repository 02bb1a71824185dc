"""The asynchronous trainer (``train.mode="async"``, rl_jax.train.pipeline).

Fixed lag 0 is the synchronous trainer exactly; lag k trains on batches k versions old (and
no older); the free-running producer never exceeds the staleness bound; a fixed-lag run
killed with a full queue and held partial rollouts resumes bit-exactly.
"""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from rl_jax import config_utils
from rl_jax import metrics
from rl_jax import train
from rl_jax.errors import ConfigError
from rl_jax.train import queue as queue_lib
from tests.tiny import QUICKSTART, ROOT, TINY_MODEL

# Tiny runs whose loss moves every step whatever the rewards (an entropy bonus), so equal
# weights mean equal updates, not zero gradients.
TINY = TINY_MODEL + ["mesh.num_devices=1",
    "sft.steps=2", "sft.batch_size=8", "train.steps=4", "train.batch_groups=4",
    "rollout.n=4", "train.eval_every=0", "train.checkpoint_every=1", "log.tensorboard=False",
    "loss.entropy_coef=0.01", "rollout.temperature=1.0",
]


def _config(overrides=()):
  return config_utils.load_config(QUICKSTART, list(TINY) + list(overrides))


def _run(path, overrides=()):
  train.train(_config(overrides), str(path), progress=False)
  rows = [r for r in metrics.read_jsonl(str(path / "metrics.jsonl")) if r["phase"] == "rl"]
  return rows, _weights(path)


def _weights(path):
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  return load_file(str(path / "hf" / "model.safetensors"))


def _same_weights(a, b):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_lag_zero_is_the_sync_trainer_and_lag_one_is_one_version_old(tmp_path):
  sync_rows, sync_w = _run(tmp_path / "sync")
  lag0_rows, lag0_w = _run(tmp_path / "lag0", ["train.mode=async", "train.async_lag=0"])
  _same_weights(sync_w, lag0_w)
  keys = ("reward_mean", "loss", "grad_norm", "response_length")
  assert [[r[k] for k in keys] for r in lag0_rows] == [[r[k] for k in keys] for r in sync_rows]
  assert all(r["max_token_lag"] == 0 for r in lag0_rows)

  lag1_rows, lag1_w = _run(tmp_path / "lag1", ["train.mode=async", "train.async_lag=1"])
  # the first RL step trains on the weights RL starts from; every later one on the weights
  # one step older, so the behaviour log-probs differ from the proximal ones
  assert lag1_rows[0]["max_token_lag"] == 0
  assert all(r["max_token_lag"] == 1 and r["mean_token_lag"] == 1 for r in lag1_rows[1:])
  assert all(r["mismatch_max"] > 1e-4 for r in lag1_rows[1:])
  assert all(r["mismatch_max"] < 1e-4 for r in lag0_rows)
  assert any(not np.array_equal(lag1_w[k], sync_w[k]) for k in sync_w)
  # reproducible: thread timing plays no part
  again_rows, again_w = _run(tmp_path / "lag1b", ["train.mode=async", "train.async_lag=1"])
  _same_weights(lag1_w, again_w)
  assert [r["reward_mean"] for r in again_rows] == [r["reward_mean"] for r in lag1_rows]


def test_free_running_producer_respects_the_staleness_bound(tmp_path):
  rows, _ = _run(tmp_path, ["train.mode=async", "train.async_lag=-1",
                            "rollout.max_staleness=2", "loss.preset=decoupled_ppo",
                            "train.steps=6"])
  assert len(rows) == 6
  assert all(r["max_token_lag"] <= 2 for r in rows)
  assert all(0 <= r["queue_depth"] <= 2 and r["learner_idle_s"] >= 0 for r in rows)


def test_fixed_lag_resume_after_sigkill_is_bit_exact(tmp_path):
  """Killed with k batches queued and partial rollouts held by the engine."""
  over = ["train.mode=async", "train.async_lag=2", "loss.preset=decoupled_ppo",
          "rollout.partial=True", "rollout.max_staleness=3", "train.steps=5"]
  ref = tmp_path / "ref"
  ref_rows, ref_w = _run(ref, over)
  state = train.abstract_state(train.build_setup(_config(over)))
  assert state.rollout_queue["tokens"].shape[0] == 2
  killed = tmp_path / "killed"
  cmd = [sys.executable, "-m", "rl_jax.train", f"--config={QUICKSTART}", f"--workdir={killed}"]
  cmd += [f"--config.{o}" for o in list(TINY) + over]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  path = str(killed / "metrics.jsonl")
  deadline = time.time() + 600
  while time.time() < deadline and proc.poll() is None:
    if len([r for r in metrics.read_jsonl(path) if r["phase"] == "rl"]) >= 2:
      break
    time.sleep(0.05)
  proc.kill()
  proc.wait()
  assert not (killed / "hf").exists(), "run finished before the kill"
  from rl_jax import checkpoint  # pylint: disable=import-outside-toplevel
  last = max(checkpoint.all_steps(str(killed / "checkpoints")))
  saved, _ = checkpoint.restore(str(killed / "checkpoints"), state, step=last)
  if last > 2:  # an RL checkpoint: the queue and the engine's held groups are not empty
    assert int(saved.rollout_queue["count"]) == 2
    assert np.asarray(saved.rollout_buffer["valid"]).any()
  rows, w = _run(killed, over)  # the same command resumes
  _same_weights(ref_w, w)
  assert [r["reward_mean"] for r in rows] == [r["reward_mean"] for r in ref_rows]
  assert [r["step"] for r in metrics.read_jsonl(path)] == list(range(1, 8))


def test_queue_round_trips_through_arrays():
  config = _config(["train.mode=async", "train.async_lag=2"])
  rng = np.random.default_rng(0)
  G, M, R = 4, 4, 5
  item = dict(indices=rng.integers(0, 9, G).astype(np.int32),
              tokens=rng.integers(0, 9, (G * M, R)).astype(np.int32),
              mask=rng.random((G * M, R)) < 0.5, logprobs=rng.random((G * M, R), np.float32),
              versions=rng.integers(0, 3, (G * M, R)).astype(np.int32),
              rewards=rng.random((G, M), np.float32), faults=np.asarray([1, 2], np.int32),
              rollout_s=0.5, version=7, stats={"aborted_groups": 3.0})
  from types import SimpleNamespace  # pylint: disable=import-outside-toplevel
  arrays = queue_lib.to_arrays(config, [SimpleNamespace(**item)])
  (back,) = queue_lib.from_arrays(arrays)
  for k, v in item.items():
    np.testing.assert_array_equal(back[k] if k != "stats" else back[k]["aborted_groups"],
                                  v if k != "stats" else 3.0, err_msg=k)
  with pytest.raises(ValueError):
    queue_lib.to_arrays(config, [SimpleNamespace(**item)] * 3)


@pytest.mark.parametrize("overrides,message", [
    (["mesh.rollout_devices=1"], "train.mode='async'"),
    (["train.mode=async", "mesh.rollout_devices=64"], "leaves no device"),
    (["train.mode=async", "train.async_lag=-1", "rollout.max_staleness=-1"], "staleness bound"),
    (["train.mode=async", "train.async_lag=3"], "behaviour log-probs"),
    (["train.mode=async", "train.async_lag=-2"], "train.async_lag"),
    (["train.mode=later"], "train.mode"),
])
def test_bad_async_settings_fail_in_one_line(overrides, message):
  with pytest.raises(ConfigError, match=message) as e:
    train.build_setup(_config(overrides))
  assert "\n" not in str(e.value)
