"""Adapter-only checkpoints of LoRA runs: the frozen base is written once, not every step.

With ``model.lora.rank > 0`` only the adapters train, so a checkpoint's ``params`` hold the
adapters alone (``params/layers/lora/...``; their optimizer states, the step, the producer
and the queue as ever), and the frozen base comes from one of two places, which the
checkpoint's metadata names (``metadata["lora_base"]["source"]``):

* ``"config"``: the base the run's config builds (``state.init_params``: ``model.hf_path``
  or the seeded random init, quantised with ``model.lora.quant``). It is the base until a
  supervised warm start's adapters are merged into it at the first RL step
  (``state.begin_rl``), so the checkpoints of a run with ``sft.steps=0`` and those of the
  supervised stage store no base at all; restore rebuilds it (``config_base``).
* ``"stored"``: any other base (the merged one of the RL stage after a warm start, or a state
  handed to ``rl_jax.api``), written once into ``<checkpoint directory>/base/`` (an orbax
  checkpoint of the base alone, atomic and checksummed like every step; its step number is
  ``metadata["lora_base"]["step"]``) before the first checkpoint that needs it, through the
  same ``rl_jax.checkpoint`` code (so on a ``gs://`` workdir as well).

Either way the metadata records a fingerprint of the base's bits (``fingerprint``), and
restore checks the base it rebuilt or read against it: a changed ``model.hf_path`` or a base
of another run fails in one line instead of resuming on other weights. A stored base that is
missing or damaged makes its checkpoints unreadable (``BaseCorruptError``: the resume sets
the base aside, then the checkpoints that read it, and falls back to an older one; the next
checkpoint that needs a stored base writes a fresh one, as nothing is left to reuse). LoRA
checkpoints written before adapter-only checkpoints (full ``params``, no ``lora_base``) are
not read: ``resume.restore_state`` refuses them in one line, as every earlier state layout.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import checkpoint as ckpt_lib
from rl_jax import models
from rl_jax import storage
from rl_jax.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from rl_jax.train.context import Setup
from rl_jax.train.state import init_params

__all__ = ["KEY", "BASE_DIR", "BaseCorruptError", "base_dir", "config_base", "adapters_only",
           "fingerprint", "for_checkpoint", "base_info", "restore_base", "rejoin",
           "set_aside_base"]

KEY = "lora_base"  # the checkpoint metadata's entry
BASE_DIR = "base"  # <checkpoint directory>/base/<step>/: a stored base


class BaseCorruptError(CheckpointCorruptError):
  """The stored base a checkpoint reads is missing, damaged or not the one it was saved
  with; ``step``: its step in ``base_dir``."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


def base_dir(directory) -> str:
  """Where the stored base of the checkpoints in ``directory`` lives."""
  return storage.join(str(directory), BASE_DIR)


def config_base(s: Setup, step: int) -> bool:
  """Whether the trainer's base after ``step`` completed steps is the one the config builds:
  with ``sft.steps=0`` always, else through the supervised stage (``state.rl_layout``: the
  warm start's adapters are merged into the base when RL begins)."""
  return not s.sft.steps or step <= s.sft.steps


def adapters_only(params: dict) -> dict:
  """The part of ``params`` a LoRA checkpoint holds: ``{"layers": {"lora": adapters}}``."""
  return {"layers": {models.lora.KEY: models.lora.split(params)[1]}}


def _bits(x: jax.Array, offset=0) -> jax.Array:
  """An order-sensitive uint32 hash of ``x``'s bits: Σ bits(x_i)·(2(offset + i) + 1) mod 2³²,
  the position i from iotas (no reshape, so a sharded leaf is never gathered). Unsigned
  integer ``x`` is taken as the bits themselves (a float leaf's bitcast rows, ``_rows_bits``).
  ``offset``: a uint32 scalar added to every position."""
  if jnp.issubdtype(x.dtype, jnp.unsignedinteger) and x.dtype.itemsize <= 4:
    u = x.astype(jnp.uint32)
  elif jnp.issubdtype(x.dtype, jnp.floating):
    width = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
    u = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
  else:  # int4 / int8 quantised values, integer leaves
    u = jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32)
  index = jnp.zeros(x.shape, jnp.uint32) + jnp.asarray(offset, jnp.uint32)
  stride = 1
  for axis in reversed(range(x.ndim)):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * jnp.uint32(stride)
    stride = (stride * x.shape[axis]) % (1 << 32)
  return jnp.sum(u * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)


