"""Orbax save/restore of the whole train state, onto any mesh.

The train state is any pytree whose leaves are ``jax.Array`` (sharded or not, including
typed PRNG keys from ``jax.random.key`` and raw ``uint32`` keys), numpy arrays or Python
numbers: parameters, optax states (NamedTuples), the step, the data position and sampler
state. A small JSON-able ``metadata`` dict travels with it (config, data cursor, versions).

Layout of ``directory``::

    <directory>/<step>/state/      arrays (orbax, OCDBT/tensorstore)
                       metadata/   the user's JSON dict
                       manifest/   path -> shape/dtype of every leaf, checked on restore
                       commit_success.txt

Atomicity: orbax writes a step into ``<step>.orbax-checkpoint-tmp-<n>/`` and renames it to
``<step>/`` only after every file, the ``commit_success.txt`` marker included, is written.
``latest_step`` and ``restore`` only ever consider ``<step>/`` directories that hold the
marker and a manifest, so a crash mid-save leaves nothing that restore would pick up (orbax
deletes the stray tmp directory at the next save of a ``Checkpointer`` on the directory).

The pytree is stored as a nested dict keyed by the leaves' key paths (``params/w``,
``opt_state/0/mu/w``), so any registered pytree (NamedTuple, dataclass, flax State) works
and restore rebuilds the target's own tree type.

Restore takes an *abstract* target: a pytree matching the saved one, whose leaves say what
to build. Typically::

    abstract = jax.eval_shape(init_fn, rng)            # ShapeDtypeStructs
    shardings = sharding.logical_to_sharding(axes, mesh, rules, abstract)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)
    state, metadata = ckpt.restore(abstract)

Leaves of the target:
  ``jax.ShapeDtypeStruct``  restored as a jax.Array with that dtype and ``.sharding``
                            (no sharding: on the first local device); any mesh works.
  ``jax.Array``             as its ShapeDtypeStruct (same shape, dtype, sharding).
  ``np.ndarray``            restored as numpy with that dtype.
  ``int``/``float``/``bool`` restored as that Python type.
Shapes and the tree's key paths must match the checkpoint exactly, and a typed key must
restore into a typed key; other dtypes are cast (e.g. float32 weights into bfloat16).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from rl_jax.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["Checkpointer", "latest_step", "all_steps", "restore", "read_metadata"]

STATE, METADATA, MANIFEST = "state", "metadata", "manifest"
_FORMAT = 1
_COMMIT_FILE = ocp.path.atomicity.COMMIT_SUCCESS_FILE  # "commit_success.txt"


# ------------------------------------------------------------------ pytree <-> nested dict
def _entry_name(entry: Any) -> str:
  """One key-path entry as a string: dict key, attribute name or sequence index."""
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def leaf_paths(tree: Any) -> tuple[list[str], list[Any], Any]:
  """Flattens ``tree`` into (``"a/b/0"`` paths, leaves, treedef); paths must be unique."""
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths, leaves = [], []
  seen: dict[str, str] = {}
  for key_path, leaf in with_paths:
    parts = [_entry_name(e) for e in key_path] or ["<root>"]
    bad = [p for p in parts if not p or "/" in p]
    if bad:
      raise CheckpointError(f"state leaf {jax.tree_util.keystr(key_path)} has the key {bad[0]!r}; "
                            "checkpoint keys must be non-empty and contain no '/'")
    path = "/".join(parts)
    name = ".".join(parts)  # Orbax's own name for the leaf; must be unique too.
    if name in seen:
      raise CheckpointError(f"state leaves {seen[name]} and {jax.tree_util.keystr(key_path)} "
                            f"both map to the checkpoint key {name!r}")
    seen[name] = jax.tree_util.keystr(key_path)
    paths.append(path)
    leaves.append(leaf)
  return paths, leaves, treedef


def _nest(paths: list[str], values: list[Any]) -> dict[str, Any]:
  nested: dict[str, Any] = {}
  for path, value in zip(paths, values):
    node = nested
    *parents, last = path.split("/")
    for part in parents:
      node = node.setdefault(part, {})
    node[last] = value
  return nested


def _unnest(nested: Mapping[str, Any], paths: list[str]) -> list[Any]:
  out = []
  for path in paths:
    node: Any = nested
    for part in path.split("/"):
      node = node[part]
    out.append(node)
  return out


def _savable(path: str, leaf: Any) -> Any:
  """The value handed to orbax for one leaf; host values are copied (async-safe)."""
  if isinstance(leaf, jax.Array):
    return leaf
  if isinstance(leaf, (np.ndarray, np.generic)):
    return np.array(leaf, copy=True)
  if isinstance(leaf, (bool, int, float)):
    return np.asarray(leaf)
  raise CheckpointError(f"state leaf {path!r} is a {type(leaf).__name__}; checkpoints hold "
                        "arrays and numbers only (put other values in metadata)")


def _describe(leaf: Any) -> dict[str, Any]:
  return {"shape": [int(d) for d in np.shape(leaf)], "dtype": str(leaf.dtype)}


# ------------------------------------------------------------------ finding steps
def _step_dir(directory: epath.Path, step: int) -> epath.Path:
  return directory / str(step)


def _is_complete(step_dir: epath.Path) -> bool:
  return ((step_dir / _COMMIT_FILE).exists() and (step_dir / MANIFEST).is_dir()
          and (step_dir / STATE).is_dir())


def all_steps(directory: str | os.PathLike) -> list[int]:
  """Steps with a complete checkpoint in ``directory``, ascending ([] if none or no dir)."""
  directory = epath.Path(directory)
  if not directory.is_dir():
    return []
  steps = [int(p.name) for p in directory.iterdir()
           if p.name.isdigit() and p.is_dir() and _is_complete(p)]
  return sorted(steps)


def latest_step(directory: str | os.PathLike) -> int | None:
  """The newest complete step in ``directory``, or None. Temporary/partial saves are ignored."""
  steps = all_steps(directory)
  return steps[-1] if steps else None


def _resolve_step(directory: epath.Path, step: int | None) -> int:
  steps = all_steps(directory)
  if step is None:
    if not steps:
      why = "" if directory.is_dir() else " (the directory does not exist)"
      raise CheckpointNotFoundError(f"no complete checkpoint in {directory}{why}")
    return steps[-1]
  if step not in steps:
    raise CheckpointNotFoundError(f"no complete checkpoint for step {step} in {directory}; "
                                  f"complete steps: {steps}")
  return step


# ------------------------------------------------------------------ restore
def _restore_items(step_dir: epath.Path, **items: ocp.args.CheckpointArgs) -> Any:
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  try:
    return checkpointer.restore(step_dir, args=ocp.args.Composite(**items))
  except CheckpointError:
    raise
  except Exception as e:  # Unreadable or corrupted files; name the directory.
    first = (str(e).strip().splitlines() or [""])[0]
    raise CheckpointError(f"cannot read checkpoint {step_dir}: {type(e).__name__}: {first}") from e


def read_metadata(directory: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
  """The metadata dict saved with ``step`` (default: the latest complete step)."""
  directory = epath.Path(directory)
  step_dir = _step_dir(directory, _resolve_step(directory, step))
  return dict(_restore_items(step_dir, **{METADATA: ocp.args.JsonRestore()})[METADATA] or {})


def _target_spec(path: str, leaf: Any) -> tuple[Any, dict[str, Any]]:
  """(what orbax restores into, shape/dtype description) for one leaf of the target."""
  if isinstance(leaf, jax.Array):
    leaf = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
  if isinstance(leaf, jax.ShapeDtypeStruct):
    sharding = leaf.sharding
    if sharding is None:
      sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return (jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            {"shape": list(leaf.shape), "dtype": str(leaf.dtype)})
  if isinstance(leaf, (np.ndarray, np.generic)):
    return np.zeros(np.shape(leaf), leaf.dtype), _describe(leaf)
  if isinstance(leaf, (bool, int, float)):
    value = np.asarray(leaf)
    return value, _describe(value)
  raise CheckpointError(f"restore target leaf {path!r} is a {type(leaf).__name__}; use "
                        "jax.ShapeDtypeStruct (with .sharding), jax.Array, np.ndarray or a number")


def _mismatches(saved: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
  """Human-readable differences between the checkpoint's manifest and the target."""
  problems = []
  for path, want in wanted.items():
    have = saved.get(path)
    if have is None:
      problems.append(f"the target's leaf {path!r} is not in the checkpoint")
    elif list(have["shape"]) != list(want["shape"]):
      problems.append(f"leaf {path!r} has shape {tuple(have['shape'])} in the checkpoint but "
                      f"the target wants {tuple(want['shape'])}")
    elif have["dtype"].startswith("key<") != want["dtype"].startswith("key<"):
      problems.append(f"leaf {path!r} has dtype {have['dtype']} in the checkpoint but the target "
                      f"wants {want['dtype']} (typed vs raw PRNG key)")
  extra = sorted(set(saved) - set(wanted))
  problems += [f"the checkpoint's leaf {p!r} is not in the target" for p in extra]
  return problems


