"""Host offload of train-state parts with JAX memory kinds (``train.offload``).

An offloaded part lives between steps in the host memory of each device
(``memory_kind="pinned_host"``: page-locked host RAM the accelerator reads by DMA), with the
same ``NamedSharding`` layout it has on the device. The jitted steps that read it take it in
that memory kind, bring it into device memory inside the program (``to_device``) and, for a
part they update (the optimizer states), write it back to host memory through their
``out_shardings``. Between steps the device holds none of it; while such a step runs it
holds the part's device copy, so offload lowers the device memory of everything else (the
sampler and its KV cache, the log-prob passes) and not the peak of the step that reads it.

Parts (``OFFLOADABLE``): ``reference`` (the frozen KL reference, read only by the reference
log-prob pass), ``optimizer`` (the RL and supervised optimizer states and the critic's,
read and written by the update that owns each) and ``teacher`` (on-policy distillation's
frozen teacher, read only by its log-prob pass; ``rl_jax.train.teacher``). The values are unchanged by where they are
stored: training with offload computes exactly what it computes without.
"""

from __future__ import annotations

from typing import Any

import jax

from rl_jax import settings
from rl_jax.errors import ConfigError
from rl_jax.train.context import Setup

__all__ = ["OFFLOADABLE", "HOST", "offloaded_fields", "has_host_memory",
           "check_backend", "is_host", "host_sharding", "host_specs", "place", "to_device"]

# config name -> TrainState fields it moves to host memory
OFFLOADABLE = {"reference": ("ref_params",),
               "optimizer": ("opt_state", "sft_opt_state", "value_opt_state"),
               "teacher": ()}  # not in the TrainState: rl_jax.train.teacher places it
assert set(OFFLOADABLE) == set(settings.OFFLOAD_PARTS)
HOST = "pinned_host"


def has_host_memory(device) -> bool:
  """Whether ``device`` can address a ``pinned_host`` memory."""
  try:
    return any(m.kind == HOST for m in device.addressable_memories())
  except (AttributeError, NotImplementedError, RuntimeError):
    return False


def check_backend(names: tuple[str, ...], devices) -> None:
  """One error line if offload is requested and a device has no ``pinned_host`` memory."""
  if not names:
    return
  for d in devices:
    if not has_host_memory(d):
      raise ConfigError(
          f"config.train.offload={','.join(names)!r} needs a '{HOST}' memory, which "
          f"{d.platform} device {d.id} ({d.device_kind}) does not have; set "
          "--config.train.offload='' on this backend")


def offloaded_fields(s: Setup) -> tuple[str, ...]:
  """The TrainState fields this run keeps in host memory (checked against its mesh)."""
  names = s.train.offload_parts
  check_backend(names, s.mesh.devices.flat)
  return tuple(f for n in names for f in OFFLOADABLE[n])


def is_host(x) -> bool:
  """Whether an array (or ShapeDtypeStruct / sharding) is placed in host memory."""
  sh = x if isinstance(x, jax.sharding.Sharding) else getattr(x, "sharding", None)
  return getattr(sh, "memory_kind", None) == HOST


def host_sharding(sh: jax.sharding.Sharding) -> jax.sharding.Sharding:
  """The same layout in host memory."""
  return sh.with_memory_kind(HOST)


def host_specs(state, fields: tuple[str, ...]):
  """A TrainState of ShapeDtypeStructs with the leaves of ``fields`` in host memory."""
  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host_sharding(x.sharding))
  return state._replace(**{f: jax.tree.map(spec, getattr(state, f)) for f in fields})


def place(state, fields: tuple[str, ...]):
  """A concrete TrainState with the leaves of ``fields`` moved to host memory (same layout)."""
  move = lambda x: x if is_host(x) else jax.device_put(x, host_sharding(x.sharding))
  return state._replace(**{f: jax.tree.map(move, getattr(state, f)) for f in fields})


def to_device(tree: Any, offloaded: bool) -> Any:
  """Inside a jitted step: an offloaded input brought into device memory (unchanged when
  ``offloaded`` is false, so a run without offload compiles the same program as before)."""
  if not offloaded:
    return tree
  return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)
