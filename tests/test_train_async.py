"""The asynchronous trainer (``train.mode="async"``, rl_jax.train.runner).

Fixed lag 0 is the synchronous trainer exactly; lag k trains on batches k versions old (and
no older); the free-running producer never exceeds the staleness bound; a fixed-lag run
killed with a full queue and held partial rollouts resumes bit-exactly.
"""

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from rl_jax import checkpoint
from rl_jax import config as config_lib
from rl_jax import config_utils
from rl_jax import metrics
from rl_jax import train
from rl_jax.errors import ConfigError
from rl_jax.train import learner, producer
from rl_jax.train import queue as queue_lib
from tests.tiny import QUICKSTART, ROOT, TINY_MODEL, assert_prompts_as_sampled

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


LAG_ONE = ["train.mode=async", "train.async_lag=1"]


@pytest.fixture(scope="module")
def lag_one_run(tmp_path_factory):
  """(RL metrics rows, exported weights) of the tiny run on one device with fixed lag 1."""
  return _run(tmp_path_factory.mktemp("lag1"), LAG_ONE)


def test_lag_zero_is_the_sync_trainer_and_lag_one_is_one_version_old(tmp_path, lag_one_run):
  sync_rows, sync_w = _run(tmp_path / "sync")
  lag0_rows, lag0_w = _run(tmp_path / "lag0", ["train.mode=async", "train.async_lag=0"])
  _same_weights(sync_w, lag0_w)
  keys = ("reward_mean", "loss", "grad_norm", "response_length")
  assert [[r[k] for k in keys] for r in lag0_rows] == [[r[k] for k in keys] for r in sync_rows]
  assert all(r["max_token_lag"] == 0 for r in lag0_rows)

  lag1_rows, lag1_w = lag_one_run
  # the first RL step trains on the weights RL starts from; every later one on the weights
  # one step older, so the behaviour log-probs differ from the proximal ones
  assert lag1_rows[0]["max_token_lag"] == 0
  assert all(r["max_token_lag"] == 1 and r["mean_token_lag"] == 1 for r in lag1_rows[1:])
  assert all(r["mismatch_max"] > 1e-4 for r in lag1_rows[1:])
  assert all(r["mismatch_max"] < 1e-4 for r in lag0_rows)
  assert any(not np.array_equal(lag1_w[k], sync_w[k]) for k in sync_w)
  # (that thread timing plays no part is shown by the SIGKILL test below: a resumed run
  # equals an uninterrupted one)


def test_free_running_producer_respects_the_staleness_bound(tmp_path):
  rows, _ = _run(tmp_path, ["train.mode=async", "train.async_lag=-1",
                            "rollout.max_staleness=2", "loss.preset=decoupled_ppo",
                            "train.steps=6"])
  assert len(rows) == 6
  assert all(r["max_token_lag"] <= 2 for r in rows)
  assert all(0 <= r["queue_depth"] <= 2 and r["learner_idle_s"] >= 0 for r in rows)


def test_fixed_lag_resume_after_sigkill_is_bit_exact(tmp_path):
  """Killed right after a checkpoint with k batches queued and partial rollouts held by the
  engine; the rerun of the same command finishes with the uninterrupted run's weights."""
  over = ["train.mode=async", "train.async_lag=2", "loss.preset=decoupled_ppo",
          "rollout.partial=True", "rollout.max_staleness=3", "rollout.max_new_tokens=12",
          "train.steps=5", "train.keep=10"]
  ref = tmp_path / "ref"
  ref_rows, ref_w = _run(ref, over)
  setup = train.build_setup(_config(over))
  target = train.abstract_state(setup)
  assert target.rollout_queue["tokens"].shape[0] == 2

  def held(directory, step):  # the restore target of a step has that step's parts
    saved, _ = checkpoint.restore(str(directory / "checkpoints"),
                                  train.abstract_state(setup, step), step=step)
    return int(saved.rollout_queue["count"]), bool(np.asarray(
        saved.producer.held["valid"]).any())

  # the first RL checkpoint (before the last step) with a full queue and held groups
  kill_at = next(s for s in range(3, 7) if held(ref, s) == (2, True))
  killed = tmp_path / "killed"
  cmd = [sys.executable, "-m", "rl_jax.train", f"--config={QUICKSTART}", f"--workdir={killed}"]
  cmd += [f"--config.{o}" for o in list(TINY) + over]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ckpts = str(killed / "checkpoints")
  deadline = time.time() + 600
  while time.time() < deadline and proc.poll() is None:
    if os.path.isdir(ckpts) and kill_at in checkpoint.all_steps(ckpts):
      break
    time.sleep(0.02)
  proc.kill()
  proc.wait()
  assert not (killed / "hf").exists(), "run finished before the kill"
  for step in checkpoint.all_steps(ckpts):  # as if killed just after saving step kill_at
    if step > kill_at:
      shutil.rmtree(os.path.join(ckpts, str(step)))
  assert held(killed, kill_at) == (2, True)
  rows, w = _run(killed, over)  # the same command resumes
  _same_weights(ref_w, w)
  assert [r["reward_mean"] for r in rows] == [r["reward_mean"] for r in ref_rows]
  path = str(killed / "metrics.jsonl")
  assert [r["step"] for r in metrics.read_jsonl(path)] == list(range(1, 8))