def _rows_bits(x: jax.Array) -> jax.Array:
  """``_bits(x)``, the same uint32, summed one row of the leading axis at a time (a stacked
  layer leaf: one layer at a time). The CPU backend splits a large sum into a tree whose
  first level reads a materialised ``bits·(2i + 1)`` array of the whole leaf, and one such
  uint32 array per leaf was alive at once (11 GB for a 4B model's int4 base); row by row the
  program holds one row's.

  The sum is exact: uint32 arithmetic wraps, so the rows' partial sums add up to the whole
  leaf's. The leaf goes through an optimisation barrier with the row index and is bitcast
  (floats) or sliced (integers) inside the loop, so no whole-leaf conversion is hoisted out
  of it (as ``models.transformer`` reads a frozen base)."""
  if x.ndim < 2 or x.shape[0] == 1 or (jnp.issubdtype(x.dtype, jnp.floating)
                                        and x.dtype.itemsize not in (2, 4)):
    return _bits(x)
  bits = {2: jnp.uint16, 4: jnp.uint32}.get(x.dtype.itemsize)
  floating = jnp.issubdtype(x.dtype, jnp.floating)
  row_size = int(np.prod(x.shape[1:], dtype=np.uint64) % (1 << 32))

  def row(i, total):
    stack, i = jax.lax.optimization_barrier((x, i))
    if floating:
      stack = jax.lax.bitcast_convert_type(stack, bits)
    r = jax.lax.dynamic_index_in_dim(stack, i, keepdims=False)
    return total + _bits(r, i.astype(jnp.uint32) * jnp.uint32(row_size))

  return jax.lax.fori_loop(0, x.shape[0], row, jnp.uint32(0))


_hashes = jax.jit(lambda leaves: jnp.stack([_rows_bits(x) for x in leaves]))


def fingerprint(params: dict) -> str:
  """A fingerprint of the frozen base in ``params`` (adapters ignored): every leaf's path,
  shape, dtype and bit hash (``_bits``), hashed. The same bits give the same string on any
  mesh; a collective with several processes (every process calls it)."""
  paths, leaves, _ = ckpt_lib.leaf_paths(models.lora.strip(params))
  sums = np.asarray(jax.device_get(_hashes(leaves)))
  h = hashlib.sha256()
  for p, x, v in zip(paths, leaves, sums):
    h.update(f"{p}:{tuple(x.shape)}:{x.dtype}:{int(v)};".encode())
  return h.hexdigest()[:32]


def _referenced(ckpt: ckpt_lib.Checkpointer, digest: str) -> list[int]:
  """Steps in ``ckpt``'s directory whose checkpoint reads the stored base ``digest``."""
  ckpt.wait()
  out = []
  for step in ckpt.all_steps():
    info = ckpt_lib.read_metadata(ckpt.directory, step).get(KEY) or {}
    if info.get("source") == "stored" and info.get("fingerprint") == digest:
      out.append(step)
  return out


def _store_base(ckpt: ckpt_lib.Checkpointer, params: dict, digest: str) -> int:
  """Writes the base of ``params`` into ``base_dir`` unless it already holds it; returns
  its step there. A different base is replaced (a new step, the old one pruned) only if no
  checkpoint of the directory reads it. Every process calls this (orbax writes
  collectively)."""
  path = base_dir(ckpt.directory)
  latest = ckpt_lib.latest_step(path)
  if latest is not None:
    have = ckpt_lib.read_metadata(path, latest).get("fingerprint")
    if have == digest:
      return latest
    users = _referenced(ckpt, have)
    if users:
      raise CheckpointError(
          f"{path} holds the frozen LoRA base of the checkpoints of steps {users}, not this "
          f"state's (fingerprint {have} vs {digest}); save into another directory")
  step = 0 if latest is None else latest + 1
  with ckpt_lib.Checkpointer(path, keep=1, save_every=0, async_save=False) as base:
    base.save(step, models.lora.strip(params), metadata={"fingerprint": digest}, force=True)
  return step


