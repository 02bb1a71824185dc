"""A pod job's failures, on one killed run: a second run on its live workdir stops in one
line; after SIGKILL a rerun takes the lock over, skips a damaged newest checkpoint (kept
as ``<step>.damaged``) and resumes on 4 devices from a checkpoint written on 8."""

import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from rl_jax import checkpoint, metrics
from rl_jax.checkpoint import integrity
from rl_jax.train import lock as lock_lib
from tests.tiny import QUICKSTART, ROOT, TINY_MODEL

TINY = TINY_MODEL + [
    "sft.steps=0", "train.batch_groups=8", "rollout.n=2", "train.eval_every=0",
    "train.checkpoint_every=1", "train.keep=10", "log.tensorboard=False", "mesh.rules=fsdp"]


def _cmd(workdir, overrides):
  return [sys.executable, "-m", "rl_jax.train", f"--config={QUICKSTART}", f"--workdir={workdir}"
          ] + [f"--config.{o}" for o in TINY + overrides]


def _env(devices):
  flags = os.environ.get("XLA_FLAGS", "").replace(
      "--xla_force_host_platform_device_count=8", "")
  return dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}")


def _flip_bytes(step_dir):
  """Flips 64 bytes in the middle of the step's largest array file."""
  files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state"))
           for f in fs]
  big = max(files, key=os.path.getsize)
  data = bytearray(open(big, "rb").read())
  mid = len(data) // 2
  data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
  with open(big, "wb") as f:
    f.write(bytes(data))


def _sealed(ckpt_dir):
  """Saved steps that have their checksum list (``integrity.seal``)."""
  return [s for s in checkpoint.all_steps(ckpt_dir)
          if os.path.exists(os.path.join(ckpt_dir, str(s), integrity.CHECKSUMS))]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("pod") / "run")
  ckpt_dir = os.path.join(workdir, "checkpoints")
  first = subprocess.Popen(_cmd(workdir, ["train.steps=100", "mesh.num_devices=8"]), cwd=ROOT,
                           env=_env(8), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 400
    while time.time() < deadline and first.poll() is None and len(_sealed(ckpt_dir)) < 2:
      time.sleep(0.05)
    assert first.poll() is None, "the first run ended early"
    # the workdir is in use: the second run stops before it reads anything
    second = subprocess.run(_cmd(workdir, ["train.steps=100", "train.dry_run=True"]), cwd=ROOT,
                            env=_env(8), capture_output=True, text=True, timeout=300)
  finally:
    first.kill()
    first.wait()
  killed_rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  # the newest step with its checksum list; a newer one the kill caught before its sealing
  # is removed, as if the kill had come before its commit
  damaged = _sealed(ckpt_dir)[-1]
  for s in checkpoint.all_steps(ckpt_dir):
    if s > damaged:
      shutil.rmtree(os.path.join(ckpt_dir, str(s)))
  _flip_bytes(os.path.join(ckpt_dir, str(damaged)))
  # the rerun: another device count, the run ends with the damaged step
  rerun = subprocess.run(_cmd(workdir, [f"train.steps={damaged}", "mesh.num_devices=4"]),
                         cwd=ROOT, env=_env(4), capture_output=True, text=True, timeout=400)
  return dict(workdir=workdir, pid=first.pid, second=second, damaged=damaged, rerun=rerun,
              killed_rows=killed_rows)


def test_second_run_on_a_live_workdir_fails_in_one_line(scenario):
  second = scenario["second"]
  assert second.returncode != 0
  errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr
  assert f"in use by the run of pid {scenario['pid']} on host {socket.gethostname()}" in errors[0]


def test_rerun_takes_over_the_lock_of_the_killed_run(scenario):
  rerun, workdir = scenario["rerun"], scenario["workdir"]
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  lock_path = os.path.join(workdir, lock_lib.LOCK_FILE)
  assert f"taking over {lock_path} from pid {scenario['pid']}" in rerun.stderr
  assert not os.path.exists(lock_path)  # released when the rerun ended


def test_damaged_newest_checkpoint_is_skipped_and_kept(scenario):
  rerun, n = scenario["rerun"], scenario["damaged"]
  ckpt_dir = os.path.join(scenario["workdir"], "checkpoints")
  lines = [line for line in rerun.stderr.splitlines() if "skipped" in line]
  assert len(lines) == 1 and f"checkpoint of step {n} skipped" in lines[0], rerun.stderr[-3000:]
  assert "differs from what was saved" in lines[0]
  assert os.path.isdir(os.path.join(ckpt_dir, f"{n}.damaged", "state"))  # kept
  assert checkpoint.all_steps(ckpt_dir)[-1] == n  # step n written again


def test_resume_on_four_devices_matches_the_eight_device_steps(scenario):
  """Step n is recomputed on 4 devices from the checkpoint of step n - 1 written on 8: the
  same rollouts (rewards) and the same loss and gradient to float rounding."""
  n = scenario["damaged"]
  rows = metrics.read_jsonl(os.path.join(scenario["workdir"], "metrics.jsonl"))
  assert [r["step"] for r in rows] == list(range(1, n + 1))
  before = {r["step"]: r for r in scenario["killed_rows"]}
  assert [r["reward_mean"] for r in rows[:n]] == [before[s]["reward_mean"] for s in range(1, n + 1)]
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose(rows[n - 1][key], before[n][key], rtol=1e-4, atol=1e-6,
                               err_msg=key)
  assert os.path.exists(os.path.join(scenario["workdir"], "hf", "model.safetensors"))