@pytest.mark.parametrize("sampler", [[], ["mesh.sampler_tensor=2"]],
                         ids=["fsdp", "tensor-parallel-sampler"])
def test_split_rollout_and_training_meshes_match_one_device(tmp_path, lag_one_run, sampler):
  """Producer on 4 devices (FSDP, or fsdp 2 x tensor 2: ``mesh.sampler_tensor``), learner
  FSDP over the other 4 == everything on one device (the same lag-1 run as
  ``lag_one_run``, whose exported weights it is compared with)."""
  split = train.train(_config(LAG_ONE + ["mesh.num_devices=0", "mesh.rollout_devices=4"]
                              + sampler), str(tmp_path), progress=False)
  devices = split.params["layers"]["q"].sharding.device_set
  assert len(devices) == 4 and min(d.id for d in devices) >= 4  # the training half
  one_w, split_w = lag_one_run[1], _weights(tmp_path)
  assert one_w.keys() == split_w.keys()
  for k in one_w:
    np.testing.assert_allclose(split_w[k], one_w[k], atol=2e-5, rtol=1e-4, err_msg=k)


def test_queue_round_trips_through_arrays():
  config = _config(["train.mode=async", "train.async_lag=2"])
  rng = np.random.default_rng(0)
  G, M, R, P = 4, 4, 5, config.data.max_prompt_len
  empty = queue_lib.empty_queue(config_lib.schedule(config).queue, config_lib.geometry(config), P)
  item = dict(indices=rng.integers(0, 9, G).astype(np.int32),
              prompts=rng.integers(0, 9, (G, P)).astype(np.int32),
              prompt_lens=rng.integers(1, P + 1, G).astype(np.int32),
              tokens=rng.integers(0, 9, (G * M, R)).astype(np.int32),
              mask=rng.random((G * M, R)) < 0.5, logprobs=rng.random((G * M, R), np.float32),
              versions=rng.integers(0, 3, (G * M, R)).astype(np.int32),
              rewards=rng.random((G, M), np.float32), faults=np.asarray([1, 2], np.int32),
              rollout_s=0.5, version=7, stats={"aborted_groups": 3.0})
  from types import SimpleNamespace  # pylint: disable=import-outside-toplevel
  arrays = queue_lib.to_arrays(empty, [SimpleNamespace(**item)])
  (back,) = queue_lib.from_arrays(arrays)
  for k, v in item.items():
    np.testing.assert_array_equal(back[k] if k != "stats" else back[k]["aborted_groups"],
                                  v if k != "stats" else 3.0, err_msg=k)
  with pytest.raises(ValueError):
    queue_lib.to_arrays(empty, [SimpleNamespace(**item)] * 3)


def test_produced_batches_carry_the_prompts_they_were_sampled_from():
  """A produced ``Scored`` holds its groups' prompt ids as sampled, right-padded to P:
  exactly the padded encoding of its examples, which the checkpointed queue keeps and the
  learner packs as they are (it never tokenizes a prompt again)."""
  s = train.build_setup(_config(["train.mode=async", "train.async_lag=1"]))
  t = train.make_trainer(s)
  st = train.init_state(s)
  lo, hi = t.layout.share(s.geometry.rows)
  scored, _ = producer.produce(t, t.layout.sampler_params(st.params), st.producer, step=0,
                               version=0, lo=lo, hi=hi)
  assert scored.prompts.shape == (hi - lo, s.prompt_len)
  assert_prompts_as_sampled(s, scored)
  assert (scored.prompt_lens < s.prompt_len).all()  # each right-padded
  (back,) = queue_lib.from_arrays(queue_lib.to_arrays(queue_lib.setup_queue(s), [scored]))
  for k in ("prompts", "prompt_lens"):
    np.testing.assert_array_equal(back[k], getattr(scored, k), err_msg=k)
  batch, _ = learner.learner_batch(t, st, train.Scored(**back))
  np.testing.assert_array_equal(np.asarray(batch.prompt_tokens), scored.prompts)
  np.testing.assert_array_equal(np.asarray(batch.prompt_lengths), scored.prompt_lens)


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


def test_quickstart_trains_asynchronously(tmp_path):
  """The quickstart with ``train.mode=async`` (one-step-off) learns: 100 of its 250 RL steps
  (constant learning rate, so the same trajectory) raise the training reward and take
  held-out accuracy from the warm start's 0.45 past 0.8 (0.95 at the end of the full run,
  README); the learning curves are plotted."""
  config = config_utils.load_config(QUICKSTART, [
      "train.mode=async", "train.steps=100", "train.eval_every=200", "eval.pass_k=0",
      "train.checkpoint_every=0", "log.tensorboard=False", "mesh.num_devices=1"])
  train.train(config, str(tmp_path), progress=False)
  rows = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
  assert len(evals) == 2 and evals[0] < 0.5 and evals[1] >= 0.8, evals
  rl = [r["reward_mean"] for r in rows if r["phase"] == "rl"]
  assert len(rl) == 100 and np.mean(rl[-8:]) > np.mean(rl[:8]) + 0.2, (rl[:8], rl[-8:])
  assert max(r.get("max_token_lag", 0) for r in rows) == 1
  assert os.path.exists(tmp_path / "curves.png")
