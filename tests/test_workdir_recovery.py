"""A pod job's failures, on one killed run of 8 devices: a second run on its live workdir
stops in one line; after SIGKILL a rerun takes the lock over, skips a damaged newest
checkpoint (kept as ``<step>.damaged``, one notice line) and ends with the killed run's
weights, bit for bit; a rerun on 2 devices from a checkpoint written on 8 has its parameters
after one step within 1e-4 and its held-out accuracy within a point. Bad inputs (a workdir
without write permission, an unreachable bucket, a coordinator address nobody listens on)
stop the CLI in one ``error:`` line within their time-outs, writing nothing."""

import functools
import os
import shutil
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from rl_jax import checkpoint, config_utils, distributed, metrics, train
from rl_jax.errors import ConfigError
from rl_jax.checkpoint import integrity
from rl_jax.train import lock as lock_lib
from tests.tiny import QUICKSTART, ROOT, TINY_MODEL, env_with_devices

# A short supervised start (held-out greedy accuracy about 0.15 on 64 prompts, not 0), then
# RL, with an entropy bonus so every RL step moves the weights even at zero reward; evaluated
# at every step.
SFT = 20
TINY = TINY_MODEL + [
    f"sft.steps={SFT}", "sft.lr=1e-2", "train.batch_groups=8", "rollout.n=2",
    "loss.entropy_coef=0.01",
    "train.eval_every=1", "data.eval_size=64", "train.checkpoint_every=1", "train.keep=10",
    "log.tensorboard=False", "mesh.rules=fsdp"]


def _cmd(workdir, overrides):
  return [sys.executable, "-m", "rl_jax.train", f"--config={QUICKSTART}", f"--workdir={workdir}"
          ] + [f"--config.{o}" for o in TINY + overrides]


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


@functools.cache
def _setup():
  return train.build_setup(config_utils.load_config(QUICKSTART, TINY + ["mesh.num_devices=8"]))


