"""Paths of the workdir and data files: local directories and ``gs://bucket/path``.

Every write into a workdir goes through ``etils.epath`` (this module's helpers or
``epath.Path`` directly), which reads local paths with ``os`` and ``gs://`` URLs with gcsfs;
orbax writes checkpoint arrays through tensorstore's own ``gcs`` driver.

A local Cloud Storage emulator (e.g. ``gcp-storage-emulator``) is reached with::

    STORAGE_EMULATOR_HOST=http://localhost:PORT       # gcsfs / google-cloud-storage
    TENSORSTORE_GCS_HTTP_URL=http://localhost:PORT    # tensorstore (orbax's arrays)

Objects in a bucket cannot be appended to or renamed atomically: ``metrics.jsonl`` on
``gs://`` is rewritten whole (``rl_jax.metrics``), and atomic replaces become copy + delete.

Before a run writes anything, ``check_writable`` writes and deletes one probe object in the
workdir through both clients, within ``RL_JAX_STORAGE_TIMEOUT_S`` seconds (default 30): an
unwritable directory or an unreachable bucket is one ``StorageError`` line instead of a
traceback, or minutes of the clients' own retries.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
import time

from etils import epath

from rl_jax.errors import StorageError

__all__ = ["is_remote", "join", "check_path", "check_writable", "probe_timeout_s", "is_file",
           "open_file", "makedirs", "replace", "upload_dir"]

# the environment variable that bounds check_writable's probe of a bucket, and its default
TIMEOUT_ENV = "RL_JAX_STORAGE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 30.0

# URL schemes and the module their epath backend imports
_CLIENTS = {"gs://": "gcsfs"}


def is_remote(path: str | os.PathLike) -> bool:
  """Whether ``path`` is a URL (``gs://...``) rather than a local path."""
  return "://" in os.fspath(path)


def join(base: str | os.PathLike, *parts: str) -> str:
  """``base/part/...`` for a local path or a URL (a string)."""
  return os.fspath(epath.Path(base).joinpath(*parts)) if is_remote(base) else os.path.join(
      os.fspath(base), *parts)


def check_path(path: str | os.PathLike, what: str = "path") -> None:
  """Raises ``StorageError`` (one line) when ``path``'s scheme is unknown or its client
  package is missing; local paths always pass."""
  path = os.fspath(path)
  if not is_remote(path):
    return
  scheme = path.split("://", 1)[0] + "://"
  if scheme not in _CLIENTS:
    raise StorageError(f"{what} {path}: unsupported scheme {scheme} (local paths and gs:// "
                       "work)")
  module = _CLIENTS[scheme]
  try:
    __import__(module)
  except ImportError:
    raise StorageError(f"{what} {path}: {scheme} paths need the {module} package "
                       f"(pip install {module})") from None
  if not path[len(scheme):].split("/", 1)[0]:
    raise StorageError(f"{what} {path}: no bucket name")


def is_file(path: str | os.PathLike) -> bool:
  """Whether ``path`` (local or a URL) is an existing file; an unusable URL raises
  ``StorageError`` (``check_path``)."""
  if not is_remote(path):
    return os.path.isfile(path)
  check_path(path)
  return epath.Path(path).is_file()


def open_file(path: str | os.PathLike, mode: str = "r", **kwargs):
  """``open(path, mode)`` for a local path or a URL (read through gcsfs for ``gs://``)."""
  if not is_remote(path):
    return open(path, mode, **kwargs)  # pylint: disable=unspecified-encoding
  check_path(path)
  return epath.Path(path).open(mode, **kwargs)


def makedirs(path: str | os.PathLike) -> None:
  """Creates the directory ``path`` with its parents (a no-op on buckets, which have none).

  Raises:
    StorageError: it cannot be created (one line naming it and the reason).
  """
  if is_remote(path):
    return
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise StorageError(f"cannot create the directory {os.fspath(path)} ({_os_reason(e)}); "
                       f"{_local_hint()}") from None


def _os_reason(e: OSError) -> str:
  reason = e.strerror or type(e).__name__
  return f"{reason}: {e.filename}" if e.filename else reason


def _local_hint() -> str:
  return (f"check that it is a directory this user (uid {os.geteuid()}) may write to, on a "
          "filesystem mounted read-write")


def probe_timeout_s() -> float:
  """``RL_JAX_STORAGE_TIMEOUT_S`` (seconds), or 30."""
  value = os.environ.get(TIMEOUT_ENV, "")
  try:
    timeout = float(value) if value else DEFAULT_TIMEOUT_S
  except ValueError:
    raise StorageError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds") from None
  if not timeout > 0:
    raise StorageError(f"{TIMEOUT_ENV}={value!r} must be positive")
  return timeout


def check_writable(path: str | os.PathLike, what: str = "path",
                   timeout_s: float | None = None) -> None:
  """Makes sure a run can write into the directory (or bucket prefix) ``path`` before it
  writes anything: creates it and writes and deletes one probe file there (on ``gs://``
  through gcsfs and through tensorstore, orbax's client, within ``timeout_s`` seconds,
  ``probe_timeout_s()`` when None).

  Raises:
    StorageError: the path cannot be written, or the bucket did not answer in time (one line
      naming ``path`` and what to check).
  """
  check_path(path, what)
  path = os.fspath(path)
  if not is_remote(path):
    makedirs(path)
    try:
      fd, probe = tempfile.mkstemp(prefix=".write_probe.", dir=path)
      os.close(fd)
      os.remove(probe)
    except OSError as e:
      raise StorageError(f"{what} {path} is not writable ({e.strerror or type(e).__name__}); "
                         f"{_local_hint()}") from None
    return
  timeout = probe_timeout_s() if timeout_s is None else float(timeout_s)
  probe = _RemoteProbe(path)
  probe.start()
  probe.join(timeout)
  emulator = [f"{k}={os.environ[k]}" for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")
              if os.environ.get(k)]
  check = ("check the bucket name, that these credentials may write to it, the network" +
           (f", and {' and '.join(emulator)}" if emulator else ""))
  if probe.is_alive():  # the clients are still retrying: give up on them
    last = f"; last: {probe.last_retry}" if probe.last_retry else ""
    raise StorageError(f"{what} {path}: the storage service did not answer within "
                       f"{timeout:g} s ({TIMEOUT_ENV}){last}; {check}")
  if probe.error is not None:
    e = probe.error
    first = (str(e).strip().splitlines() or [""])[0][:300]
    raise StorageError(f"{what} {path} is not writable ({probe.client}: {type(e).__name__}"
                       f"{': ' + first if first else ''}); {check}")


class _RemoteProbe(threading.Thread):
  """Writes and deletes ``<path>/.write_probe.<host>.<pid>`` through gcsfs (epath) and then
  through tensorstore; records the error (and gcsfs's last retried one) instead of raising.
  A daemon thread: ``check_writable`` stops waiting for it at its time-out."""

  def __init__(self, path: str):
    super().__init__(name="storage-probe", daemon=True)
    self.path = path
    self.key = f".write_probe.{socket.gethostname()}.{os.getpid()}.{time.time_ns()}"
    self.error: BaseException | None = None
    self.client = ""
    self.last_retry = ""

  def run(self) -> None:
    # gcsfs logs each retry, and a traceback when it gives up: keep the last reason for the
    # error line instead of printing them (until this thread ends)
    logger = logging.getLogger("gcsfs")
    saved = logger.level, logger.propagate
    probe = self

    class _Keep(logging.Handler):
      def emit(self, record):
        message = record.getMessage()
        if "exception:" in message:
          probe.last_retry = message.split("exception:", 1)[1].strip()[:300]

    handler = _Keep()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
      self.client = "gcsfs"
      target = epath.Path(join(self.path, self.key))
      target.write_bytes(b"rl_jax write probe\n")
      target.unlink(missing_ok=True)
      if self.path.startswith("gs://"):
        self.client = "tensorstore"
        self._tensorstore()
    except Exception as e:  # pylint: disable=broad-except
      self.error = e
    finally:
      logger.removeHandler(handler)
      logger.setLevel(saved[0])
      logger.propagate = saved[1]

  def _tensorstore(self) -> None:
    import tensorstore as ts  # pylint: disable=import-outside-toplevel
    bucket, _, prefix = self.path[len("gs://"):].partition("/")
    prefix = prefix.strip("/")
    context = ts.Context({"gcs_request_retries": {
        "max_retries": 3, "initial_delay": "0.5s", "max_delay": "4s"}})
    store = ts.KvStore.open({"driver": "gcs", "bucket": bucket,
                             "path": f"{prefix}/" if prefix else ""}, context=context).result()
    store.write(self.key, b"rl_jax write probe\n").result()  # not empty: emulators refuse that
    store.write(self.key, None).result()


def replace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
  """Moves ``src`` onto ``dst``: atomic locally, copy + delete on a bucket."""
  if is_remote(src):
    epath.Path(src).replace(epath.Path(dst))
  else:
    os.replace(src, dst)


def upload_dir(local: str | os.PathLike, dst: str | os.PathLike) -> None:
  """Copies every file under the local directory ``local`` to ``dst`` (same relative paths),
  overwriting; ``dst`` may be a URL."""
  for root, _, files in os.walk(local):
    for name in files:
      src = os.path.join(root, name)
      rel = os.path.relpath(src, local)
      target = epath.Path(join(dst, *rel.split(os.sep)))
      if not is_remote(dst):
        target.parent.mkdir(parents=True, exist_ok=True)
      target.write_bytes(epath.Path(src).read_bytes())
