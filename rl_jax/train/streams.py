"""Named random streams of the trainer.

Every random draw of a run is a function of ``(train.seed, step, stream)`` and nothing else,
so a resumed run draws exactly what the uninterrupted run would have drawn. Each consumer
has its own stream; the integer values are part of the run's identity (changing one
changes every result that depends on it).
"""

from __future__ import annotations

import enum

import numpy as np

__all__ = ["Stream", "seed_for"]


class Stream(enum.IntEnum):
  """The consumers of randomness, one stream each."""

  CRITIC_INIT = 0   # PPO value head initialisation (step 0 only)
  ROLLOUT = 1       # training rollouts from ``rollout.generate`` (per step)
  GRAD_NORMS = 3    # VCPO gradient-norm estimators that project randomly (per step)
  ENGINE = 5        # the partial-rollout engine's per-sample streams (step 0 only)
  EVAL_PASS_K = 7   # pass@k samples of the evaluation (per evaluated step)
  SELECTOR = 9      # prompt selectors' draws: GRESO skips, Thompson samples (per step)
  SPECULATIVE = 11  # SPEC-RL acceptance and residual draws (per step)
  ROUNDING = 13     # optim.stochastic_rounding: folded with each optimizer's update count
  AGENT = 15        # multi-turn episodes: the AgentEngine's base seed (step 0 only; every
                    # group is seeded by its uid = step · G + group, each sample by its index)
  REPLAY = 17       # experience replay: the groups drawn from the buffer (per step)


def seed_for(seed: int, step: int, stream: Stream) -> int:
  """A 31-bit seed for ``stream`` at ``step`` of the run seeded ``seed``."""
  return int(np.random.default_rng([seed, int(stream), step]).integers(0, 2**31 - 1))
