"""The objective inputs the trainer can provide: one table, read by the setup (what an
objective may ask for), the learner (how each input is produced) and the memory plan (its
shape and dtype).

Each entry of ``INPUTS`` names a field of ``losses.ObjectiveInputs``, whether every step
fills it (``always``) or only an objective that declares it (``Objective.needs``), its
shape kind and dtype, and ``make(src)``: how it is produced from a ``Source`` (the step's
batch on the training mesh and the passes that compute the rest). ``PROVIDED_INPUTS`` adds
``entropy``, computed inside the update itself (``steps.make_rl_update``).

Shapes (the package legend, ``rl_jax/__init__.py``): G row groups, M samples per group, R new
tokens, C reward components (``Setup.reward_names``; C = 1: the reward), U turns (multi-turn
runs).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from rl_jax import losses
from rl_jax.train.streams import Stream, seed_for

__all__ = ["Source", "Input", "INPUTS", "PROVIDED_INPUTS", "SINGLE_TURN_INPUTS", "SHAPES",
           "provided", "make_inputs",
           "abstract_inputs"]


class Source(NamedTuple):
  """What the inputs are made from: ``steps`` (StepFns), ``state`` (TrainState), ``args``
  (prompt tokens [G,P], prompt lengths [G], tokens [G,M,R], loss mask [G,M,R]), rewards
  [G,M], generated mask [G,M,R], behaviour log-probs [G,M,R], the run's seed."""

  steps: Any
  state: Any
  args: tuple
  rewards: Any
  generated_mask: Any
  behaviour_logp: Any
  seed: int
  turns: Any = None  # multi-turn rollouts: a mapping with the losses.TURN_FIELDS arrays
  routing: Any = None  # model.router_replay: the sampler's experts [G,M,R,Y,X]
  teacher: Any = None  # distill.teacher_path: the teacher's params (train.teacher)
  components: Any = None  # named reward components [G,M,C] (Setup.reward_names), else None
  packing: Any = None  # (src, dst) of models.packing for the passes, else None


def _replayed(x: "Source") -> tuple:
  """The log-prob passes' routing argument under ``model.router_replay`` (else none)."""
  return () if x.routing is None else (x.routing,)


def _run(x: "Source", fn: Callable, weights, *extra):
  """The pass ``fn`` (log-probs or values) on the step's batch: on its rows of several
  responses (``fn.on_rows``, ``steps._group_pass``) when the step packs them."""
  if x.packing is None or not hasattr(fn, "on_rows"):
    return fn(weights, *x.args, *extra)
  return fn.on_rows(weights, *x.args, *x.packing, *extra)


class Input(NamedTuple):
  """One objective input: ``shape`` a key of ``SHAPES``; ``make(src) -> array | None``."""

  shape: str
  dtype: Any
  always: bool
  make: Callable[[Source], Any]


def _old_logp(x: Source):
  if x.steps.old_logp_in_update:  # on-policy: the update's own pass gives old_logp
    return None
  return _run(x, x.steps.logprobs, x.state.params, *_replayed(x))


def _grad_sq_norms(x: Source):
  key = jax.random.key(seed_for(x.seed, int(x.state.step), Stream.GRAD_NORMS))
  return x.steps.grad_sq_norms(x.state.params, *x.args, key)


# name -> Input, in the order they are produced
INPUTS: dict[str, Input] = {
    "rewards": Input("rows", jnp.float32, True, lambda x: x.rewards),
    "mask": Input("tokens", jnp.bool_, True, lambda x: x.args[3]),
    "generated_mask": Input("tokens", jnp.bool_, True, lambda x: x.generated_mask),
    "old_logp": Input("tokens", jnp.float32, True, _old_logp),
    "behaviour_logp": Input("tokens", jnp.float32, True, lambda x: x.behaviour_logp),
    "grad_sq_norms": Input("rows", jnp.float32, False, _grad_sq_norms),
    "lengths": Input("rows", jnp.float32, False,
                     lambda x: jnp.sum(x.args[3], axis=-1).astype(jnp.float32)),
    "ref_logp": Input("tokens", jnp.float32, False, lambda x: _run(
        x, x.steps.ref_logprobs or x.steps.logprobs,
        x.state.params if x.steps.ref_from_policy else x.state.ref_params, *_replayed(x))),
    # the named components (Setup.reward_names), else the reward as the one component
    "reward_components": Input("components", jnp.float32, False, lambda x: (
        x.rewards[..., None] if x.components is None else x.components)),
    "values": Input("tokens", jnp.float32, False,
                    lambda x: _run(x, x.steps.values, x.state.value_params)),
    # per-turn fields of multi-turn trajectories (only an agentic producer has them)
    "turn_rewards": Input("turns", jnp.float32, False, lambda x: x.turns["turn_rewards"]),
    "turn_ids": Input("tokens", jnp.int32, False, lambda x: x.turns["turn_ids"]),
    "turn_states": Input("turns", jnp.int32, False, lambda x: x.turns["turn_states"]),
    # on-policy distillation: the frozen teacher's pass (train.teacher)
    "teacher_logp": Input("tokens", jnp.float32, False,
                          lambda x: _run(x, x.steps.teacher_logprobs, x.teacher)),
}
assert set(INPUTS) == set(losses.INPUT_FIELDS), "every ObjectiveInputs field has one entry"

# What the trainer can hand an objective: every input of the table, and the per-token
# entropy of the policy (computed inside the update). build_setup rejects anything else; the
# per-turn fields (losses.TURN_FIELDS) only for multi-turn (agentic) runs.
PROVIDED_INPUTS = frozenset(INPUTS) | {"entropy"}
SINGLE_TURN_INPUTS = PROVIDED_INPUTS - frozenset(losses.TURN_FIELDS)

# shape kind -> the shape for G row groups of M samples, R tokens and U turns
SHAPES = {"rows": lambda G, M, R, U: (G, M), "tokens": lambda G, M, R, U: (G, M, R),
          "components": lambda G, M, R, U: (G, M, 1), "turns": lambda G, M, R, U: (G, M, U)}


def provided(needs) -> list[str]:
  """The inputs a step fills for an objective that needs ``needs``, in production order."""
  return [k for k, v in INPUTS.items() if v.always or k in needs]


def make_inputs(needs, src: Source) -> losses.ObjectiveInputs:
  """The objective's input record: every ``provided`` input made from ``src``."""
  return losses.ObjectiveInputs(**{k: INPUTS[k].make(src) for k in provided(needs)})


def abstract_inputs(needs, G: int, M: int, R: int, spec: Callable,
                    old_logp_in_update: bool, U: int = 1) -> losses.ObjectiveInputs:
  """The record's ``spec(shape, dtype)`` stand-ins (for the memory plan); ``old_logp`` is
  None when the update computes it itself; U turns (``Geometry.turns``)."""
  out = {k: spec(SHAPES[INPUTS[k].shape](G, M, R, U), INPUTS[k].dtype) for k in provided(needs)}
  if old_logp_in_update:
    out["old_logp"] = None
  return losses.ObjectiveInputs(**out)
