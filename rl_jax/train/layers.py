"""The trainer's modules by layer, top of the data flow last: the one list that
``tests/test_structure.py`` enforces, that docs/ARCHITECTURE.md's table is checked against,
and that the package docstring points at.

A module may import the modules of lower layers and, in a layer that is not ``apart``, those
of its own layer (the import graph stays acyclic); the modules of an ``apart`` layer (the
producer and the learner) never import each other.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Layer", "LAYERS", "MODULES"]


class Layer(NamedTuple):
  """One layer: its ``name``, its ``modules`` (of ``rl_jax.train``), whether they stay
  ``apart`` (never import each other), what they ``receive`` and what they ``hand_on``."""

  name: str
  modules: tuple[str, ...]
  apart: bool
  receive: str
  hand_on: str


LAYERS = (
    Layer("stages", ("layers", "streams", "group_size", "selection_stage", "speculative_stage",
                     "agent_stage", "replay_stage", "judge_stage"), False,
          "config, host arrays",
          "seeds, allocations, selected groups, drafts, episodes, replayed groups, verdicts"),
    Layer("setup", ("inputs", "context", "on_policy", "startup", "offload", "lock",
                    "accumulate", "teacher"), False,
          "config", "`Setup`; the micro-batch rule; the teacher's weights"),
    Layer("state", ("records", "queue", "state", "lora_checkpoint", "resume", "layout", "steps",
                    "rollouts"), False,
          "`Setup`", "`TrainState`, `Layout`, `StepFns`, `TrainParts`"),
    Layer("step", ("producer", "learner", "evaluation", "memory"), True,
          "`TrainParts`, state", "`Scored` + `ProducerState`; `UpdateBatch` + `TrainState`"),
    Layer("runner", ("runner", "topology"), False,
          "`TrainParts`, `TrainState`", "`TrainState`, record; the TPU compile plan"),
    Layer("loop", ("loop",), False, "config, workdir", "checkpoints, metrics, HF export"),
)
MODULES = tuple(m for layer in LAYERS for m in layer.modules)