def _finish(leaf: Any, value: Any) -> Any:
  """Converts one restored value to the target leaf's kind (numpy / Python number)."""
  if isinstance(leaf, (bool, int, float)):
    return type(leaf)(np.asarray(value).item())
  if isinstance(leaf, (np.ndarray, np.generic)):
    return np.asarray(value, dtype=leaf.dtype).reshape(np.shape(leaf))
  return value


def restore(directory: str | os.PathLike, abstract_state: Any,
            step: int | None = None) -> tuple[Any, dict[str, Any]]:
  """Restores ``step`` (default: latest complete) from ``directory`` onto ``abstract_state``.

  Args:
    directory: the checkpoint directory (holding ``<step>/`` subdirectories).
    abstract_state: a pytree with the saved structure; see the module docstring for leaves.
    step: which step; None means the newest complete one.

  Returns:
    ``(state, metadata)``: ``state`` has ``abstract_state``'s tree type, shapes, dtypes and
    shardings; ``metadata`` is the dict given to ``save`` (``{}`` if none).

  Raises:
    CheckpointNotFoundError: no complete checkpoint (for ``step``) in ``directory``.
    CheckpointError: the target's structure, a shape or key-ness differs from the checkpoint
      (the message names the first differing leaf), or the files cannot be read.
  """
  directory = epath.Path(directory)
  step = _resolve_step(directory, step)
  step_dir = _step_dir(directory, step)
  paths, leaves, treedef = leaf_paths(abstract_state)
  specs = [_target_spec(p, leaf) for p, leaf in zip(paths, leaves)]
  manifest = _restore_items(step_dir, **{MANIFEST: ocp.args.JsonRestore()})[MANIFEST] or {}
  problems = _mismatches(manifest.get("leaves", {}), {p: s[1] for p, s in zip(paths, specs)})
  if problems:
    more = f" (and {len(problems) - 1} more differences)" if len(problems) > 1 else ""
    raise CheckpointError(f"checkpoint {step_dir} does not match the restore target: "
                          f"{problems[0]}{more}")
  target = _nest(paths, [s[0] for s in specs])
  items = _restore_items(step_dir, **{STATE: ocp.args.StandardRestore(target),
                                      METADATA: ocp.args.JsonRestore()})
  values = _unnest(items[STATE], paths)
  state = jax.tree_util.tree_unflatten(treedef, [_finish(l, v) for l, v in zip(leaves, values)])
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

  Saving is asynchronous by default: ``save`` returns once every array has been copied off
  the device (so the caller may donate or overwrite the state right away) and writes files
  in a background thread; the next ``save``, ``restore``, ``wait`` and ``close`` wait for it.
  A save in flight is never visible to ``latest_step``/``restore`` until it is complete.

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
               save_every: int = 1, async_save: bool = True):
    """Opens (creating if needed) ``directory``.

    Args:
      directory: where step directories go; created with parents.
      keep: how many of the newest checkpoints to keep; None keeps all.
      save_every: ``should_save(step)`` is true for multiples of this; 0 means only forced
        saves.
      async_save: write files in a background thread.
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
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
        create=True,
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=(STATE, METADATA, MANIFEST))

  def should_save(self, step: int) -> bool:
    """True when ``step`` is a positive multiple of ``save_every``."""
    return self.save_every > 0 and step > 0 and step % self.save_every == 0

  def save(self, step: int, state: Any, metadata: Mapping[str, Any] | None = None,
           force: bool = False) -> bool:
    """Saves ``state`` (and JSON-able ``metadata``) as ``step`` if due or ``force``.

    Returns False without saving when the step is not due (and not forced) or is already
    saved; True when a save was started. See the class docstring for async semantics.

    Raises:
      CheckpointError: bad step, a step older than the latest saved one, a state leaf that
        is not an array or number, or metadata that is not JSON-serialisable.
    """
    step = _check_count("step", step, 0)
    if not (force or self.should_save(step)):
      return False
    self.wait()  # Orbax waits for the previous save anyway; settle the step list first.
    known, complete = self._manager.all_steps(), set(self.all_steps())
    if step in known:
      if step in complete:
        return False
      raise CheckpointError(f"cannot save step {step}: {_step_dir(self.directory, step)} exists "
                            "but is not a complete checkpoint; delete it")
    newer = max(known, default=None)
    if newer is not None and step < newer:
      debris = "" if newer in complete else " (an incomplete checkpoint directory; delete it)"
      raise CheckpointError(f"cannot save step {step} into {self.directory}: it holds the newer "
                            f"step {newer}{debris}")
    paths, leaves, _ = leaf_paths(state)
    if not paths:
      raise CheckpointError("the state to checkpoint has no arrays")
    values = [_savable(p, leaf) for p, leaf in zip(paths, leaves)]
    manifest = {"format": _FORMAT, "leaves": {p: _describe(v) for p, v in zip(paths, values)}}
    self._manager.save(step, force=True, args=ocp.args.Composite(**{
        STATE: ocp.args.StandardSave(_nest(paths, values)),
        METADATA: ocp.args.JsonSave(_json_copy(metadata)),
        MANIFEST: ocp.args.JsonSave(manifest),
    }))
    return True

  def all_steps(self) -> list[int]:
    """Complete steps on disk, ascending (a save still in flight is not included)."""
    return all_steps(self.directory)

  def latest_step(self) -> int | None:
    """Newest complete step on disk, or None (``wait()`` first to include a save in flight)."""
    return latest_step(self.directory)

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """Waits for pending saves, then ``checkpoint.restore(self.directory, ...)``."""
    self.wait()
    return restore(self.directory, abstract_state, step)

  def metadata(self, step: int | None = None) -> dict[str, Any]:
    """The metadata dict of ``step`` (default: latest), without reading any array."""
    self.wait()
    return read_metadata(self.directory, step)

  def wait(self) -> None:
    """Blocks until every started save is complete on disk (and old steps are pruned)."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases orbax's resources."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

