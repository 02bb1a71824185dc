"""One run per workdir (rl_jax.train.lock): a live holder stops a second run in one line, a
dead one is taken over, a job's own processes share the lock."""

import os
import socket
import subprocess
import sys
import time

import pytest

from rl_jax import config_utils, train
from rl_jax.errors import WorkdirBusyError
from rl_jax.train import lock as lock_lib
from tests.tiny import QUICKSTART, ROOT, TINY_MODEL

TINY = TINY_MODEL + ["sft.steps=0", "train.steps=300", "train.batch_groups=2", "rollout.n=2",
                     "train.eval_every=0", "train.checkpoint_every=0", "log.tensorboard=False"]


def _holder(**kw):
  now = time.time()
  fields = dict(pid=os.getpid(), host=socket.gethostname(), started=now, heartbeat=now,
                job="j")
  return lock_lib.Holder(**{**fields, **kw})


def test_holder_alive_rules():
  host, now = socket.gethostname(), time.time()
  alive = lambda h: lock_lib.holder_alive(h, host=host, now=now, stale_after_s=60)
  assert alive(_holder()) == (True, "")  # this very process
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  ok, why = alive(_holder(pid=dead.pid))
  assert not ok and "not running" in why
  ok, why = alive(_holder(started=now - 1e4))  # this pid started after the lock: reused
  assert not ok and "reused" in why
  assert alive(_holder(host="elsewhere", heartbeat=now - 30))[0]
  ok, why = alive(_holder(host="elsewhere", heartbeat=now - 90))
  assert not ok and "heartbeat" in why


def test_second_holder_fails_same_job_shares_stale_is_taken_over(tmp_path):
  first = lock_lib.WorkdirLock(str(tmp_path), "job-a", stale_after_s=0.5)
  assert first.acquire() is None
  assert lock_lib.WorkdirLock(str(tmp_path), "job-a").acquire() is None  # the job's own
  with pytest.raises(WorkdirBusyError, match=f"pid {os.getpid()} on host"):
    lock_lib.WorkdirLock(str(tmp_path), "job-b").acquire()
  # the heartbeat keeps a holder on another host alive past stale_after_s
  path = tmp_path / lock_lib.LOCK_FILE
  holder = lock_lib.Holder.from_json(path.read_text())
  path.write_text(lock_lib.Holder(**{**holder.__dict__, "host": "elsewhere"}).to_json())
  time.sleep(1.0)
  with pytest.raises(WorkdirBusyError, match="host elsewhere"):
    lock_lib.WorkdirLock(str(tmp_path), "job-b", stale_after_s=0.5).acquire()
  first.release()  # the heartbeat stops, the file goes
  assert not path.exists()
  path.write_text(_holder(host="elsewhere", heartbeat=time.time() - 5, job="old").to_json())
  third = lock_lib.WorkdirLock(str(tmp_path), "job-c", stale_after_s=1)
  assert "heartbeat is 5 s old" in third.acquire()
  assert lock_lib.Holder.from_json(path.read_text()).job == "job-c"
  third.release()


def test_second_run_on_a_live_workdir_fails_then_takes_over_after_sigkill(tmp_path, capfd):
  workdir = str(tmp_path / "run")
  cmd = [sys.executable, "-m", "rl_jax.train", f"--config={QUICKSTART}", f"--workdir={workdir}"]
  first = subprocess.Popen(cmd + [f"--config.{o}" for o in TINY], cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  lock_path = os.path.join(workdir, lock_lib.LOCK_FILE)
  try:
    deadline = time.time() + 300
    while time.time() < deadline and first.poll() is None and not os.path.exists(lock_path):
      time.sleep(0.05)
    assert first.poll() is None, "the first run ended early"
    second = subprocess.run(cmd + [f"--config.{o}" for o in TINY + ["train.dry_run=True"]],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert second.returncode != 0
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr
    assert f"pid {first.pid} on host {socket.gethostname()}" in errors[0]
  finally:
    first.kill()
    first.wait()
  assert os.path.exists(lock_path)  # SIGKILL leaves the lock behind
  capfd.readouterr()
  config = config_utils.load_config(QUICKSTART, TINY + ["train.dry_run=True"])
  assert train.train(config, workdir, progress=False) is None  # the rerun takes over
  err = capfd.readouterr().err
  assert f"taking over {lock_path} from pid {first.pid}" in err
  assert "is not running on this host" in err
  assert not os.path.exists(lock_path)  # released at the end
