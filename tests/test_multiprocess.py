"""Multi-process training through jax.distributed: 2 processes x 4 CPU devices (gloo) give the
run of 1 process x 8 devices, synchronous (also with a tensor-parallel sampler per process)
and fixed-lag asynchronous with partial rollouts (in the same processes, after the
synchronous run), only process 0 writes files, a rerun
resumes from the collective checkpoint (after a clean finish, and after both processes were
SIGKILLed: bit-exact), and a killed process takes the job down within a bounded time."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from typing import NamedTuple

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from rl_jax import checkpoint, config_utils, metrics, train
from rl_jax.errors import ConfigError
from rl_jax.train import context, runner
from rl_jax.train.records import Scored
from tests.tiny import QUICKSTART, ROOT, TINY_MODEL, env_with_devices

# Tiny, with an entropy bonus so every RL update moves the weights even at zero reward; 16
# held-out prompts, 2 batches of the 8 groups per pass (the quickstart's 256 take 32 batches,
# which were most of the time of the runs on 2 processes).
RUN = TINY_MODEL + [
    "sft.steps=2", "sft.batch_size=8", "train.batch_groups=8", "rollout.n=4",
    "train.eval_every=2", "data.eval_size=16", "train.checkpoint_every=1",
    "loss.entropy_coef=0.01",
]


# Fixed-lag async with partial rollouts (APRIL, 2 engine shares: one per process on 2
# processes, both in the one process of the reference): 4 rollout devices (2 per process),
# the training mesh on the other 4.
ASYNC = ["train.mode=async", "train.async_lag=1", "mesh.rollout_devices=4", "sft.steps=0",
         "train.eval_every=0", "train.checkpoint_every=0", "log.tensorboard=False",
         "rollout.partial=True", "rollout.partial_shares=2"]


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(workdir, overrides, heartbeat_s=30, then=(), logs=None):
  """Start 2 processes of ``python -m rl_jax.train`` with 4 CPU devices each (through
  ``tests.multiprocess_main``: every process loads the programs of earlier launches from the
  session's compilation cache); ``then``: (workdir, overrides) of runs that follow in the
  same processes; ``logs``: each process's stderr goes to ``logs.<i>`` instead of a pipe (for
  a launch that is polled, not read, until it is killed)."""
  port = _free_port()
  env = {**env_with_devices(4), "JAX_PLATFORMS": "cpu"}
  procs = []
  for i in range(2):
    cmd = [sys.executable, "-m", "tests.multiprocess_main"]
    for n, (w, over) in enumerate([(workdir, overrides), *then]):
      cmd += ["--then"] * bool(n) + [f"--config={QUICKSTART}", f"--workdir={w}"] + [
          f"--config.{o}" for o in RUN + over] + [
              f"--config.distributed.coordinator_address=localhost:{port}",
              "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}",
              f"--config.distributed.heartbeat_timeout_s={heartbeat_s}"]
    err = open(f"{logs}.{i}", "w") if logs else subprocess.PIPE  # pylint: disable=R1732
    procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                  stderr=err, text=True))
    if logs:
      err.close()  # the child holds its own copy
  return procs


def _finish(procs, timeout=600):
  outs = [p.communicate(timeout=timeout)[1] for p in procs]
  for p, err in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return outs


def _same_weights(one, two, exact=False):
  a, b = load_file(str(one / "hf" / "model.safetensors")), load_file(
      str(two / "hf" / "model.safetensors"))
  assert a.keys() == b.keys()
  for k in a:
    if exact:
      np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    else:
      np.testing.assert_allclose(b[k], a[k], atol=1e-5, rtol=1e-5, err_msg=k)


def _kill_after_checkpoint(procs, ckpts, step, logs):
  """SIGKILLs every process of a launch once ``step``'s checkpoint is committed in ``ckpts``."""
  deadline = time.time() + 600
  while time.time() < deadline and all(p.poll() is None for p in procs):
    if os.path.isdir(ckpts) and step in checkpoint.all_steps(ckpts):
      break
    time.sleep(0.02)
  for p in procs:
    p.send_signal(signal.SIGKILL)
  for p in procs:
    p.wait()
  with open(f"{logs}.0") as f:
    tail = f.read()[-3000:]
  # killed, not finished (nor failed) before the kill
  assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2, tail
  assert step in checkpoint.all_steps(ckpts), tail


