"""One run per workdir: the lock file ``WORKDIR/run.lock``.

A run writes ``run.lock`` (JSON: ``pid``, ``host``, ``started``, ``heartbeat``, ``job``)
before it writes anything else into the workdir and deletes it when it ends. A second run
on the same workdir finds the file and decides whether its holder is alive:

* a holder on this host is alive while its pid runs (and started no later than the lock:
  a reused pid is not the holder);
* a holder on another host is alive while its heartbeat (rewritten every
  ``stale_after_s / 10`` seconds by a background thread) is younger than ``stale_after_s``
  (``train.lock_stale_s``).

A live holder stops the second run with ``WorkdirBusyError`` (one ``error:`` line naming its
pid and host); a dead one is taken over, with one line on stderr saying so.

``job`` names the job that holds the workdir. The processes of one multi-process job share
it: process 0 takes the lock, every other process checks that the lock names its own job
(``job_id``: the coordinator address and process 0's pid and start time, agreed by all).

On a local or network filesystem the lock is taken atomically (a hard link, or an exclusive
create); on ``gs://`` it is written and read back, which catches all but a near-simultaneous
start of two runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
import time

import numpy as np
from etils import epath

from rl_jax import storage
from rl_jax.errors import StorageError, WorkdirBusyError

__all__ = ["LOCK_FILE", "Holder", "WorkdirLock", "job_id", "holder_alive", "hold_workdir"]

LOCK_FILE = "run.lock"


@dataclasses.dataclass(frozen=True)
class Holder:
  """The contents of a lock file: who holds the workdir."""
  pid: int
  host: str
  started: float  # seconds since the epoch
  heartbeat: float  # the holder's last sign of life, seconds since the epoch
  job: str

  def describe(self) -> str:
    start = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
    return f"pid {self.pid} on host {self.host} (job {self.job}, started {start})"

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self))

  @classmethod
  def from_json(cls, text: str) -> "Holder":
    d = json.loads(text)
    return cls(pid=int(d["pid"]), host=str(d["host"]), started=float(d["started"]),
               heartbeat=float(d.get("heartbeat", d["started"])), job=str(d["job"]))


def _pid_start_time(pid: int) -> float | None:
  """When process ``pid`` started (seconds since the epoch), where /proc tells; else None."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
      boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError, StopIteration):
    return None


