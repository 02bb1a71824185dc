"""Restoring the train state of a step, including checkpoints of the older state layout.

The state holds only what the run still uses (``state.rl_layout``): the supervised
optimizer state while the supervised stage runs, the reference once RL starts. Checkpoints
written before this rule kept both for the whole run (the supervised Adam moments even with
``sft.steps=0``, the reference in the parameter dtype during the supervised stage).
``restore_state`` reads such a checkpoint too: the parts the current layout lacks are read
into a target of their saved layout and then dropped, and a reference saved in another dtype
is cast to ``train.ref_dtype`` on restore. Nothing needs converting by hand.
"""

from __future__ import annotations

import jax

from rl_jax import checkpoint as ckpt_lib
from rl_jax.errors import CheckpointError
from rl_jax.train import offload
from rl_jax.train.context import Setup
from rl_jax.train.state import TrainState, abstract_state

__all__ = ["OPTIONAL_PARTS", "restore_state", "legacy_target"]

# TrainState fields that exist only in some phases of a run (see ``state.rl_layout``).
OPTIONAL_PARTS = ("sft_opt_state", "ref_params")


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
  state, _ = ckpt.restore(full, step=step)
  state = state._replace(**{name: {} for name in drop})
  # train.offload: the target already places these in host memory; an older layout's
  # reference (read onto the policy's layout) is moved there too
  return offload.place(state, offload.offloaded_fields(s))
