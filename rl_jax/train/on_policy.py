"""When the update can take the proximal log-probs from its own policy pass.

``old_logp`` is the policy at the start of the step. With one minibatch (one optimizer step
per RL step) the update's forward pass runs on exactly those weights, so a separate
teacher-forced pass over the same tokens computes the same numbers as the update's own pass:
``old_logp = stop_gradient(logp)`` inside the update is the same objective (values and
gradients), to float rounding, and saves one forward pass per step.

It is used only when it is provably the same:

* ``train.minibatches == 1`` (later minibatches would see updated weights);
* ``train.epochs == 1`` (a second pass over the batch runs on updated weights: the proximal
  log-probs must stay those computed before the first pass);
* the synchronous schedule (lag 0, ``config.schedule``; the asynchronous runners keep the
  separate pass);
* no partial rollouts (``rollout.partial``: the engine path keeps its own bookkeeping);
* the advantage estimator does not read ``old_logp`` (advantages are computed before the
  update; e.g. REINFORCE++ with a KL-in-reward reads it), as the estimator declares;
* ``train.old_logp_pass`` is ``"auto"`` (``"separate"`` always runs the separate pass).

Shapes (package legend): G groups, M samples per prompt, R new tokens.
"""

from __future__ import annotations


from rl_jax import losses
from rl_jax import settings

__all__ = ["estimator_reads_old_logp", "old_logp_in_update"]


def estimator_reads_old_logp(objective: losses.Objective) -> bool:
  """True unless the objective's advantage estimator declares it runs without ``old_logp``
  (``Objective.estimator_needs``; the estimator is not called, so user code with side
  effects runs only when the trainer computes advantages)."""
  if objective.advantages_from is None:
    return True
  return "old_logp" in objective.estimator_needs


def old_logp_in_update(train: settings.TrainSettings, overlapped: bool, partial: bool,
                       objective: losses.Objective) -> bool:
  """Whether the RL update takes ``old_logp`` from its own policy pass (see module doc):
  ``train``'s pass choice, minibatches and epochs; ``overlapped``, the schedule's
  (``Schedule.overlapped``: sampling runs beside the update); ``partial``,
  ``rollout.partial``."""
  return (train.old_logp_pass == "auto" and train.minibatches == 1 and train.epochs == 1
          and not overlapped and not partial and not estimator_reads_old_logp(objective))
