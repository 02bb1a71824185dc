"""Logical axis names -> mesh axes: the one table every array in rl_jax goes through.

Every parameter and activation axis carries a *logical* name (``"embed"``, ``"q_heads"``,
``"batch"`` ...). A rule set maps each logical name to zero, one or several *mesh* axes
(``data``, ``fsdp``, ``sequence``, ``tensor``). Swapping the rule set re-shards the whole
program without touching model code.

Mesh axes:
  data      pure data parallelism (parameters replicated)
  fsdp      data parallelism with parameters sharded (ZeRO-3 style)
  sequence  sequence / context parallelism (activations and KV cache along length)
  tensor    tensor (Megatron) parallelism over heads and the MLP hidden dimension

Usage::

    mesh = sharding.make_mesh({"fsdp": 8})
    rules = sharding.RULES["fsdp"]
    shardings = sharding.logical_to_sharding(models.param_axes(cfg), mesh, rules)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import pallas_kernels

__all__ = ["MESH_AXES", "RULES", "LogicalAxes", "Rules", "active", "constrain", "get_rules",
           "logical_to_sharding", "logical_to_spec", "make_mesh", "platform", "use"]

MESH_AXES = ("data", "fsdp", "sequence", "tensor")

# A logical axes tuple, e.g. ("layers", "embed", "q_heads", "head_dim"); None = never sharded.
LogicalAxes = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class Rules:
  """A named logical->mesh mapping. ``table`` maps a logical name to a tuple of mesh axes."""

  name: str
  table: tuple[tuple[str, tuple[str, ...]], ...]

  def lookup(self, logical: str | None) -> tuple[str, ...]:
    if logical is None:
      return ()
    for key, value in self.table:
      if key == logical:
        return value
    return ()


def _rules(name: str, **table: tuple[str, ...]) -> Rules:
  return Rules(name, tuple(table.items()))


# Activations: batch over (data, fsdp); length over sequence. Parameters as the rule set says.
_ACTIVATIONS = dict(batch=("data", "fsdp"), length=("sequence",), kv_length=("sequence",))

RULES: dict[str, Rules] = {
    # Everything replicated (one device, or debugging).
    "replicated": _rules("replicated"),
    # Pure data parallel: batch split, parameters replicated.
    "data": _rules("data", batch=("data", "fsdp")),
    # FSDP: parameters sharded along their model dimension over `fsdp`.
    # Expert weights [Y,E,...] are sharded over their expert axis (the first logical axis wins
    # the mesh axis, so their model dim stays whole): expert parallelism on the fsdp axis.
    "fsdp": _rules("fsdp", expert=("fsdp",), embed=("fsdp",), **_ACTIVATIONS),
    # FSDP + tensor parallel: heads / MLP hidden / vocab over `tensor`, model dim over `fsdp`.
    "fsdp_tp": _rules(
        "fsdp_tp",
        expert=("fsdp",),
        embed=("fsdp",),
        q_heads=("tensor",),
        kv_heads=("tensor",),
        mlp=("tensor",),
        vocab=("tensor",),
        act_heads=("tensor",),
        act_kv_heads=("tensor",),
        act_mlp=("tensor",),
        **_ACTIVATIONS,
    ),
}


def get_rules(name_or_rules: str | Rules) -> Rules:
  if isinstance(name_or_rules, Rules):
    return name_or_rules
  if name_or_rules not in RULES:
    raise ValueError(f"unknown sharding rule set {name_or_rules!r}; choose one of {sorted(RULES)}")
  return RULES[name_or_rules]


def make_mesh(shape: Mapping[str, int] | None = None, devices: Sequence[Any] | None = None) -> Mesh:
  """A 4-axis mesh (data, fsdp, sequence, tensor); unspecified axes have size 1.

  ``shape=None`` puts every device on ``fsdp``. Axis types are Auto so the compiler
  propagates shardings from the annotated inputs and parameters.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = dict(shape or {"fsdp": len(devices)})
  unknown = set(shape) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"unknown mesh axes {sorted(unknown)}; mesh axes are {MESH_AXES}")
  sizes = tuple(int(shape.get(a, 1)) for a in MESH_AXES)
  if math.prod(sizes) != len(devices):
    raise ValueError(f"mesh shape {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                     f"have {len(devices)}")
  arr = np.asarray(devices, dtype=object).reshape(sizes)
  return Mesh(arr, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(axes: LogicalAxes, rules: str | Rules, mesh: Mesh | None = None,
                    shape: Sequence[int] | None = None) -> P:
  """PartitionSpec for one array. A mesh axis is used at most once (first logical axis wins).

  If ``mesh`` and ``shape`` are given, a mesh axis whose size does not divide the dimension
  is dropped (the dimension stays replicated over it) so odd sizes never fail to shard.
  """
  rules = get_rules(rules)
  used: set[str] = set()
  spec = []
  for i, name in enumerate(axes):
    chosen = []
    for mesh_axis in rules.lookup(name):
      if mesh_axis in used:
        continue
      if mesh is not None:
        size = mesh.shape[mesh_axis]
        if size == 1:
          continue
        cur = math.prod(mesh.shape[a] for a in chosen) * size
        if shape is not None and shape[i] % cur != 0:
          continue
      chosen.append(mesh_axis)
      used.add(mesh_axis)
    spec.append(tuple(chosen) if len(chosen) > 1 else (chosen[0] if chosen else None))
  return P(*spec)


def _is_axes(x: Any) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def logical_to_sharding(axes_tree: Any, mesh: Mesh, rules: str | Rules, shapes_tree: Any = None):
  """Map a pytree of logical-axes tuples (and optional matching shapes) to NamedShardings."""
  if shapes_tree is None:
    return jax.tree.map(lambda a: NamedSharding(mesh, logical_to_spec(a, rules, mesh)),
                        axes_tree, is_leaf=_is_axes)
  return jax.tree.map(
      lambda a, s: NamedSharding(mesh, logical_to_spec(a, rules, mesh, getattr(s, "shape", s))),
      axes_tree, shapes_tree, is_leaf=_is_axes)


# ---------------------------------------------------------------- activation constraints
_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "rl_jax_sharding", default=None)


@contextlib.contextmanager
def use(mesh: Mesh, rules: str | Rules):
  """Within this context (at trace time), ``constrain`` pins activations to the rules, and
  the kernels the traced program picks (``platform``, ``pallas_kernels.target_platform``)
  are those of the mesh's devices, which need not be this host's (an abstract TPU
  topology's devices, ``rl_jax.train.topology``)."""
  token = _ACTIVE.set((mesh, get_rules(rules)))
  try:
    with pallas_kernels.target_platform(mesh.devices.flat[0].platform):
      yield
  finally:
    _ACTIVE.reset(token)


def active() -> tuple[Mesh, Rules] | None:
  """The (mesh, rules) pinned by the innermost ``sharding.use``, or None outside one."""
  return _ACTIVE.get()


def platform() -> str:
  """The platform of the devices the program being traced is for: the active mesh's
  (``use``), else ``jax.default_backend()``."""
  active_ = _ACTIVE.get()
  return active_[0].devices.flat[0].platform if active_ is not None else jax.default_backend()


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
  """``with_sharding_constraint`` by logical names; a no-op outside ``sharding.use`` and on a
  one-device mesh (nothing to pin there; the constraints would only cost compile time)."""
  active = _ACTIVE.get()
  if active is None:
    return x
  mesh, rules = active
  if mesh.size == 1:  # nothing to pin; a constraint would only cost compile time
    return x
  spec = logical_to_spec(axes, rules, mesh, x.shape)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