def _pid_running(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def holder_alive(h: Holder, *, host: str, now: float, stale_after_s: float) -> tuple[bool, str]:
  """Whether the holder ``h`` still runs, seen from ``host`` at time ``now``; (alive, why not)."""
  if h.host == host:
    if not _pid_running(h.pid):
      return False, f"pid {h.pid} is not running on this host"
    started = _pid_start_time(h.pid)
    if started is not None and started > h.started + 2.0:
      return False, f"pid {h.pid} was reused by a process started after the lock"
    return True, ""
  age = now - h.heartbeat
  if age > stale_after_s:
    return False, (f"its heartbeat is {age:.0f} s old (more than train.lock_stale_s="
                   f"{stale_after_s:g})")
  return True, ""


def job_id(coordinator: str | None = None, lead_pid: int | None = None,
           lead_start: float | None = None) -> str:
  """The id of this job: ``host:pid@start`` of one process, or the coordinator address and
  process 0's pid and start time for a multi-process job (the same on every process)."""
  pid = os.getpid() if lead_pid is None else lead_pid
  start = time.time() if lead_start is None else lead_start
  where = coordinator or socket.gethostname()
  return f"{where}:{pid}@{start:.3f}"


class WorkdirLock:
  """The lock of one workdir, taken by ``acquire`` and given back by ``release``."""

  def __init__(self, workdir: str, job: str, *, stale_after_s: float = 300.0):
    self.path = storage.join(workdir, LOCK_FILE)
    self.job = job
    self.stale_after_s = float(stale_after_s)
    self.host = socket.gethostname()
    self.started = time.time()
    self.owner = True  # False on the processes of a job other than process 0
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def _me(self) -> Holder:
    return Holder(pid=os.getpid(), host=self.host, started=self.started,
                  heartbeat=time.time(), job=self.job)

  def read(self) -> Holder | None:
    """The current holder, or None when there is no lock file (an unreadable one is a
    holder on no host whose heartbeat is its modification time)."""
    path = epath.Path(self.path)
    try:
      text = path.read_text()
    except FileNotFoundError:
      return None
    try:
      return Holder.from_json(text)
    except (ValueError, KeyError, TypeError):
      mtime = path.stat().mtime if path.exists() else 0.0
      return Holder(pid=-1, host="?", started=mtime, heartbeat=mtime, job="unreadable lock")

  def _create(self, holder: Holder) -> bool:
    """Writes the lock file if none exists; False if one does."""
    if storage.is_remote(self.path):
      if epath.Path(self.path).exists():
        return False
      epath.Path(self.path).write_text(holder.to_json())
      time.sleep(0.5)  # a run that wrote at the same moment: the last write wins, read it
      current = self.read()
      return current is not None and current.job == holder.job
    tmp = f"{self.path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
      f.write(holder.to_json())
    try:
      os.link(tmp, self.path)  # atomic, and the file is whole the moment it appears
      return True
    except FileExistsError:
      return False
    except OSError:  # no hard links on this filesystem: an exclusive create
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
      except FileExistsError:
        return False
      with os.fdopen(fd, "w") as f:
        f.write(holder.to_json())
      return True
    finally:
      os.remove(tmp)

  def _remove_stale(self, stale: Holder) -> None:
    """Moves a dead holder's lock away; only one of several runs that found it succeeds."""
    if storage.is_remote(self.path):
      epath.Path(self.path).unlink(missing_ok=True)
      return
    aside = f"{self.path}.stale.{os.getpid()}"
    try:
      os.rename(self.path, aside)
    except FileNotFoundError:
      return  # another run took it over first; the next attempt sees that run
    os.remove(aside)

  def acquire(self) -> str | None:
    """Takes the lock; returns a line describing a dead holder that was taken over (None
    if there was none).

    Raises:
      WorkdirBusyError: a live run holds the workdir.
    """
    taken_over = None
    for _ in range(5):
      try:
        created = self._create(self._me())
      except OSError as e:  # FileExistsError is handled in _create
        raise StorageError(f"cannot write the workdir lock {self.path} ({type(e).__name__}: "
                           f"{e.strerror or e}); check that the workdir is writable") from None
      if created:
        self._start_heartbeat()
        return taken_over
      holder = self.read()
      if holder is None:
        continue  # released meanwhile
      if holder.job == self.job:
        self._start_heartbeat()
        return taken_over
      alive, why = holder_alive(holder, host=self.host, now=time.time(),
                                stale_after_s=self.stale_after_s)
      if alive:
        raise WorkdirBusyError(
            f"workdir {os.path.dirname(self.path)} is in use by the run of "
            f"{holder.describe()}; wait for it to end or stop it (if it is gone, delete "
            f"{self.path})")
      self._remove_stale(holder)
      taken_over = (f"workdir lock: taking over {self.path} from {holder.describe()}: {why}")
    raise WorkdirBusyError(f"could not take {self.path}: other runs keep taking it")

  def _start_heartbeat(self) -> None:
    if self._thread is not None:
      return
    period = max(self.stale_after_s / 10.0, 0.05)

    def beat():
      while not self._stop.wait(period):
        holder = self.read()
        if holder is None or holder.job != self.job:
          return  # released, or taken over by another run: not ours to write
        try:
          self._write(dataclasses.replace(holder, heartbeat=time.time()))
        except OSError:
          pass  # a missed beat; the next one tries again

    self._thread = threading.Thread(target=beat, name="workdir-lock", daemon=True)
    self._thread.start()

  def _write(self, holder: Holder) -> None:
    if storage.is_remote(self.path):
      epath.Path(self.path).write_text(holder.to_json())
      return
    tmp = f"{self.path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
      f.write(holder.to_json())
    os.replace(tmp, self.path)

  def release(self) -> None:
    """Stops the heartbeat and deletes the lock file if it still names this job."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if not self.owner:
      return
    holder = self.read()
    if holder is not None and holder.job == self.job:
      epath.Path(self.path).unlink(missing_ok=True)


def _agreed_job(distributed_config) -> str:
  """``job_id`` of this job, the same on every process (process 0's pid and time)."""
  import jax  # pylint: disable=import-outside-toplevel
  if jax.process_count() == 1:
    return job_id()
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  lead = multihost_utils.broadcast_one_to_all(
      np.array([os.getpid(), int(time.time() * 1000)], np.int64))
  coordinator = distributed_config.coordinator_address or "auto"
  return job_id(coordinator, int(lead[0]), int(lead[1]) / 1000.0)


def hold_workdir(workdir: str, distributed_config, stale_after_s: float, *,
                 probe_timeout_s: float | None = None) -> WorkdirLock:
  """Takes ``workdir``'s lock for this job (every process calls this; process 0 writes the
  file); returns it (``release()`` at the end of the run).

  Every process first checks that it can write into the workdir
  (``storage.check_writable``, within ``probe_timeout_s`` seconds on a bucket; None: the
  ``RL_JAX_STORAGE_TIMEOUT_S`` environment variable, default 30).

  Raises:
    StorageError: the workdir is not writable, or its bucket does not answer in time.
    WorkdirBusyError: another run holds the workdir (on every process of the job).
  """
  import jax  # pylint: disable=import-outside-toplevel
  error: Exception | None = None
  try:
    storage.check_writable(workdir, "--workdir", timeout_s=probe_timeout_s)
  except StorageError as e:
    error = e
  if jax.process_count() == 1 and error is not None:
    raise error
  lock = WorkdirLock(workdir, _agreed_job(distributed_config), stale_after_s=stale_after_s)
  if jax.process_count() == 1:
    taken_over = lock.acquire()
    if taken_over:
      print(taken_over, file=sys.stderr)
    return lock
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  lock.owner = jax.process_index() == 0
  if error is None and jax.process_index() == 0:
    try:
      taken_over = lock.acquire()
      if taken_over:
        print(taken_over, file=sys.stderr)
    except (WorkdirBusyError, StorageError) as e:
      error = e
  # every process learns whether all could write and process 0 took the lock
  ok = np.asarray(multihost_utils.process_allgather(np.int32(error is None))).reshape(-1)
  if error is not None:
    raise error
  if not np.all(ok):
    failed = [i for i, good in enumerate(ok) if not good]
    if failed == [0]:
      raise WorkdirBusyError(f"workdir {workdir}: process 0 could not take it (in use by "
                             "another run, or not writable: process 0's error line says which)")
    raise StorageError(f"workdir {workdir}: processes {failed} cannot write into it (their "
                       "error lines say why)")
  holder = lock.read()
  if holder is None or holder.job != lock.job:
    seen = "no lock file" if holder is None else f"the lock of {holder.describe()}"
    raise WorkdirBusyError(f"workdir {workdir}: process {jax.process_index()} sees {seen}, not "
                           "its job's (is the workdir one directory shared by every host?)")
  return lock