def _params(workdir, step):
  """The policy parameters of ``workdir``'s checkpoint of ``step`` (host arrays)."""
  state, _ = checkpoint.restore(os.path.join(workdir, "checkpoints"),
                                train.abstract_state(_setup(), step), step=step)
  return jax.tree.map(np.asarray, state.params)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("pod") / "run")
  ckpt_dir = os.path.join(workdir, "checkpoints")
  first = subprocess.Popen(_cmd(workdir, ["train.steps=100", "mesh.num_devices=8"]), cwd=ROOT,
                           env=env_with_devices(8), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 400
    while (time.time() < deadline and first.poll() is None
           and len([s for s in _sealed(ckpt_dir) if s > SFT]) < 2):
      time.sleep(0.05)
    assert first.poll() is None, "the first run ended early"
    # the workdir is in use: the second run stops before it reads anything
    second = subprocess.run(_cmd(workdir, ["train.steps=100", "train.dry_run=True"]), cwd=ROOT,
                            env=env_with_devices(8), capture_output=True, text=True, timeout=300)
  finally:
    first.kill()
    first.wait()
  killed_rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  # the newest step with its checksum list (an RL step after another); a newer one the kill
  # caught before its sealing is removed, as if the kill had come before its commit
  damaged = _sealed(ckpt_dir)[-1]
  for s in checkpoint.all_steps(ckpt_dir):
    if s > damaged:
      shutil.rmtree(os.path.join(ckpt_dir, str(s)))
  # the killed (uninterrupted until then) 8-device run's weights after step n = damaged
  killed_params = _params(workdir, damaged)
  moved = max(float(np.abs(a - b).max()) for a, b in zip(
      jax.tree.leaves(killed_params), jax.tree.leaves(_params(workdir, damaged - 1))))
  # a copy of the workdir that ends with the checkpoint of step n - 1, for the 2-device rerun
  two = os.path.join(os.path.dirname(workdir), "two_devices")
  shutil.copytree(workdir, two, ignore=lambda d, names: [str(damaged)] if d == ckpt_dir else [])
  _flip_bytes(os.path.join(ckpt_dir, str(damaged)))
  # the reruns of the same command, each ending with step n: on the 8 devices of the killed
  # run (skips the damaged step n, resumes from n - 1) and, on the copy, on 2 devices
  steps = f"train.steps={damaged - SFT}"
  procs = [subprocess.Popen(_cmd(w, [steps, f"mesh.num_devices={d}"]), cwd=ROOT,
                            env=env_with_devices(d), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
           for w, d in ((workdir, 8), (two, 2))]
  errs = [p.communicate(timeout=400)[1] for p in procs]
  rerun, rerun_two = [subprocess.CompletedProcess(p.args, p.returncode, None, err)
                      for p, err in zip(procs, errs)]
  return dict(workdir=workdir, pid=first.pid, second=second, damaged=damaged, rerun=rerun,
              killed_rows=killed_rows, killed_params=killed_params, moved=moved, two=two,
              rerun_two=rerun_two)


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
  """The rerun resumes from step n - 1 with one notice line and ends (step n) with the weights,
  held-out accuracy and step records of the killed run, which ran steps 1..n unbroken on the
  same 8 devices."""
  rerun, n = scenario["rerun"], scenario["damaged"]
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  ckpt_dir = os.path.join(scenario["workdir"], "checkpoints")
  lines = [line for line in rerun.stderr.splitlines() if "skipped" in line]
  assert len(lines) == 1 and f"checkpoint of step {n} skipped" in lines[0], rerun.stderr[-3000:]
  assert "differs from what was saved" in lines[0]
  assert os.path.isdir(os.path.join(ckpt_dir, f"{n}.damaged", "state"))  # kept
  assert checkpoint.all_steps(ckpt_dir)[-1] == n  # step n written again
  jax.tree.map(np.testing.assert_array_equal, _params(scenario["workdir"], n),
               scenario["killed_params"])
  rows = metrics.read_jsonl(os.path.join(scenario["workdir"], "metrics.jsonl"))
  assert [r["step"] for r in rows] == list(range(1, n + 1))
  before = {r["step"]: r for r in scenario["killed_rows"]}
  for key in ("reward_mean", "loss", "grad_norm", "eval_accuracy", "eval_pass@4"):
    assert rows[n - 1][key] == before[n][key], key


def test_resume_on_two_devices_matches_the_eight_device_run(scenario):
  """Step n is recomputed on 2 devices from the checkpoint of step n - 1 written on 8: the
  same rollouts (rewards), the loss and gradient to float rounding, the parameters after the
  step within 1e-4 of the 8-device run's, and its held-out greedy accuracy within 1 point."""
  rerun, n, two = scenario["rerun_two"], scenario["damaged"], scenario["two"]
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert "skipped" not in rerun.stderr  # resumed from step n - 1, which it did not write
  rows = metrics.read_jsonl(os.path.join(two, "metrics.jsonl"))
  assert [r["step"] for r in rows] == list(range(1, n + 1))
  before = {r["step"]: r for r in scenario["killed_rows"]}
  assert [r["reward_mean"] for r in rows[SFT:]] == [before[s]["reward_mean"]
                                                    for s in range(SFT + 1, n + 1)]
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose(rows[n - 1][key], before[n][key], rtol=1e-4, atol=1e-6,
                               err_msg=key)
  gap = max(float(np.abs(a - b).max()) for a, b in zip(
      jax.tree.leaves(_params(two, n)), jax.tree.leaves(scenario["killed_params"])))
  assert scenario["moved"] > 1e-4  # the step changed the weights by more than the bound
  assert gap <= 1e-4
  assert before[n]["eval_accuracy"] > 0  # computed on a policy that gets some right
  assert abs(rows[n - 1]["eval_accuracy"] - before[n]["eval_accuracy"]) <= 0.01
  assert os.path.exists(os.path.join(two, "hf", "model.safetensors"))


def _bad_input(args, *, env=None, cwd=ROOT, prefix=()):
  """Runs the trainer's CLI with ``args``, which must fail: (its one ``error:`` line, seconds)."""
  start = time.monotonic()
  proc = subprocess.run(list(prefix) + [sys.executable, "-m", "rl_jax.train",
                                        f"--config={QUICKSTART}"] + args,
                        cwd=cwd, capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})))
  seconds = time.monotonic() - start
  assert proc.returncode == 2, proc.stderr[-3000:]  # main_guard's exit code for user errors
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  return errors[0], seconds


