"""Which steps exist, restore, and the ``Checkpointer`` that saves (see the package docstring)."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import jax
import orbax.checkpoint as ocp
from etils import epath

from rl_jax import storage
from rl_jax.checkpoint import integrity, tree
from rl_jax.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError

__all__ = ["STEP_NAMES", "Checkpointer", "latest_step", "all_steps", "restore", "read_metadata",
           "saved_leaves"]

STATE, METADATA, MANIFEST = "state", "metadata", "manifest"
_FORMAT = 1

# Whether a ``gs://`` checkpoint directory gets OCDBT by default. Off: OCDBT commits its
# ``manifest.ocdbt`` with generation-conditional reads and writes, which gcp-storage-emulator
# does not serve (it ignores ``ifGenerationNotMatch`` and sends no ``x-goog-generation``
# header, so tensorstore's next conditional write fails with "Malformed StorageGeneration"
# once a save commits the manifest more than once). Plain zarr arrays need none of that.
REMOTE_OCDBT = False

# The one definition of "a step exists": orbax's standard step name (``<step>``, no padding)
# for a directory that holds orbax's commit marker. Saves go through a tmp directory that is
# renamed only after the marker is written, so a save in flight or cut short never matches.
# ``Checkpointer`` hands this to its CheckpointManager; the module functions query it directly.
STEP_NAMES = ocp.path.step.standard_name_format(
    temporary_path_cls=ocp.path.atomicity.CommitFileTemporaryPath)


# ------------------------------------------------------------------ finding steps
def all_steps(directory: str | os.PathLike) -> list[int]:
  """Steps with a complete checkpoint in ``directory``, ascending ([] if none or no dir)."""
  return sorted(m.step for m in STEP_NAMES.find_all(epath.Path(directory)))


def latest_step(directory: str | os.PathLike) -> int | None:
  """The newest complete step in ``directory``, or None. Temporary/partial saves are ignored."""
  latest = ocp.path.step.latest_step_metadata(epath.Path(directory), STEP_NAMES)
  return None if latest is None else latest.step


def _step_path(directory: epath.Path, step: int | None) -> epath.Path:
  """The directory of ``step`` (None: the latest); CheckpointNotFoundError if incomplete."""
  if step is None:
    latest = ocp.path.step.latest_step_metadata(directory, STEP_NAMES)
    if latest is None:
      why = "" if directory.is_dir() else " (the directory does not exist)"
      raise CheckpointNotFoundError(f"no complete checkpoint in {directory}{why}")
    return latest.path
  try:
    return STEP_NAMES.find_step(directory, step).path
  except ValueError:
    raise CheckpointNotFoundError(f"no complete checkpoint for step {step} in {directory}; "
                                  f"complete steps: {all_steps(directory)}") from None


# ------------------------------------------------------------------ restore
def _restore_items(step_dir: epath.Path, **items: ocp.args.CheckpointArgs) -> Any:
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  try:
    return checkpointer.restore(step_dir, args=ocp.args.Composite(**items))
  except CheckpointError:
    raise
  except Exception as e:  # Unreadable or corrupted files; name the directory.
    first = (str(e).strip().splitlines() or [""])[0]
    raise CheckpointCorruptError(f"cannot read checkpoint {step_dir}: {type(e).__name__}: {first}") from e


def read_metadata(directory: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
  """The metadata dict saved with ``step`` (default: the latest complete step)."""
  step_dir = _step_path(epath.Path(directory), step)
  return dict(_restore_items(step_dir, **{METADATA: ocp.args.JsonRestore()})[METADATA] or {})


def saved_leaves(directory: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
  """``{leaf path: {"shape": [...], "dtype": str}}`` of the state saved at ``step`` (default:
  the latest complete step), read from its manifest without reading any array."""
  step_dir = _step_path(epath.Path(directory), step)
  manifest = _restore_items(step_dir, **{MANIFEST: ocp.args.JsonRestore()})[MANIFEST] or {}
  return dict(manifest.get("leaves", {}))


def restore(directory: str | os.PathLike, abstract_state: Any,
            step: int | None = None) -> tuple[Any, dict[str, Any]]:
  """Restores ``step`` (default: latest complete) from ``directory`` onto ``abstract_state``.

  Args:
    directory: the checkpoint directory (holding ``<step>/`` subdirectories).
    abstract_state: a pytree with the saved structure; see the package docstring for leaves.
    step: which step; None means the newest complete one.

  Returns:
    ``(state, metadata)``: ``state`` has ``abstract_state``'s tree type, shapes, dtypes and
    shardings; ``metadata`` is the dict given to ``save`` (``{}`` if none).

  Raises:
    CheckpointNotFoundError: no complete checkpoint (for ``step``) in ``directory``.
    CheckpointCorruptError: a file of the step is missing, changed since it was saved
      (``integrity``) or unreadable.
    CheckpointError: the target's structure, a shape or key-ness differs from the checkpoint
      (the message names the first differing leaf).
  """
  step_dir = _step_path(epath.Path(directory), step)
  integrity.verify(step_dir)
  paths, leaves, treedef = tree.leaf_paths(abstract_state)
  specs = [tree.target_spec(p, leaf) for p, leaf in zip(paths, leaves)]
  manifest = _restore_items(step_dir, **{MANIFEST: ocp.args.JsonRestore()})[MANIFEST] or {}
  problems = tree.mismatches(manifest.get("leaves", {}), {p: s[1] for p, s in zip(paths, specs)})
  if problems:
    more = f" (and {len(problems) - 1} more differences)" if len(problems) > 1 else ""
    raise CheckpointError(f"checkpoint {step_dir} does not match the restore target: "
                          f"{problems[0]}{more}")
  target = tree.nest(paths, [s[0] for s in specs])
  items = _restore_items(step_dir, **{STATE: ocp.args.StandardRestore(target),
                                      METADATA: ocp.args.JsonRestore()})
  values = tree.unnest(items[STATE], paths)
  state = jax.tree_util.tree_unflatten(
      treedef, [tree.finish(leaf, v) for leaf, v in zip(leaves, values)])
  return state, dict(items[METADATA] or {})


# ------------------------------------------------------------------ the manager
def _check_count(name: str, value: Any, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise CheckpointError(f"checkpoint {name} must be an int >= {minimum}, got {value!r}")
  return value


def _json_copy(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
  if metadata is None:
    return {}
  if not isinstance(metadata, Mapping):
    raise CheckpointError(f"checkpoint metadata must be a dict, got {type(metadata).__name__}")
  try:
    return json.loads(json.dumps(dict(metadata), allow_nan=True))
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"checkpoint metadata is not JSON-serialisable: {e}") from e


class Checkpointer:
  """Saves the train state every ``save_every`` steps into ``directory``, keeping ``keep``.

  A thin layer over ``orbax.checkpoint.CheckpointManager``, which owns the step list (which
  steps are saved, including one still being written), the save interval, the deletion of
  old steps and the cleanup of unfinished saves left by a crash.

  Saving is asynchronous by default: ``save`` returns once every array has been copied off
  the device (so the caller may donate or overwrite the state right away) and writes files
  in a background thread; the next ``save``, ``restore``, ``wait`` and ``close`` wait for it.
  Until it is complete, a save in flight is invisible to the module-level ``latest_step`` /
  ``restore`` (another process reading the directory).

  Usage::

    ckpt = checkpoint.Checkpointer(workdir + "/checkpoints", keep=3, save_every=100)
    if ckpt.latest_step() is not None:
      state, meta = ckpt.restore(abstract_state)
    for step in range(start, steps + 1):
      state = train_step(state, ...)
      ckpt.save(step, state, metadata={"data_position": pos})
    ckpt.save(steps, state, force=True)
    ckpt.close()

  Must be called from every process in a multi-host run (orbax coordinates the writes).
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int | None = 3,
               save_every: int = 1, async_save: bool = True, use_ocdbt: bool | None = None,
               writable_checked: bool = False):
    """Opens (creating if needed) ``directory``; deletes unfinished saves of earlier runs.

    Args:
      directory: where step directories go; created with parents.
      keep: how many of the newest checkpoints to keep; None keeps all.
      save_every: ``should_save(step)`` is true for multiples of this; 0 means only forced
        saves.
      async_save: write files in a background thread.
      use_ocdbt: store the arrays in one OCDBT database per process (orbax's default) rather
        than one zarr directory per array. None: OCDBT for a local directory, not for a
        ``gs://`` one (``REMOTE_OCDBT``). Restore reads either layout.
      writable_checked: the caller has checked that ``directory`` can be written
        (``storage.check_writable``), so the first ``save`` does not check it again.
    """
    if keep is not None:
      _check_count("keep", keep, 1)
    self.save_every = _check_count("save_every", save_every, 0)
    self.keep = keep
    self.directory = epath.Path(directory)
    try:
      self.directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise CheckpointError(f"cannot create checkpoint directory {self.directory}: {e}") from e
    # Only the interval decides: orbax's default policy would also save the first step of a
    # fresh run, and every step on a preemption notice.
    if save_every:
      policy = ocp.checkpoint_managers.FixedIntervalPolicy(save_every)
    else:
      policy = ocp.checkpoint_managers.SpecificStepsPolicy(())
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        save_decision_policy=policy,
        step_name_format=STEP_NAMES,
        enable_async_checkpointing=async_save,
        enable_should_save_is_saving_in_progress_check=False,
        cleanup_tmp_directories=True,
        create=True,
    )
    if use_ocdbt is None:
      use_ocdbt = REMOTE_OCDBT or not storage.is_remote(self.directory)
    self.use_ocdbt = bool(use_ocdbt)
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
        STATE: ocp.StandardCheckpointHandler(use_ocdbt=self.use_ocdbt),
        METADATA: ocp.JsonCheckpointHandler(), MANIFEST: ocp.JsonCheckpointHandler()})
    self._unsealed: list[int] = []  # saved steps without their checksum list yet
    self._probed = bool(writable_checked)  # else the first save checks it

  def should_save(self, step: int) -> bool:
    """True when ``step`` is a positive multiple of ``save_every`` newer than every saved step."""
    return step > 0 and self._manager.should_save(step)

  def save(self, step: int, state: Any, metadata: Mapping[str, Any] | None = None,
           force: bool = False) -> bool:
    """Saves ``state`` (and JSON-able ``metadata``) as ``step`` if ``should_save`` or ``force``.

    Returns False without saving when the step is not due (and not forced) or is already
    saved; True when a save was started. See the class docstring for async semantics.

    Raises:
      CheckpointError: bad step, a forced step older than the latest saved one, a leftover
        ``<step>/`` directory that is not a complete checkpoint, a state leaf that is not an
        array or number, or metadata that is not JSON-serialisable.
      StorageError: the first save of this Checkpointer cannot write into the directory (one
        line, before orbax's background threads start on it).
    """
    step = _check_count("step", step, 0)
    if not (force or self.should_save(step)):
      return False
    self.wait()  # Orbax waits for the previous save anyway; surface its errors first.
    saved = self._manager.all_steps()
    if step in saved:
      return False
    newer = max(saved, default=None)
    if newer is not None and step < newer:
      raise CheckpointError(f"cannot save step {step} into {self.directory}: it holds the newer "
                            f"step {newer}")
    leftover = ocp.path.step.build_step_path(self.directory, STEP_NAMES, step)
    if leftover.exists():
      raise CheckpointError(f"cannot save step {step}: {leftover} exists but is not a complete "
                            "checkpoint; delete it")
    paths, leaves, _ = tree.leaf_paths(state)
    if not paths:
      raise CheckpointError("the state to checkpoint has no arrays")
    values = [tree.savable(p, leaf) for p, leaf in zip(paths, leaves)]
    if not self._probed:
      storage.check_writable(self.directory, "the checkpoint directory")
      self._probed = True
    manifest = {"format": _FORMAT, "leaves": {p: tree.describe(v) for p, v in zip(paths, values)}}
    self._manager.save(step, force=True, args=ocp.args.Composite(**{
        STATE: ocp.args.StandardSave(tree.nest(paths, values)),
        METADATA: ocp.args.JsonSave(_json_copy(metadata)),
        MANIFEST: ocp.args.JsonSave(manifest),
    }))
    self._unsealed.append(step)
    return True

  def incomplete_steps(self) -> list[int]:
    """Step directories without a finished save (no commit marker: a save cut short, or
    the marker lost since), ascending; ``save`` refuses to write over one."""
    self.wait()
    done = set(self._manager.all_steps())
    try:
      names = [p.name for p in self.directory.iterdir() if p.is_dir()]
    except FileNotFoundError:  # a bucket prefix that holds no object yet
      return []
    return sorted(int(n) for n in names if n.isdigit() and STEP_NAMES.build_name(int(n)) == n
                  and int(n) not in done)

  def all_steps(self) -> list[int]:
    """Saved steps, ascending, including a save still in flight (``wait()`` to finish it)."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest saved step (possibly still in flight), or None."""
    return self._manager.latest_step()

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """Waits for pending saves, then ``checkpoint.restore(self.directory, ...)``."""
    self.wait()
    return restore(self.directory, abstract_state, step)

  def metadata(self, step: int | None = None) -> dict[str, Any]:
    """The metadata dict of ``step`` (default: latest), without reading any array."""
    self.wait()
    return read_metadata(self.directory, step)

  def wait(self) -> None:
    """Blocks until every started save is complete on disk (and old steps are pruned),
    then writes the checksum list of each (``integrity.seal``; process 0)."""
    self._manager.wait_until_finished()
    self.seal_finished()

  def seal_finished(self) -> None:
    """Seals the saves that finished in the background, without waiting for one in flight
    (called once per training step, so a crash soon after a save leaves it checked)."""
    if not self._unsealed or self._manager.is_saving_in_progress():
      return
    done, self._unsealed = self._unsealed, []
    if jax.process_index() != 0:
      return
    for step in sorted(set(done) & set(self._manager.all_steps())):
      integrity.seal(ocp.path.step.build_step_path(self.directory, STEP_NAMES, step))

  def set_aside(self, step: int) -> str:
    """Renames the damaged ``step`` to ``<step>.damaged`` (kept, no longer a saved step);
    returns the new path. Every process calls this."""
    self.wait()
    path = ocp.path.step.build_step_path(self.directory, STEP_NAMES, step)
    target = f"{path}.damaged"
    if jax.process_index() == 0:
      target = integrity.set_aside(path)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
      multihost_utils.sync_global_devices(f"rl_jax checkpoint set_aside {step}")
    self._manager.reload()
    return target

  def close(self) -> None:
    """Waits for pending saves (sealing them) and releases orbax's resources."""
    self.wait()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
