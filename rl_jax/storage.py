"""Paths of the workdir and data files: local directories and ``gs://bucket/path``.

Every write into a workdir goes through ``etils.epath`` (this module's helpers or
``epath.Path`` directly), which reads local paths with ``os`` and ``gs://`` URLs with gcsfs;
orbax writes checkpoint arrays through tensorstore's own ``gcs`` driver.

A local Cloud Storage emulator (e.g. ``gcp-storage-emulator``) is reached with::

    STORAGE_EMULATOR_HOST=http://localhost:PORT       # gcsfs / google-cloud-storage
    TENSORSTORE_GCS_HTTP_URL=http://localhost:PORT    # tensorstore (orbax's arrays)

Objects in a bucket cannot be appended to or renamed atomically: ``metrics.jsonl`` on
``gs://`` is rewritten whole (``rl_jax.metrics``), and atomic replaces become copy + delete.
"""

from __future__ import annotations

import os

from etils import epath

from rl_jax.errors import StorageError

__all__ = ["is_remote", "join", "check_path", "is_file", "open_file", "makedirs", "replace",
           "upload_dir"]

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
  """Creates the directory ``path`` with its parents (a no-op on buckets, which have none)."""
  if is_remote(path):
    return
  os.makedirs(path, exist_ok=True)


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
