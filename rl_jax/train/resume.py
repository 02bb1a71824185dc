"""Restoring the train state of a step.

The state holds only what the run still uses (``state.rl_layout``): the supervised
optimizer state while the supervised stage runs, the reference once RL starts, the
producer's fields grouped in ``ProducerState``, the asynchronous queue's ``stats`` with one
column per ``records.STATS``. A LoRA run's checkpoint holds the adapters without the frozen
base (``lora_checkpoint``): ``restore_state`` reads the adapters, rebuilds or reads the base
the checkpoint names, and joins them.

Checkpoints of an earlier state layout are not read: before ``ProducerState`` the producer's
fields sat at the top of the state (``data``, ``rollout_buffer``, ``selector``,
``spec_drafts``), the queue's ``stats`` had fewer columns, the supervised optimizer state
was kept all run next to the reference, a LoRA checkpoint held the full params, and a
mixture-of-experts policy's held multi-turn groups kept no expert records.
``restore_state`` recognises these from the checkpoint's manifest, before reading any array,
and raises one ``CheckpointError`` line that names the difference and says to resume with
the rl_jax version that wrote the checkpoint or to start a new workdir. Converting them on
restore would keep a second reader of every old layout alive in the library for good.
A checkpoint that differs from the target in any other way fails in the checkpoint layer's
one line, which names the first differing leaf (``rl_jax.checkpoint.restore``).

A newest checkpoint that does not read back whole (a file missing or changed since the save,
``rl_jax.checkpoint.integrity``) is no dead end: ``restore_newest`` renames it to
``<step>.damaged`` (kept for inspection), says so in one line, and restores the newest step
that does read back; when none does, the run stops in one line instead of starting over.
"""

from __future__ import annotations

import sys

import jax

from rl_jax import checkpoint as ckpt_lib
from rl_jax import models
from rl_jax.errors import CheckpointCorruptError, CheckpointError
from rl_jax.train import lora_checkpoint, offload
from rl_jax.train.context import Setup
from rl_jax.train.state import TrainState, abstract_state, rl_layout

__all__ = ["restore_newest", "OPTIONAL_PARTS", "restore_state"]

# TrainState fields that exist only in some phases of a run (see ``state.rl_layout``).
OPTIONAL_PARTS = ("sft_opt_state", "ref_params")
# top-level names of the producer's fields in checkpoints written before ProducerState; only
# recognised, to name them in the error
_FLAT_PRODUCER = ("data", "rollout_buffer", "selector", "spec_drafts")


def _saved_parts(saved: dict) -> set[str]:
  """Top-level TrainState fields with at least one leaf in a checkpoint manifest."""
  return {path.split("/", 1)[0] for path in saved}


def _earlier_layout(s: Setup, target: TrainState, saved: dict) -> str | None:
  """What in the manifest ``saved`` only a checkpoint of an earlier state layout holds (a
  phrase for the error), or None. Each sign is one that no current checkpoint shows, so a
  changed config is never mistaken for an old layout."""
  parts = _saved_parts(saved)
  flat = [name for name in _FLAT_PRODUCER if name in parts]
  if flat:
    return (f"the producer's fields ({', '.join(flat)}) are at the top of the state, where "
            "this version keeps them under producer")
  shape = (saved.get("rollout_queue/stats") or {}).get("shape")
  queue = target.rollout_queue
  if queue and shape and len(shape) == 2 and shape[1] < queue["stats"].shape[1]:
    return (f"its async queue's stats have {shape[1]} columns, where this version keeps "
            f"{queue['stats'].shape[1]}")
  held = target.producer.held
  if ("routing" in held and "producer/held/routing" not in saved
      and any(path.startswith("producer/held/") for path in saved)):
    return ("its held multi-turn groups keep no expert records (producer/held/routing), "
            "which this version keeps for a mixture-of-experts policy")
  if set(OPTIONAL_PARTS) <= parts:  # never both at once since rl_layout
    dropped = [name for name in OPTIONAL_PARTS if not jax.tree.leaves(getattr(target, name))]
    return (f"it holds both {' and '.join(OPTIONAL_PARTS)}, and this run no longer keeps "
            f"{' or '.join(dropped)} at that step")
  if s.model_cfg.lora_rank:
    lora = f"params/layers/{models.lora.KEY}/"
    params = [p for p in saved if p.startswith("params/")]
    if any(p.startswith(lora) for p in params) and not all(p.startswith(lora) for p in params):
      return ("its params hold the frozen LoRA base besides the adapters, where this version "
              "checkpoints the adapters only")
  return None


