"""Multi-turn (agentic) trajectories: per-turn returns, step groups and GiGPO.

A multi-turn trajectory is laid out like a response: one row of R tokens in which the
model's sampled tokens and the environment's observation tokens alternate; the loss mask is
True on model tokens only. Turn-level estimators also read, per row, the reward of each
turn, the turn each token belongs to, and (GiGPO) an id of the environment state each turn
starts from. See docs/ALGORITHMS.md, "Multi-turn trajectories".

Axis letters: G groups (prompts), M samples per prompt, R response tokens, U turns (the
most turns of any trajectory in the batch; padded).

A turn is *present* when its reward is finite, its state id is >= 0 (where state ids are
read) and the trajectory's return is finite; an absent turn adds nothing to the returns of
the turns before it, joins no step group and has step-level advantage 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax.losses._utils import Array, check_choice, check_rank, check_same_shape, safe_divide
from rl_jax.losses.advantages import grpo_advantages

__all__ = ["gigpo_advantages", "step_group_advantages", "tokens_from_turns", "turn_returns"]


def turn_returns(turn_rewards: Array, gamma: float = 1.0) -> Array:
  """Discounted return-to-go of every turn: ``R_u = sum_{k >= u} gamma^(k - u) r_k``.

  Non-finite turn rewards (absent turns) count as 0. With ``gamma = 1`` the return of turn 0
  is the trajectory's summed reward.

  Args:
    turn_rewards: float [..., U] per-turn rewards (NaN for absent turns).
    gamma: discount between consecutive turns, in [0, 1].

  Returns:
    float [..., U] returns-to-go (finite everywhere).
  """
  r = jnp.where(jnp.isfinite(turn_rewards), turn_rewards, 0.0)

  def step(carry, r_u):
    carry = r_u + gamma * carry
    return carry, carry

  moved = jnp.moveaxis(r, -1, 0)
  _, ret = jax.lax.scan(step, jnp.zeros(moved.shape[1:], r.dtype), moved, reverse=True)
  return jnp.moveaxis(ret, 0, -1)


def step_group_advantages(returns: Array, states: Array, present: Array, scale: str = "std",
                          eps: float = 1e-6) -> Array:
  """Step-level advantages over anchor-state groups within each prompt's group.

  In group g, the turns (of any of its M trajectories, repeats within one trajectory
  included) that start from the same state id form one step group; each present turn's
  return is normalised within its step group: ``(R - mean) / (std + eps)`` with the unbiased
  std, or ``R - mean`` for ``scale="none"``. A step group of one turn gives 0 (nothing to
  compare against), as does a group whose returns are all equal.

  Cost: pairwise state comparisons, O(G·(M·U)²) memory and time.

  Args:
    returns: float [G,M,U] per-turn returns.
    states: int [G,M,U] state ids (any integers; only equality matters).
    present: bool [G,M,U] turns that take part.
    scale: "std" or "none".
    eps: added to the std.

  Returns:
    float [G,M,U]; 0 for absent turns and singleton step groups.
  """
  check_rank("returns", returns, (3,))
  check_same_shape("returns", returns, states=states, present=present)
  check_choice("scale", scale, ("std", "none"))
  g, m, u = returns.shape
  x = returns.reshape(g, m * u)
  keys = states.reshape(g, m * u)
  ok = present.astype(bool).reshape(g, m * u)
  x = jnp.where(ok, x, 0.0)
  same = (keys[:, :, None] == keys[:, None, :]) & ok[:, :, None] & ok[:, None, :]  # [G,N,N]
  n = jnp.sum(same, axis=-1).astype(x.dtype)
  mean = safe_divide(jnp.sum(jnp.where(same, x[:, None, :], 0.0), axis=-1), n)
  dev2 = jnp.where(same, (x[:, None, :] - mean[:, :, None]) ** 2, 0.0)
  std = jnp.sqrt(safe_divide(jnp.sum(dev2, axis=-1), n - 1.0))
  centred = x - mean
  adv = centred / (std + eps) if scale == "std" else centred
  return jnp.where(ok & (n > 1), adv, 0.0).reshape(g, m, u)


def tokens_from_turns(per_turn: Array, turn_ids: Array) -> Array:
  """Spread per-turn values onto tokens: ``out[..., t] = per_turn[..., turn_ids[..., t]]``.

  Args:
    per_turn: float [G,M,U].
    turn_ids: int [G,M,R] turn of each token; ids outside [0, U) (e.g. -1 on observation
      tokens and padding) get 0.

  Returns:
    float [G,M,R].
  """
  u = per_turn.shape[-1]
  inside = (turn_ids >= 0) & (turn_ids < u)
  picked = jnp.take_along_axis(per_turn, jnp.where(inside, turn_ids, 0), axis=-1)
  return jnp.where(inside, picked, 0.0)


def gigpo_advantages(rewards: Array, turn_rewards: Array, turn_states: Array,
                     turn_ids: Array, mask: Array, omega: float = 1.0, gamma: float = 0.95,
                     scale: str = "std", eps: float = 1e-6) -> Array:
  """GiGPO token advantages: ``A = A_E + omega * A_S`` on every loss token.

  * ``A_E`` (episode level): GRPO over the trajectory returns ``rewards`` of each group
    (``grpo_advantages`` with ``scale``), the same on every token of the row.
  * ``A_S`` (step level): the discounted return-to-go of the token's turn (``turn_returns``
    with ``gamma``), normalised within its anchor-state step group
    (``step_group_advantages``).

  ``omega = 0`` is GRPO broadcast over tokens. A row whose return is not finite gets 0 on
  every token and its turns join no step group.

  Args:
    rewards: float [G,M] trajectory returns.
    turn_rewards: float [G,M,U] per-turn rewards, NaN for absent turns.
    turn_states: int [G,M,U] id of the environment state before each turn, -1 if absent.
    turn_ids: int [G,M,R] turn of each token, -1 on observation tokens and padding.
    mask: bool [G,M,R] loss tokens.
    omega: weight of the step-level term (paper: 1).
    gamma: discount of the step-level return (paper: 0.95).
    scale: "std" (normalise both levels by the std) or "none" (mean-centred only).
    eps: added to the std.

  Returns:
    float [G,M,R] token advantages; 0 outside ``mask``.

  References: Feng et al. 2025, Group-in-Group Policy Optimization for LLM Agent Training
  (GiGPO).
  """
  check_rank("rewards", rewards, (2,))
  check_rank("turn_rewards", turn_rewards, (3,))
  check_same_shape("turn_rewards", turn_rewards, turn_states=turn_states)
  check_same_shape("mask", mask, turn_ids=turn_ids)
  episode = grpo_advantages(rewards, scale, eps)  # [G,M]
  present = (jnp.isfinite(turn_rewards) & (turn_states >= 0)
             & jnp.isfinite(rewards)[..., None])
  step = step_group_advantages(turn_returns(turn_rewards, gamma), turn_states, present,
                               scale, eps)
  adv = episode[..., None] + omega * tokens_from_turns(step, turn_ids)
  return jnp.where(mask.astype(bool), adv, 0.0)
