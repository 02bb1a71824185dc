"""Where the mesh meets the step: the shardings every jitted step is compiled with, and the
placement of host batches as global arrays.

One table decides everything (``rl_jax.sharding``): parameters and optimizer state follow
the rule set's logical axes (FSDP: sharded over ``fsdp``, all-gathered layer by layer inside
the step, gradients reduce-scattered back), and every batch array is split along its
leading axis, logical ``batch`` -> ``(data, fsdp)``, so each device computes only its slice.
A leading axis that the batch mesh axes do not divide stays replicated (correct, slower).

``Layout.put`` builds a global array from this process's rows with
``jax.make_array_from_process_local_data``; with one process the rows are the whole batch.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from rl_jax import sharding
from rl_jax.train.context import Setup
from rl_jax.train.state import TrainState, abstract_state

__all__ = ["Layout", "make_layout", "jit_on_mesh"]


class Layout(NamedTuple):
  """The shardings of one run: the train state's (``state``) and the mesh / rules that
  place batches and constrain activations."""

  mesh: jax.sharding.Mesh
  rules: str
  state: TrainState  # a TrainState of NamedShardings

  @property
  def replicated(self) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

  def rows(self, n: int) -> jax.sharding.NamedSharding:
    """Sharding of every batch array with ``n`` rows (any rank): the leading axis over
    ``batch`` -> (data, fsdp) when they divide ``n``, the other axes replicated."""
    return jax.sharding.NamedSharding(
        self.mesh, sharding.logical_to_spec(("batch",), self.rules, self.mesh, (n,)))

  def put(self, x: Any) -> jax.Array:
    """A host batch (this process's rows) as a global array sharded along ``batch``."""
    x = np.asarray(x)
    global_shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
    return jax.make_array_from_process_local_data(self.rows(global_shape[0]), x, global_shape)

  @contextlib.contextmanager
  def active(self):
    """Trace-time context: ``sharding.constrain`` in the model and losses pins activations."""
    with sharding.use(self.mesh, self.rules):
      yield


def make_layout(s: Setup) -> Layout:
  """The run's layout; the state shardings come from ``abstract_state`` (nothing computed)."""
  shardings = jax.tree.map(lambda x: x.sharding, abstract_state(s))
  return Layout(mesh=s.mesh, rules=s.rules, state=shardings)


def jit_on_mesh(fn: Callable, layout: Layout, **jit_kwargs) -> Callable:
  """``jax.jit(fn, **jit_kwargs)`` traced inside ``layout.active()``."""

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    with layout.active():
      return fn(*args, **kwargs)

  return jax.jit(traced, **jit_kwargs)
