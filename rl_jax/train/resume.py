"""Restoring the train state of a step, including checkpoints of the older state layout.

The state holds only what the run still uses (``state.rl_layout``): the supervised
optimizer state while the supervised stage runs, the reference once RL starts. Checkpoints
written before this rule kept both for the whole run (the supervised Adam moments even with
``sft.steps=0``, the reference in the parameter dtype during the supervised stage).
``restore_state`` reads such a checkpoint too: the parts the current layout lacks are read
into a target of their saved layout and then dropped, and a reference saved in another dtype
is cast to ``train.ref_dtype`` on restore.

Checkpoints written before the producer's fields were grouped (``ProducerState``) keep them
flat at the top of the state (``FLAT_PRODUCER``: ``data``, ``rollout_buffer``, ``selector``,
``spec_drafts``), and their queue's ``stats`` may have fewer columns (counters added later
come last): ``restore_state`` reads such a checkpoint onto a target of its own layout and
regroups it. Nothing needs converting by hand.

A LoRA run's checkpoint holds the adapters without the frozen base (``lora_checkpoint``):
``restore_state`` reads the adapters, rebuilds or reads the base the checkpoint names, and
joins them; a LoRA checkpoint with full params (written before) restores as it is.

A newest checkpoint that does not read back whole (a file missing or changed since the save,
``rl_jax.checkpoint.integrity``) is no dead end: ``restore_newest`` renames it to
``<step>.damaged`` (kept for inspection), says so in one line, and restores the newest step
that does read back.
"""

from __future__ import annotations

import sys

import jax
import numpy as np

from rl_jax import checkpoint as ckpt_lib
from rl_jax.errors import CheckpointCorruptError, CheckpointError
from rl_jax.train import lora_checkpoint, offload
from rl_jax.train.context import Setup
from rl_jax.train.state import TrainState, abstract_state, place_replicated, rl_layout

__all__ = ["restore_newest", "OPTIONAL_PARTS", "FLAT_PRODUCER", "restore_state", "legacy_target", "flat_layout",
           "from_flat_layout"]

# TrainState fields that exist only in some phases of a run (see ``state.rl_layout``).
OPTIONAL_PARTS = ("sft_opt_state", "ref_params")
# the earlier flat layout: top-level name -> ProducerState field
FLAT_PRODUCER = {"data": "data", "rollout_buffer": "held", "selector": "selector",
                 "spec_drafts": "drafts"}


def flat_layout(state: TrainState) -> dict:
  """``state`` in the earlier flat layout (a dict of its top-level parts), as checkpoints
  written before ``ProducerState`` hold it."""
  out = {f: getattr(state, f) for f in state._fields if f != "producer"}
  out.update({old: getattr(state.producer, new) for old, new in FLAT_PRODUCER.items()})
  return out


def from_flat_layout(flat: dict, like: TrainState) -> TrainState:
  """The inverse of ``flat_layout`` (``like`` gives the tree types)."""
  producer = like.producer._replace(**{new: flat[old] for old, new in FLAT_PRODUCER.items()})
  return like._replace(producer=producer, **{f: flat[f] for f in like._fields
                                              if f != "producer"})


def _queue_stats(target, saved: dict):
  """The target's queue ``stats`` with the saved number of columns (an earlier, shorter
  counter list), or the target unchanged."""
  q = target["rollout_queue"] if isinstance(target, dict) else target.rollout_queue
  shape = saved.get("rollout_queue/stats", {}).get("shape")
  if not q or shape is None or tuple(shape) == q["stats"].shape:
    return target, None
  spec = q["stats"]
  q = dict(q, stats=jax.ShapeDtypeStruct(tuple(shape), spec.dtype, sharding=spec.sharding))
  if isinstance(target, dict):
    return dict(target, rollout_queue=q), spec
  return target._replace(rollout_queue=q), spec