def test_two_processes_equal_one_and_resume(tmp_path):
  one, two = tmp_path / "one", tmp_path / "two"
  one_async, two_async = tmp_path / "one_async", tmp_path / "two_async"
  killed, two_tp = tmp_path / "killed", tmp_path / "two_tp"
  run_async = ASYNC + ["train.steps=3"]
  # the same asynchronous run with a checkpoint at every step, both processes SIGKILLed once
  # the checkpoint of step 2 (a queued batch, both engine shares' held groups) is committed
  run_killed = run_async + ["train.checkpoint_every=1", "train.keep=10"]
  train.train(config_utils.load_config(QUICKSTART, RUN + ["train.steps=2"]), str(one),
              progress=False)
  logs = tmp_path / "stderr"
  # two_tp: each process's sampler on its 4 devices as fsdp 2 x tensor 2 (the per-process
  # copy laid out by the fsdp_tp rules; its held-out evaluation too), training FSDP over 8
  procs = _launch(two, ["train.steps=2"], then=[
      (two_async, run_async), (two_tp, ["train.steps=2", "mesh.sampler_tensor=2"]),
      (killed, run_killed)], logs=logs)
  _kill_after_checkpoint(procs, str(killed / "checkpoints"), 2, logs)
  assert (two_tp / "hf" / "model.safetensors").exists()  # the first three runs finished
  _same_weights(one, two)
  _same_weights(one, two_tp)
  rows_one = metrics.read_jsonl(str(one / "metrics.jsonl"))
  rows_two = metrics.read_jsonl(str(two / "metrics.jsonl"))
  rows_tp = metrics.read_jsonl(str(two_tp / "metrics.jsonl"))
  assert [r.get("eval_accuracy") for r in rows_tp] == [r.get("eval_accuracy") for r in rows_one]
  assert [r["step"] for r in rows_two] == [1, 2, 3, 4]  # written once, by process 0
  # each process sampled and scored its own half of the groups
  assert [r.get("local_groups") for r in rows_one] == [None, None, 8, 8]
  assert [r.get("local_groups") for r in rows_two] == [None, None, 4, 4]
  for r1, r2 in zip(rows_one, rows_two):
    assert r1.keys() == r2.keys()
    for k in ("sft_loss", "loss", "reward_mean", "entropy", "eval_accuracy"):
      if k in r1:
        np.testing.assert_allclose(r2[k], r1[k], rtol=1e-5, atol=1e-6, err_msg=k)
  events = [f for _, _, fs in os.walk(two / "tensorboard") for f in fs]
  assert len(events) == 1, events
  # as if killed just after the commit of step 2 (a later one the kill came too late for)
  ckpts = str(killed / "checkpoints")
  for step in checkpoint.all_steps(ckpts):
    if step > 2:
      shutil.rmtree(os.path.join(ckpts, str(step)))
  assert not (killed / "hf").exists()
  # the checkpoint holds the queued batch of step 3 and both engine shares' held groups
  # (job-wide [2, capacity] arrays)
  setup = train.build_setup(config_utils.load_config(QUICKSTART, RUN + run_killed))
  saved, _ = checkpoint.restore(ckpts, train.abstract_state(setup, 2), step=2)
  valid = np.asarray(saved.producer.held["valid"])
  assert valid.shape == (2, 8) and valid.any(axis=1).all(), valid
  assert int(saved.rollout_queue["count"]) == 1
  # the rerun of the synchronous run with a longer schedule resumes from its collective
  # checkpoint at step 4; the rerun of the killed command from step 2, with the held groups
  # from the checkpoint's job-wide form
  _finish(_launch(two, ["train.steps=3"], then=[(killed, run_killed)]))
  rows = metrics.read_jsonl(str(two / "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
  assert rows[:4] == rows_two
  # killed and resumed == the uninterrupted 2-process run, bit for bit
  _same_weights(two_async, killed, exact=True)
  async_two = metrics.read_jsonl(str(two_async / "metrics.jsonl"))
  rows = metrics.read_jsonl(str(killed / "metrics.jsonl"))
  assert [r["step"] for r in rows] == [r["step"] for r in async_two] == [1, 2, 3]
  for r1, r2 in zip(async_two, rows):
    for k in ("reward_mean", "response_length", "max_token_lag", "mean_token_lag", "loss",
              "grad_norm", "entropy", "local_groups", "held_shares"):
      assert r2.get(k) == r1.get(k), k
  # fixed-lag async with partial rollouts, 2 processes == 1 process of 8 devices
  train.train(config_utils.load_config(QUICKSTART, RUN + run_async), str(one_async),
              progress=False)
  _same_weights(one_async, two_async)
  async_one = metrics.read_jsonl(str(one_async / "metrics.jsonl"))
  assert [r["step"] for r in async_one] == [1, 2, 3]
  assert [r["local_groups"] for r in async_one] == [8, 8, 8]
  assert [r["local_groups"] for r in async_two] == [4, 4, 4]
  # each process ran and held one of the 2 engine shares (the one process both)
  assert [r["held_shares"] for r in async_one] == [2, 2, 2]
  assert [r["held_shares"] for r in async_two] == [1, 1, 1]
  for r1, r2 in zip(async_one, async_two):
    for k in ("reward_mean", "response_length", "max_token_lag", "mean_token_lag"):
      assert r2.get(k) == r1.get(k), k
    for k in ("loss", "grad_norm", "entropy"):
      np.testing.assert_allclose(r2[k], r1[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_killed_process_stops_the_other(tmp_path):
  procs = _launch(tmp_path, ["sft.steps=500", "train.steps=1", "log.tensorboard=False"],
                  heartbeat_s=5)
  path = str(tmp_path / "metrics.jsonl")
  deadline = time.time() + 300
  while time.time() < deadline and len(metrics.read_jsonl(path)) < 2:
    assert all(p.poll() is None for p in procs), procs[0].stderr.read()[-2000:]
    time.sleep(0.2)
  procs[1].send_signal(signal.SIGKILL)
  start = time.time()
  _, err = procs[0].communicate(timeout=120)
  assert procs[0].returncode != 0
  assert time.time() - start < 60
  assert "heartbeat timeout" in err
  procs[1].wait()


class _Device(NamedTuple):
  id: int
  process_index: int


def test_split_devices_gives_every_process_the_same_share():
  two = [_Device(i, i // 4) for i in range(8)]  # 2 processes x 4 devices
  ids = lambda ds: [d.id for d in ds]
  assert [ids(x) for x in context.split_devices(two, 4)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
  assert [ids(x) for x in context.split_devices(two, 2, 4)] == [[0, 4], [1, 2, 5, 6]]
  assert [ids(x) for x in context.split_devices(two, 0)] == [[], list(range(8))]
  one = [_Device(i, 0) for i in range(8)]
  assert [ids(x) for x in context.split_devices(one, 3, 2)] == [[0, 1, 2], [3, 4]]


@pytest.mark.parametrize("overrides, message", [
    (["mesh.rollout_devices=3"], "mesh.rollout_devices=3 does not split evenly over 2"),
    (["mesh.rollout_devices=8"], "leaves no device for the training mesh"),
    (["mesh.rollout_devices=2", "mesh.num_devices=3"], "num_devices=3 does not split evenly"),
    (["mesh.rollout_devices=2", "train.async_lag=-1", "rollout.max_staleness=2"],
     "free-running) runs in one process"),
])
def test_async_pod_rules(monkeypatch, overrides, message):
  """The device rules of an asynchronous job of 2 processes x 4 devices, one line each."""
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "local_device_count", lambda: 4)
  config = config_utils.load_config(QUICKSTART, ["train.mode=async"] + overrides)
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    context.device_rules(config)


def test_own_share_is_a_process_groups_of_a_job_wide_batch():
  G, M, R = 4, 2, 3
  rows = np.arange(G * M * R).reshape(G * M, R)
  prompts = np.arange(G * 3, dtype=np.int32).reshape(G, 3)
  x = Scored(np.arange(10, 10 + G), prompts, np.arange(1, G + 1, dtype=np.int32), rows,
             rows % 2 == 0, rows / 10.0, rows + 1,
             np.arange(G * M, dtype=np.float32).reshape(G, M), np.asarray([3, 1]), 1.0, 0, {})
  second = runner.own_share(x, 2, 4, lead=False)  # process 1 of 2: groups 2 and 3
  assert second.indices.tolist() == [12, 13]
  np.testing.assert_array_equal(second.prompts, prompts[2:])
  assert second.prompt_lens.tolist() == [3, 4]
  for k in ("tokens", "mask", "logprobs", "versions"):
    np.testing.assert_array_equal(getattr(second, k), getattr(x, k)[2 * M:], err_msg=k)
  np.testing.assert_array_equal(second.rewards, x.rewards[2:])
  assert second.faults.tolist() == [0, 0]  # the job's faults stay with process 0
  assert runner.own_share(x, 0, 2, lead=True).faults.tolist() == [3, 1]
