"""RL objectives as composable, jittable transforms.

Plain formulas (``grpo_advantages``, ``kl_penalty``, ``aggregate``, ``policy_loss`` ...) for
direct use; stage factories combined with ``chain(...)`` into an ``Objective``; named
presets via ``get_objective``. See compose.py for the composition model and presets.py for
the recipes.
"""

from rl_jax.losses.advantages import (gae_advantages, gdpo_advantages, grpo_advantages,
                                      mc_grpo_advantages, reinforce_pp_advantages,
                                      reinforce_pp_baseline_advantages, rloo_advantages)
from rl_jax.losses.aggregation import AGG_MODES, aggregate, aggregate_parts
from rl_jax.losses.compose import (AdvantageEstimator, Aggregation, Batch, LossInputs,
                                   LossStage, LossTerms, Objective, ace, aggregation, chain,
                                   decoupled, dr_grpo, entropy_bonus, ess_metrics, finalize,
                                   gae, gdpo, grpo, gspo_clip, kl_term, m2po, m2po_clip_budget,
                                   mc_grpo, opob, ppo_clip, reinforce, reinforce_pp,
                                   reinforce_pp_baseline, rloo, truncated_is, value_loss)
from rl_jax.losses.kl import KL_KINDS, entropy_from_logits, kl_penalty, kl_reward
from rl_jax.losses.policy import (ace_scale, decoupled_weights, gspo_log_ratio, m2po_clip_bound,
                                  m2po_mask, policy_loss, ppo_clip_per_token,
                                  sequence_log_ratio, truncated_is_weights,
                                  value_loss_per_token)
from rl_jax.losses.presets import PRESET_KNOBS, PRESETS, build, get_objective
from rl_jax.losses.vcpo import (effective_sample_size, ess_lr_multiplier, ess_ratio_from_sums,
                                ess_sums, head_grad_sq_norms, identity_transform,
                                opob_advantages, opob_baseline, per_row_grad_sq_norms,
                                scale_by_ess, sequence_log_weights)
