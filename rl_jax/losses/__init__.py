"""RL objectives as composable, jittable transforms.

* Records (inputs.py): ``ObjectiveInputs`` (one step's groups, [G,M,...]) -> an estimator's
  ``Advantages`` -> ``loss_batch`` -> the per-row ``LossBatch`` the loss reads.
* Plain formulas (``grpo_advantages``, ``kl_penalty``, ``aggregate``, ``policy_loss`` ...)
  for direct use.
* Parts combined with ``chain(...)`` into an ``Objective``: advantage estimators
  (estimators.py, a registry: ``register_advantage``), loss stages (stages.py, policy
  registry: ``register_policy``), an aggregation and an optax update transform.
* Named recipes: ``get_objective`` (presets.py), each one ``chain`` of parts.

Axis letters: the package legend (``rl_jax/__init__.py``).
The formulas are derived in docs/ALGORITHMS.md.
"""

from rl_jax.losses.advantages import (gae_advantages, gdpo_advantages, grpo_advantages,
                                      mc_grpo_advantages, reinforce_pp_advantages,
                                      reinforce_pp_baseline_advantages, rloo_advantages)
from rl_jax.losses.aggregation import (AGG_MODES, Aggregation, aggregate, aggregate_parts,
                                       aggregation)
from rl_jax.losses.compose import Objective, chain, finalize, policy_loss
from rl_jax.losses.estimators import (ADVANTAGES, DISTILL_NEEDS, NO_RETURNS, TURN_FIELDS,
                                      AdvantageEstimator, advantage_names, distill, dr_grpo,
                                      gae, gdpo, gigpo, grpo, mc_grpo, opob,
                                      register_advantage, reinforce_pp,
                                      reinforce_pp_baseline, rloo, sampled_reverse_kl,
                                      with_distillation)
from rl_jax.losses.inputs import (INPUT_FIELDS, Advantages, LossBatch, ObjectiveInputs,
                                  check_inputs, loss_batch)
from rl_jax.losses.kl import KL_KINDS, entropy_from_logits, kl_penalty, kl_reward
from rl_jax.losses.policy import (DECOUPLED_MODES, MIS_LEVELS, MIS_MODES, RATIO_LEVELS,
                                  TIS_LEVELS, ace_scale, decoupled_weights,
                                  geo_mean_is_weights, gspo_log_ratio, icepop_weights,
                                  m2po_clip_bound, m2po_mask, masked_is_weights,
                                  minpro_weights, ppo_clip_per_token, sequence_log_ratio,
                                  truncated_is_weights, value_loss_per_token)
from rl_jax.losses.presets import (KNOBS, PRESET_KNOB_DEFAULTS, PRESET_KNOB_TYPES,
                                   PRESET_KNOBS, PRESETS, Knob, get_objective)
from rl_jax.losses.stages import (POLICIES, LossInputs, LossStage, LossTerms, ace, decoupled,
                                  entropy_bonus, ess_metrics, geo_mean_is, gspo_clip, icepop,
                                  kl_term, m2po, m2po_clip_budget, masked_is, minpro,
                                  policy_names, ppo_clip, register_policy, reinforce,
                                  truncated_is, value_loss)
from rl_jax.losses.turns import (gigpo_advantages, step_group_advantages, tokens_from_turns,
                                 turn_returns)
from rl_jax.losses.vcpo import (ESS_RULES, GRAD_NORM_METHODS, effective_sample_size,
                                ess_lr_multiplier, ess_ratio_from_sums, ess_sums,
                                head_grad_sq_norms, identity_transform, opob_advantages,
                                opob_baseline, per_row_grad_sq_norms, scale_by_ess,
                                sequence_log_weights)

__all__ = [
    # records
    "INPUT_FIELDS", "Advantages", "LossBatch", "ObjectiveInputs", "check_inputs", "loss_batch",
    # advantage formulas
    "gae_advantages", "gdpo_advantages", "grpo_advantages", "mc_grpo_advantages",
    "reinforce_pp_advantages", "reinforce_pp_baseline_advantages", "rloo_advantages",
    # multi-turn (turn-level) formulas
    "gigpo_advantages", "step_group_advantages", "tokens_from_turns", "turn_returns",
    # advantage estimators and their registry
    "ADVANTAGES", "TURN_FIELDS", "AdvantageEstimator", "advantage_names", "dr_grpo", "gae",
    "gdpo", "gigpo", "grpo", "mc_grpo", "opob", "register_advantage", "reinforce_pp",
    "reinforce_pp_baseline", "rloo", "DISTILL_NEEDS", "NO_RETURNS", "distill",
    "sampled_reverse_kl", "with_distillation",
    # policy-loss formulas
    "DECOUPLED_MODES", "MIS_LEVELS", "MIS_MODES", "RATIO_LEVELS", "TIS_LEVELS", "ace_scale",
    "decoupled_weights", "geo_mean_is_weights", "gspo_log_ratio", "icepop_weights",
    "m2po_clip_bound", "m2po_mask", "masked_is_weights", "minpro_weights", "policy_loss",
    "ppo_clip_per_token", "sequence_log_ratio", "truncated_is_weights",
    "value_loss_per_token",
    # loss stages and the policy registry
    "POLICIES", "LossInputs", "LossStage", "LossTerms", "ace", "decoupled", "entropy_bonus",
    "ess_metrics", "geo_mean_is", "gspo_clip", "icepop", "kl_term", "m2po", "m2po_clip_budget",
    "masked_is", "minpro", "policy_names", "ppo_clip", "register_policy", "reinforce",
    "truncated_is", "value_loss",
    # KL and entropy
    "KL_KINDS", "entropy_from_logits", "kl_penalty", "kl_reward",
    # aggregation
    "AGG_MODES", "Aggregation", "aggregate", "aggregate_parts", "aggregation",
    # composition and presets
    "Objective", "chain", "finalize", "PRESETS", "KNOBS", "Knob", "PRESET_KNOBS",
    "PRESET_KNOB_DEFAULTS", "PRESET_KNOB_TYPES", "get_objective",
    # VCPO
    "ESS_RULES", "GRAD_NORM_METHODS", "effective_sample_size", "ess_lr_multiplier",
    "ess_ratio_from_sums", "ess_sums", "head_grad_sq_norms", "identity_transform",
    "opob_advantages", "opob_baseline", "per_row_grad_sq_norms", "scale_by_ess",
    "sequence_log_weights",
]