def _tree(root):
  """{relative path: bytes} of every file under ``root``, and its directories."""
  out = {}
  for r, dirs, files in os.walk(root):
    out.update({os.path.relpath(os.path.join(r, d), root): None for d in dirs})
    out.update({os.path.relpath(os.path.join(r, f), root): open(os.path.join(r, f), "rb").read()
                for f in files})
  return out


# root writes through mode bits (CAP_DAC_OVERRIDE): as root, the run goes without those
# capabilities (setpriv), held to the 0500 mode like any other user
_NO_DAC = ("setpriv", "--inh-caps=-all",
           "--bounding-set=-dac_override,-dac_read_search,-fowner", "--")


@pytest.mark.skipif(os.geteuid() == 0 and not shutil.which("setpriv"),
                    reason="as root this needs setpriv to drop CAP_DAC_OVERRIDE")
@pytest.mark.parametrize("sub,message", [
    ("", "is not writable (Permission denied)"),
    ("run", "cannot create the directory")])
def test_workdir_without_write_permission_is_one_error_line(tmp_path, sub, message):
  """The workdir (or the directory it would be created in) is mode 0500 and holds an earlier
  run's files: one line naming it, nothing written or changed."""
  readonly = tmp_path / "readonly"
  readonly.mkdir()
  (readonly / "metrics.jsonl").write_text('{"step": 1}\n')
  readonly.chmod(0o500)
  before = _tree(readonly)
  workdir = str(readonly / sub) if sub else str(readonly)
  line, seconds = _bad_input([f"--workdir={workdir}"],
                             prefix=_NO_DAC if os.geteuid() == 0 else ())
  assert workdir in line and message in line and "may" in line, line
  assert "Permission denied" in line
  assert seconds < 60
  assert _tree(readonly) == before


@pytest.mark.skipif(os.geteuid() == 0 and not shutil.which("setpriv"),
                    reason="as root this needs setpriv to drop CAP_DAC_OVERRIDE")
def test_a_read_only_checkpoint_directory_is_one_error_line_before_any_step(tmp_path):
  """A writable workdir whose ``checkpoints/`` is mode 0500: one line at start-up, not a
  stack of orbax errors at the first save after hours of steps."""
  workdir = tmp_path / "run"
  ckpts = workdir / "checkpoints"
  ckpts.mkdir(parents=True)
  ckpts.chmod(0o500)
  line, _ = _bad_input([f"--workdir={workdir}"], prefix=_NO_DAC if os.geteuid() == 0 else ())
  assert line.startswith(f"error: the checkpoint directory {ckpts} is not writable "
                         "(Permission denied)"), line
  assert not (workdir / "metrics.jsonl").exists()


# saves into DIR (argv[1]) from the Python API's path (``Trainer.save`` opens a Checkpointer on
# the user's directory and saves once); prints the error's class and text
_SAVE_INTO = """
import sys
import jax.numpy as jnp
from rl_jax import checkpoint
try:
  with checkpoint.Checkpointer(sys.argv[1], keep=None, save_every=0) as ckpt:
    ckpt.save(3, {"w": jnp.ones(4)}, force=True)
except Exception as e:
  print(type(e).__name__ + ": " + str(e))
"""


@pytest.mark.skipif(os.geteuid() == 0 and not shutil.which("setpriv"),
                    reason="as root this needs setpriv to drop CAP_DAC_OVERRIDE")