def restore_state(s: Setup, ckpt: ckpt_lib.Checkpointer, step: int,
                  target: TrainState) -> TrainState:
  """The checkpoint of ``step`` restored onto ``target`` (``abstract_state(s, step)``).

  Raises:
    CheckpointError: the checkpoint is of an earlier state layout, lacks or holds an optional
      part (``OPTIONAL_PARTS``) that the config does not have at ``step``, or otherwise does
      not match ``target``; one line each, found from the manifest before any array is read.
    CheckpointCorruptError: a file of the step (or of its stored LoRA base) is missing or
      changed since the save.
  """
  ckpt.wait()
  saved = ckpt_lib.saved_leaves(ckpt.directory, step)
  earlier = _earlier_layout(s, target, saved)
  if earlier:
    raise CheckpointError(
        f"the checkpoint of step {step} was written in an earlier state layout that this "
        f"version of rl_jax no longer reads: {earlier}; resume it with the rl_jax version "
        "that wrote it, or start a new workdir")
  have = _saved_parts(saved)
  missing = [name for name in OPTIONAL_PARTS if jax.tree.leaves(getattr(target, name))
             and name not in have]
  if missing:
    raise CheckpointError(
        f"the checkpoint of step {step} has no {missing[0]}, which this config needs at that "
        "step (sft.steps or the KL term changed since it was written?); resume with the "
        "config it was written with")
  extra = [name for name in OPTIONAL_PARTS if name in have
           and not jax.tree.leaves(getattr(target, name))]
  if extra:  # one part alone: a current layout written with another config
    raise CheckpointError(
        f"the checkpoint of step {step} holds {extra[0]}, which this config does not keep at "
        "that step (sft.steps or the KL term changed since it was written?); resume with the "
        "config it was written with")
  read = target
  lora_base = lora_checkpoint.base_info(s, ckpt.directory, step)
  if lora_base:  # the adapters only; the base is joined below
    read = target._replace(params=lora_checkpoint.adapters_only(target.params))
  state, _ = ckpt.restore(read, step=step)
  if lora_base:
    base = lora_checkpoint.restore_base(s, ckpt.directory, step, lora_base, target.params)
    state = state._replace(params=lora_checkpoint.rejoin(base, state.params))
  # train.offload: the target already asks for host memory; leaves read elsewhere move there
  return offload.place(state, offload.offloaded_fields(s))


def restore_newest(s: Setup, ckpt: ckpt_lib.Checkpointer,
                   abstract: TrainState) -> TrainState | None:
  """The newest checkpoint that reads back whole, restored (None: no checkpoint). Damaged
  newer steps are set aside (``Checkpointer.set_aside``) with one line on stderr each; a
  checkpoint that does not fit the run (``restore_state``'s ``CheckpointError``) stops it.

  Args:
    abstract: ``abstract_state(s)``, the target of a checkpoint of the current layout.

  Raises:
    CheckpointCorruptError: every checkpoint was damaged and is now set aside: rather than
      train again from step 0 over the run's metrics, the run stops in one line.
  """
  for step in ckpt.incomplete_steps():  # the run would redo its steps, then fail to save
    aside = ckpt.set_aside(step)
    print(f"checkpoint of step {step} is incomplete (its save did not finish); kept as "
          f"{aside}", file=sys.stderr)
  damaged = []
  while (step := ckpt.latest_step()) is not None:
    damaged.append(step)
    # the parts the run holds at that step (state.rl_layout)
    target = abstract if rl_layout(s, step) == rl_layout(s, 0) else abstract_state(s, step)
    try:
      return restore_state(s, ckpt, step, target)
    except lora_checkpoint.BaseCorruptError as e:  # the base, not the adapters, is damaged
      base = lora_checkpoint.set_aside_base(ckpt.directory, e.step)
      if base:  # the first checkpoint to find it: later ones find it missing
        print(f"the stored LoRA base of step {step}'s checkpoint does not read back whole "
              f"({e}); kept as {base}", file=sys.stderr)
      aside = ckpt.set_aside(step)
      print(f"checkpoint of step {step} skipped, its stored LoRA base is damaged; kept as "
            f"{aside}", file=sys.stderr)
    except CheckpointCorruptError as e:
      aside = ckpt.set_aside(step)
      print(f"checkpoint of step {step} skipped, it does not read back whole ({e}); kept as "
            f"{aside}", file=sys.stderr)
  if damaged:
    raise CheckpointCorruptError(
        f"no checkpoint in {ckpt.directory} reads back whole (steps {damaged} are set aside "
        "as <step>.damaged), so there is nothing to resume; start a new workdir, or move "
        "checkpoints/ and metrics.jsonl away to train this one again from step 0")
  return None
