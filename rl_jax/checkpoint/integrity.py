"""Whether a saved step reads back whole: a checksum list written beside its files.

Orbax's commit marker says a save finished; it does not notice a file changed or lost
afterwards (tensorstore reads flipped bytes back without complaint). So once a save is
complete, ``seal`` writes ``<step>/checksums.json``: every file of the step with its size
and sha256 (local paths) or its size (``gs://``, where the bucket checks object integrity
itself). ``verify`` compares the step against that list; ``set_aside`` renames a damaged
step to ``<step>.damaged`` (never deleting it), which takes it out of the step list.

A step saved without the list is not checked: one cut short by a crash between its commit
and its sealing (the trainer seals a finished background save at the next training step),
or one written by an earlier version.
"""

from __future__ import annotations

import hashlib
import json
import os

from etils import epath

from rl_jax import storage
from rl_jax.errors import CheckpointCorruptError

__all__ = ["CHECKSUMS", "seal", "verify", "set_aside"]

CHECKSUMS = "checksums.json"


def _files(step_dir: epath.Path) -> list[str]:
  """Paths of every file under ``step_dir`` relative to it (the checksum list excluded)."""
  out = []
  bare = lambda p: os.fspath(p).split("://", 1)[-1]  # a bucket's walk drops the scheme
  for root, _, files in step_dir.walk():
    for name in files:
      rel = os.path.relpath(os.path.join(bare(root), name), bare(step_dir))
      if rel not in (CHECKSUMS, CHECKSUMS + ".tmp"):
        out.append(rel)
  return sorted(out)


def _digest(path: epath.Path, remote: bool) -> dict:
  if remote:
    return {"size": path.stat().length}
  sha = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      sha.update(block)
  sha = sha.hexdigest()
  return {"size": os.path.getsize(path), "sha256": sha}


def seal(step_dir: str | os.PathLike) -> None:
  """Writes ``step_dir/checksums.json`` for the complete step in ``step_dir``."""
  step_dir = epath.Path(step_dir)
  remote = storage.is_remote(step_dir)
  table = {rel: _digest(step_dir / rel, remote) for rel in _files(step_dir)}
  text = json.dumps({"files": table}, sort_keys=True)
  if remote:  # an object appears whole or not at all
    (step_dir / CHECKSUMS).write_text(text)
    return
  tmp = step_dir / (CHECKSUMS + ".tmp")  # a kill mid-write leaves no truncated list
  tmp.write_text(text)
  os.replace(tmp, step_dir / CHECKSUMS)


def verify(step_dir: str | os.PathLike) -> bool:
  """Checks ``step_dir`` against its checksum list; False if it has none (not checked).

  Raises:
    CheckpointCorruptError: a listed file is missing or differs (the message names it).
  """
  step_dir = epath.Path(step_dir)
  listing = step_dir / CHECKSUMS
  if not listing.exists():
    return False
  try:  # {"files": {relative path: {"size": int, "sha256": str (local only)}}}
    table = json.loads(listing.read_text())["files"]
    wanted = sorted((str(rel), int(want["size"]), want.get("sha256"))
                    for rel, want in table.items())
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise CheckpointCorruptError(f"{listing} is unreadable ({type(e).__name__}: {e})") from e
  remote = storage.is_remote(step_dir)
  for rel, size, sha in wanted:
    path = step_dir / rel
    if not path.exists():
      raise CheckpointCorruptError(f"{path} is missing")
    got = _digest(path, remote)
    if got["size"] != size:
      raise CheckpointCorruptError(f"{path} has {got['size']} bytes, {size} were saved")
    if sha is not None and "sha256" in got and got["sha256"] != sha:
      raise CheckpointCorruptError(f"{path} differs from what was saved (sha256)")
  return True


def set_aside(step_dir: str | os.PathLike) -> str:
  """Renames ``step_dir`` to ``<step_dir>.damaged`` (``.damaged.1``, ... if taken); returns
  the new path. The files are kept for inspection; the step no longer counts as saved."""
  step_dir = os.fspath(step_dir)
  target, n = f"{step_dir}.damaged", 0
  while epath.Path(target).exists():
    n += 1
    target = f"{step_dir}.damaged.{n}"
  storage.replace(step_dir, target)
  return target