def test_a_save_into_a_read_only_directory_is_one_error_line(tmp_path):
  """A Checkpointer's first save into an existing mode-0500 directory (``api.Trainer.save``
  to a directory the user may not write): one line naming it, not orbax's background-thread
  errors (about 200 lines, then a bare PermissionError); nothing written."""
  readonly = tmp_path / "saved"
  readonly.mkdir()
  readonly.chmod(0o500)
  proc = subprocess.run(list(_NO_DAC if os.geteuid() == 0 else ()) +
                        [sys.executable, "-c", _SAVE_INTO, str(readonly)],
                        capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.stdout.strip() == (
      f"StorageError: the checkpoint directory {readonly} is not writable (Permission denied); "
      f"check that it is a directory this user (uid {os.geteuid()}) may write to, on a "
      "filesystem mounted read-write"), (proc.stdout, proc.stderr[-3000:])
  assert "Traceback" not in proc.stderr and "ERROR" not in proc.stderr, proc.stderr[-3000:]
  assert _tree(readonly) == {}


def test_unreachable_bucket_is_one_error_line_within_the_probe_timeout(tmp_path):
  """``gs://`` with the storage clients pointed at a closed port: gcsfs alone would retry for
  about 30 s; the write probe gives up after ``RL_JAX_STORAGE_TIMEOUT_S=3``."""
  pytest.importorskip("gcsfs")
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]  # closed once the socket is
  url = f"http://localhost:{port}"
  line, seconds = _bad_input(["--workdir=gs://rl-jax-test/run"], cwd=tmp_path, env=dict(
      STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url, RL_JAX_STORAGE_TIMEOUT_S="3"))
  assert line.startswith("error: --workdir gs://rl-jax-test/run: the storage service did not "
                         "answer within 3 s"), line
  assert f"localhost:{port}" in line and "check the bucket name" in line
  assert seconds < 25  # the imports and 3 s, not the clients' retries
  assert not os.listdir(tmp_path)  # no local folder "gs:"


def test_coordinator_nobody_listens_on_is_one_error_line_within_its_timeout(tmp_path):
  """Process 1 of 2, the coordinator address a closed port: JAX's client would abort with a
  C++ stack trace; the run says so in one line after ``initialization_timeout_s=3``."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    address = f"localhost:{s.getsockname()[1]}"
  workdir = tmp_path / "run"
  line, seconds = _bad_input([f"--workdir={workdir}"] + [f"--config.distributed.{o}" for o in (
      f"coordinator_address={address}", "num_processes=2", "process_id=1",
      "initialization_timeout_s=3")])
  assert line.startswith(f"error: distributed.coordinator_address={address}: nobody listens "
                         "there (tried for distributed.initialization_timeout_s=3 s"), line
  assert "check that process 0" in line
  assert 3 <= seconds < 25  # waited the time-out (default 300), then stopped
  assert not workdir.exists()


@pytest.mark.parametrize("address,words", [
    ("localhost", "is not host:port (a port in 1..65535)"),
    ("localhost:99999", "is not host:port (a port in 1..65535)"),
    ("taken", "process 0 serves the coordinator on port"),
])
def test_process_zeros_coordinator_address_is_checked_before_jax_reads_it(address, words):
  """Process 0 of 2 with no port (JAX raised IndexError), a port beyond 65535, or a port
  another socket listens on (JAX's coordinator aborted with a native stack trace): one line
  each, before ``jax.distributed.initialize``."""
  with socket.socket() as busy:
    busy.bind(("", 0))
    busy.listen()
    if address == "taken":
      address = f"localhost:{busy.getsockname()[1]}"
    config = config_utils.load_config(QUICKSTART, [
        f"distributed.coordinator_address={address}", "distributed.num_processes=2",
        "distributed.process_id=0"])
    with pytest.raises(ConfigError) as e:
      distributed.initialize(config.distributed)
  assert str(e.value).startswith("distributed.coordinator_address=")
  assert address in str(e.value) and words in str(e.value)
  assert not distributed.jax.distributed.is_initialized()
