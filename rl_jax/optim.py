"""Optimizers of the trainer: AdamW behind an optional global-norm clip, with a schedule.

``make_optimizer(optim_config, lr, steps)`` builds the transform every stage uses (the
supervised warm start, the RL policy update and the PPO critic) from the ``optim`` section
of the config; only the learning rate and the number of steps differ between stages.

Schedules (``optim.schedule``): ``constant`` (linear warm-up over ``optim.warmup_steps``, then
``lr``) and ``cosine`` (warm-up, then cosine decay to 0 at ``steps``).
"""

from __future__ import annotations

from typing import Any

import optax

__all__ = ["SCHEDULES", "make_optimizer"]

SCHEDULES = ("constant", "cosine")


def make_optimizer(o: Any, lr: float, steps: int) -> optax.GradientTransformation:
  """AdamW (``o.b1, o.b2, o.eps, o.weight_decay``) at ``lr`` after a global-norm clip.

  Args:
    o: the ``optim`` config section (``schedule``, ``warmup_steps``, ``grad_clip`` ...).
    lr: peak learning rate (η).
    steps: optimizer steps of the stage (the cosine schedule decays over them).

  ``o.mu_dtype`` (None: the parameters' dtype) stores Adam's first moment in that dtype
  (``bfloat16`` halves it); the second moment stays in the parameters' dtype, since its
  squared gradients underflow bfloat16's range far sooner.

  Returns:
    An optax transformation; ``grad_clip == 0`` drops the clip.
  """
  if o.schedule == "cosine":
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(o.warmup_steps, 1), max(steps, 2))
  elif o.warmup_steps:
    sched = optax.join_schedules(
        [optax.linear_schedule(0.0, lr, o.warmup_steps), optax.constant_schedule(lr)],
        [o.warmup_steps])
  else:
    sched = lr
  parts = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip > 0 else []
  parts.append(optax.adamw(sched, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                           mu_dtype=o.get("mu_dtype")))
  return optax.chain(*parts)
