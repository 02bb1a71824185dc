"""When the update can take the proximal log-probs from its own policy pass.

``old_logp`` is the policy at the start of the step. With one minibatch (one optimizer step
per RL step) the update's forward pass runs on exactly those weights, so a separate
teacher-forced pass over the same tokens computes the same numbers as the update's own pass:
``old_logp = stop_gradient(logp)`` inside the update is the same objective (values and
gradients), to float rounding, and saves one forward pass per step.

It is used only when it is provably the same:

* ``train.minibatches == 1`` (later minibatches would see updated weights);
* ``train.mode == "sync"`` (the asynchronous pipeline keeps the separate pass);
* no partial rollouts (``rollout.partial``: the engine path keeps its own bookkeeping);
* the advantage estimator does not read ``old_logp`` (advantages are computed before the
  update; e.g. REINFORCE++ with a KL-in-reward reads it), probed by tracing the estimator
  on abstract inputs without that field;
* ``train.old_logp_pass`` is ``"auto"`` (``"separate"`` always runs the separate pass).

Shapes (package legend): G groups, M samples per prompt, R new tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax import losses

__all__ = ["OLD_LOGP_PASSES", "estimator_reads_old_logp", "old_logp_in_update"]

OLD_LOGP_PASSES = ("auto", "separate")

_ROW_FIELDS = ("rewards", "lengths", "grad_sq_norms")  # [G,M]


def _abstract_inputs(needs, G: int = 2, M: int = 4, R: int = 3) -> losses.ObjectiveInputs:
  """Abstract ``ObjectiveInputs`` with every field in ``needs`` except ``old_logp``."""
  fields = {"rewards": jax.ShapeDtypeStruct((G, M), jnp.float32),
            "mask": jax.ShapeDtypeStruct((G, M, R), jnp.bool_)}
  for name in sorted(set(needs) & set(losses.INPUT_FIELDS) - {"old_logp", "rewards", "mask"}):
    if name in _ROW_FIELDS:
      shape = (G, M)
    elif name == "reward_components":
      shape = (G, M, 1)
    else:
      shape = (G, M, R)
    dtype = jnp.bool_ if name == "generated_mask" else jnp.float32
    fields[name] = jax.ShapeDtypeStruct(shape, dtype)
  return losses.ObjectiveInputs(**fields)


def estimator_reads_old_logp(objective: losses.Objective) -> bool:
  """True unless the objective's advantage estimator runs without ``old_logp``.

  Traces ``objective.advantages_from`` (no computation) on abstract inputs holding every
  field the objective needs except ``old_logp``; any failure counts as "reads it".
  """
  if objective.advantages_from is None:
    return True
  try:
    jax.eval_shape(objective.advantages_from, _abstract_inputs(objective.needs))
  except Exception:  # pylint: disable=broad-except
    return True
  return False


def old_logp_in_update(config, objective: losses.Objective) -> bool:
  """Whether the RL update takes ``old_logp`` from its own policy pass (see module doc)."""
  return (config.train.old_logp_pass == "auto" and config.train.minibatches == 1
          and config.train.get("mode", "sync") == "sync" and not config.rollout.partial
          and not estimator_reads_old_logp(objective))