def for_checkpoint(s: Setup, ckpt: ckpt_lib.Checkpointer, state: Any, *,
                   from_config: bool) -> tuple[Any, dict]:
  """(the state to save, its metadata) for ``ckpt.save``: unchanged without LoRA; with LoRA
  the params cut to the adapters (``adapters_only``) and the base's source in the metadata.

  Args:
    from_config: the base is the config's (``config_base``; nothing is written). False:
      the base is written into ``base_dir`` first, unless it is there already (once per run).
  """
  if not s.model_cfg.lora_rank:
    return state, {}
  digest = fingerprint(state.params)
  info = {"source": "config", "fingerprint": digest}
  if not from_config:
    info = {"source": "stored", "step": _store_base(ckpt, state.params, digest),
            "fingerprint": digest}
  return state._replace(params=adapters_only(state.params)), {KEY: info}


def base_info(s: Setup, directory, step: int) -> dict | None:
  """The ``lora_base`` entry of the checkpoint of ``step`` (None: it holds full params, as a
  run without LoRA writes them)."""
  info = ckpt_lib.read_metadata(directory, step).get(KEY)
  if info and not s.model_cfg.lora_rank:
    raise CheckpointError(f"the checkpoint of step {step} in {directory} holds LoRA adapters "
                          "without their base, but model.lora.rank=0; resume with the config "
                          "it was written with")
  return info or None


def restore_base(s: Setup, directory, step: int, info: dict, abstract_params: dict) -> dict:
  """The frozen base of the checkpoint of ``step``: rebuilt from the config or read from
  ``base_dir`` onto ``abstract_params``' base (its shardings), checked against the
  fingerprint.

  Raises:
    CheckpointCorruptError: the stored base is missing, damaged or not the one saved.
    CheckpointError: the base the config builds is not the one the checkpoint was saved with.
  """
  if info.get("source") == "config":
    base = models.lora.strip(init_params(s))
    if fingerprint(base) != info.get("fingerprint"):
      raise CheckpointError(
          f"the frozen LoRA base the config builds is not the one the checkpoint of step "
          f"{step} in {directory} was trained on (model.hf_path, its files, model.lora.quant "
          "or train.seed changed?); resume with the config and weights it was written with")
    return base
  path = base_dir(directory)
  try:
    base, _ = ckpt_lib.restore(path, models.lora.strip(abstract_params), step=info["step"])
  except CheckpointNotFoundError as e:
    raise BaseCorruptError(f"the frozen LoRA base of the checkpoint of step {step} is "
                           f"missing: {e}", info["step"]) from e
  except CheckpointCorruptError as e:
    raise BaseCorruptError(str(e), info["step"]) from e
  if fingerprint(base) != info.get("fingerprint"):
    raise BaseCorruptError(f"the frozen LoRA base in {path} is not the one the checkpoint of "
                           f"step {step} was saved with", info["step"])
  return base


def set_aside_base(directory, step: int) -> str | None:
  """Renames the stored base ``step`` of the checkpoints in ``directory`` to
  ``<step>.damaged`` (kept, no longer a stored base); returns the new path, None if it is
  not there (set aside already, or never written). Every process calls this."""
  with ckpt_lib.Checkpointer(base_dir(directory), keep=None, save_every=0) as base:
    if step not in base.all_steps():
      return None
    return base.set_aside(step)


def rejoin(base: dict, saved_params: dict) -> dict:
  """The full params from the base and a LoRA checkpoint's ``adapters_only`` params."""
  return models.lora.combine(base, saved_params["layers"][models.lora.KEY])
