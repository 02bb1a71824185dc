"""One run per workdir (rl_jax.train.lock): a live holder stops a second run, a dead one is
taken over, a job's own processes share the lock. The trainer's use of it (a second run on a
live workdir, a rerun after SIGKILL) is in tests/test_workdir_recovery.py."""

import os
import socket
import subprocess
import sys
import time

import pytest

from rl_jax.errors import WorkdirBusyError
from rl_jax.train import lock as lock_lib


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
