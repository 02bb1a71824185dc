"""Multi-process training through jax.distributed: 2 processes x 4 CPU devices (gloo) give the
run of 1 process x 8 devices, only process 0 writes files, a rerun resumes from the
collective checkpoint, and a killed process takes the job down within a bounded time."""

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
from safetensors.numpy import load_file

from rl_jax import config_utils, metrics, train
from tests.tiny import QUICKSTART, ROOT, TINY_MODEL

# Tiny, with an entropy bonus so every RL update moves the weights even at zero reward.
RUN = TINY_MODEL + [
    "sft.steps=2", "sft.batch_size=8", "train.batch_groups=8", "rollout.n=4",
    "train.eval_every=2", "train.checkpoint_every=1", "loss.entropy_coef=0.01",
]


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(workdir, overrides, heartbeat_s=30):
  """Start 2 processes of ``python -m rl_jax.train`` with 4 CPU devices each (through
  ``tests.multiprocess_main``: every process loads the programs of earlier launches from the
  session's compilation cache)."""
  port = _free_port()
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
         "JAX_PLATFORMS": "cpu"}
  procs = []
  for i in range(2):
    cmd = [sys.executable, "-m", "tests.multiprocess_main", f"--config={QUICKSTART}",
           f"--workdir={workdir}"] + [f"--config.{o}" for o in RUN + overrides] + [
               f"--config.distributed.coordinator_address=localhost:{port}",
               "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}",
               f"--config.distributed.heartbeat_timeout_s={heartbeat_s}"]
    procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True))
  return procs


def _finish(procs, timeout=600):
  outs = [p.communicate(timeout=timeout)[1] for p in procs]
  for p, err in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return outs


def test_two_processes_equal_one_and_resume(tmp_path):
  one, two = tmp_path / "one", tmp_path / "two"
  train.train(config_utils.load_config(QUICKSTART, RUN + ["train.steps=2"]), str(one),
              progress=False)
  _finish(_launch(two, ["train.steps=2"]))
  a, b = load_file(str(one / "hf" / "model.safetensors")), load_file(
      str(two / "hf" / "model.safetensors"))
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_allclose(b[k], a[k], atol=1e-5, rtol=1e-5, err_msg=k)
  rows_one = metrics.read_jsonl(str(one / "metrics.jsonl"))
  rows_two = metrics.read_jsonl(str(two / "metrics.jsonl"))
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
  # the rerun with a longer schedule resumes from the collective checkpoint at step 4
  _finish(_launch(two, ["train.steps=3"]))
  rows = metrics.read_jsonl(str(two / "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
  assert rows[:4] == rows_two


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