def _pad_stats(s: Setup, state: TrainState, spec) -> TrainState:
  """The queue's shorter ``stats`` padded with NaN (not reported) to ``spec``'s columns."""
  old = np.asarray(jax.device_get(state.rollout_queue["stats"]))
  new = np.full(spec.shape, np.nan, old.dtype)
  new[:, :old.shape[1]] = old
  return state._replace(rollout_queue=dict(state.rollout_queue,
                                           stats=place_replicated(s, new)))


def _saved_parts(saved: dict) -> set[str]:
  """Top-level TrainState fields with at least one leaf in a checkpoint manifest."""
  return {path.split("/", 1)[0] for path in saved}


def legacy_target(s: Setup, target: TrainState, saved: dict) -> tuple[TrainState, tuple]:
  """``target`` extended with the optional parts the checkpoint has and ``target`` lacks
  (read, then dropped); returns (extended target, names of the parts to drop)."""
  have = _saved_parts(saved)
  extra = [name for name in OPTIONAL_PARTS
           if name in have and not jax.tree.leaves(getattr(target, name))]
  if not extra:
    return target, ()
  parts = {}
  if "sft_opt_state" in extra:
    parts["sft_opt_state"] = abstract_state(s, rl=False).sft_opt_state
  if "ref_params" in extra:  # the older layout's reference: parameter-shaped, any dtype
    parts["ref_params"] = target.params
  return target._replace(**parts), tuple(extra)


def restore_state(s: Setup, ckpt: ckpt_lib.Checkpointer, step: int,
                  target: TrainState) -> TrainState:
  """The checkpoint of ``step`` restored onto ``target`` (``abstract_state(s, step)``);
  parts of an older layout that the run no longer keeps are dropped after reading."""
  ckpt.wait()
  saved = ckpt_lib.saved_leaves(ckpt.directory, step)
  missing = [name for name in OPTIONAL_PARTS if jax.tree.leaves(getattr(target, name))
             and name not in _saved_parts(saved)]
  if missing:
    raise CheckpointError(
        f"the checkpoint of step {step} has no {missing[0]}, which this config needs at that "
        "step (sft.steps or the KL term changed since it was written?); resume with the "
        "config it was written with")
  full, drop = legacy_target(s, target, saved)
  lora_base = lora_checkpoint.base_info(s, ckpt.directory, step)
  if lora_base:  # the adapters only; the base is joined below
    full = full._replace(params=lora_checkpoint.adapters_only(target.params))
  flat = "data" in saved  # written before the producer's fields were grouped
  read = flat_layout(full) if flat else full
  read, stats_spec = _queue_stats(read, saved)
  state, _ = ckpt.restore(read, step=step)
  if flat:
    state = from_flat_layout(state, full)
  if lora_base:
    base = lora_checkpoint.restore_base(s, ckpt.directory, step, lora_base, target.params)
    state = state._replace(params=lora_checkpoint.rejoin(base, state.params))
  if stats_spec is not None:
    state = _pad_stats(s, state, stats_spec)
  state = state._replace(**{name: {} for name in drop})
  # train.offload: the target already places these in host memory; an older layout's
  # reference (read onto the policy's layout) is moved there too
  return offload.place(state, offload.offloaded_fields(s))


def restore_newest(s: Setup, ckpt: ckpt_lib.Checkpointer,
                   abstract: TrainState) -> TrainState | None:
  """The newest checkpoint that reads back whole, restored (None: no checkpoint). Damaged
  newer steps are set aside (``Checkpointer.set_aside``) with one line on stderr each.

  Args:
    abstract: ``abstract_state(s)``, the target of a checkpoint of the current layout.
  """
  while (step := ckpt.latest_step()) is not None:
    # the parts saved at that step (state.rl_layout); older layouts are read too
    target = abstract if rl_layout(s, step) == rl_layout(s, 0) else abstract_state(s, step)
    try:
      return restore_state(s, ckpt, step, target)
    except CheckpointCorruptError as e:
      aside = ckpt.set_aside(step)
      print(f"checkpoint of step {step} skipped, it does not read back whole ({e}); kept as "
            f"{aside}", file=sys.stderr)
  return None
