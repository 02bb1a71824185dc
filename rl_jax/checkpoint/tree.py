"""The train state as orbax stores it: a nested dict keyed by leaf paths, plus a manifest.

Any registered pytree (dict, NamedTuple, dataclass, flax State) is flattened into
``"params/w"``-style paths; the nested dict of those paths is what orbax writes, and the
manifest records every leaf's shape and dtype so restore can name the first difference
before reading any array.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from rl_jax.errors import CheckpointError

__all__ = ["leaf_paths", "nest", "unnest", "savable", "describe", "target_spec",
           "mismatches", "finish"]


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


def nest(paths: list[str], values: list[Any]) -> dict[str, Any]:
  """``["a/b", "a/c"], [1, 2]`` -> ``{"a": {"b": 1, "c": 2}}``."""
  nested: dict[str, Any] = {}
  for path, value in zip(paths, values):
    node = nested
    *parents, last = path.split("/")
    for part in parents:
      node = node.setdefault(part, {})
    node[last] = value
  return nested


def unnest(nested: Mapping[str, Any], paths: list[str]) -> list[Any]:
  """The values of ``nested`` at ``paths``, in order (inverse of ``nest``)."""
  out = []
  for path in paths:
    node: Any = nested
    for part in path.split("/"):
      node = node[part]
    out.append(node)
  return out


def savable(path: str, leaf: Any) -> Any:
  """The value handed to orbax for one leaf; host values are copied (async-safe)."""
  if isinstance(leaf, jax.Array):
    return leaf
  if isinstance(leaf, (np.ndarray, np.generic)):
    return np.array(leaf, copy=True)
  if isinstance(leaf, (bool, int, float)):
    return np.asarray(leaf)
  raise CheckpointError(f"state leaf {path!r} is a {type(leaf).__name__}; checkpoints hold "
                        "arrays and numbers only (put other values in metadata)")


def describe(leaf: Any) -> dict[str, Any]:
  """The manifest entry of one leaf: ``{"shape": [...], "dtype": "float32"}``."""
  return {"shape": [int(d) for d in np.shape(leaf)], "dtype": str(leaf.dtype)}


def target_spec(path: str, leaf: Any) -> tuple[Any, dict[str, Any]]:
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
    return np.zeros(np.shape(leaf), leaf.dtype), describe(leaf)
  if isinstance(leaf, (bool, int, float)):
    value = np.asarray(leaf)
    return value, describe(value)
  raise CheckpointError(f"restore target leaf {path!r} is a {type(leaf).__name__}; use "
                        "jax.ShapeDtypeStruct (with .sharding), jax.Array, np.ndarray or a number")


def mismatches(saved: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
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


def finish(leaf: Any, value: Any) -> Any:
  """Converts one restored value to the target leaf's kind (numpy / Python number)."""
  if isinstance(leaf, (bool, int, float)):
    return type(leaf)(np.asarray(value).item())
  if isinstance(leaf, (np.ndarray, np.generic)):
    return np.asarray(value, dtype=leaf.dtype).reshape(np.shape(leaf))
  return value
