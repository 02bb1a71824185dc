"""Named objectives reproducing published recipes, each one ``chain(...)`` of stages.

``get_objective("dapo")``, ``get_objective("grpo", kl_beta=0.0)`` or
``get_objective({"name": "gspo", "eps_high": 5e-4})`` (any mapping, e.g. an ml-collections
ConfigDict). Every preset accepts the same keyword knobs, each declared once in ``KNOBS`` (its
type, default, range and meaning; ``PRESET_KNOBS``, ``PRESET_KNOB_DEFAULTS`` and
``PRESET_KNOB_TYPES`` are views of it, and ``config.loss`` is built from it); a preset only
sets different defaults.
The ``advantage`` and ``policy`` knobs name registry entries (``ADVANTAGES``, ``POLICIES``),
so an estimator registered with ``register_advantage`` is selected like a built-in one.

| preset | advantage | policy term | corrections / terms | aggregation |
|---|---|---|---|---|
| grpo | GRPO (std) | PPO clip 0.2 | k3 KL loss, beta 0.04 | seq-mean-token-mean |
| dapo | GRPO (std) | PPO clip 0.2 / 0.28 | - | token-mean |
| dr_grpo | s - mean | PPO clip 0.2 | - | seq-mean-token-sum-norm |
| gspo | GRPO (std) | sequence ratio, clip 3e-4 / 4e-4 | - | seq-mean-token-mean |
| vcpo | OPOB | -A r (no clip) | sequence TIS cap 8; ESS lr scale | seq-mean-token-mean |
| m2po | GRPO (std) | -A r (no clip) | behaviour weight; M2PO mask tau 0.04 | token-mean |
| decoupled_ppo | GRPO (std) | PPO clip 0.2 vs prox | behaviour weight, mask w > 5 | token-mean |
| ppo | GAE (gamma 1, lambda 1) | PPO clip 0.2 | clipped value loss 0.5 | token-mean |
| rloo | RLOO | PPO clip 0.2 | - | token-mean |
| reinforce_pp | REINFORCE++ (KL 0.01 in reward) | PPO clip 0.2 | - | token-mean |
| reinforce_pp_baseline | REINFORCE++-baseline | PPO clip 0.2 | - | token-mean |
| mc_grpo | MC-GRPO (median/MAD) | PPO clip 0.2 | - | token-mean |
| on_policy_distill | coef (teacher - sampler log-prob), per token | PPO clip 0.2 | - | token-mean |

On-policy distillation beside a task reward: ``distill_coef`` on any other preset adds the
teacher's per-token term to that preset's advantages (``estimators.with_distillation``).

Training-inference mismatch corrections have no preset of their own; they are knobs on any
preset: ``mis_level`` (masked IS), ``icepop_beta`` (IcePop), ``geo_mean_is`` (geometric-mean
sequence IS), ``minpro`` (MinPRO), next to ``tis_level``.

References: Shao et al. 2024 (DeepSeekMath, GRPO: eps 0.2, beta 0.04, k3); Yu et al. 2025
(DAPO); Liu et al. 2025 (Dr.GRPO); Zheng et al. 2025 (GSPO); VCPO (mit-han-lab);
Zheng et al. 2025 (M2PO); Fu et al. 2025 (AReaL); Schulman et al. 2017 (PPO); Ahmadian et
al. 2024 (RLOO); Hu 2025 (REINFORCE++); Kim 2026 (MC-GRPO); Feng et al. 2025 (GiGPO, no
preset: ``advantage="gigpo"`` on any preset); Liu, Li et al. 2025 (MIS); Ling Team 2025
(IcePop); "A Step Back: Prefix Importance Ratio Stabilizes Policy Optimization", 2026
(MinPRO); Agarwal et al. 2024 (on-policy distillation, GKD) and Lu & Thinking Machines 2025
(the reverse KL per token as the advantage). docs/ALGORITHMS.md describes each part.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, NamedTuple

from rl_jax import value_checks as vc
from rl_jax.losses import stages as st
from rl_jax.losses import vcpo as vcpo_lib
from rl_jax.losses.aggregation import AGG_MODES, aggregation
from rl_jax.losses.compose import Objective, chain
from rl_jax.losses.estimators import (ADVANTAGES, NO_RETURNS, make_advantage,
                                      with_distillation)
from rl_jax.losses.kl import KL_KINDS
from rl_jax.losses.policy import DECOUPLED_MODES, MIS_LEVELS, MIS_MODES, TIS_LEVELS
from rl_jax.losses.stages import POLICIES
from rl_jax.losses.vcpo import ESS_RULES

__all__ = ["Knob", "KNOBS", "PRESETS", "PRESET_KNOBS", "PRESET_KNOB_DEFAULTS", "PRESET_KNOB_TYPES",
           "get_objective"]


class Knob(NamedTuple):
  """One knob of the objectives: the python ``kind`` of a command-line override (a knob whose
  default is None takes that kind or None; ``dual_clip`` also accepts True, meaning c = 3),
  its ``default``, what it ``means`` and the ``check`` of a value other than None
  (``rl_jax.value_checks``; None: any value of its kind). The config's ``loss`` section and
  ``get_objective`` both apply the check."""

  kind: type
  default: Any
  means: str
  check: vc.Check | None = None

  def problem(self, value: Any) -> str | None:
    """None if ``value`` is allowed, else the requirement it violates."""
    return None if value is None or self.check is None else self.check(value)


_BOOL = vc.one_of((False, True))
# a band around 1: a token or row without mismatch (ratio 1) is always kept
_BELOW_ONE = vc.in_range(0.0, 1.0, high_inclusive=False)
_ABOVE_ONE = vc.in_range(1.0, None)

# every knob, declared once: the defaults every preset starts from, their types and ranges
KNOBS: Mapping[str, Knob] = MappingProxyType(dict(
    advantage=Knob(str, "grpo", "one of ADVANTAGES (estimators.py), or a registered name",
                   vc.one_of(ADVANTAGES)),
    adv_eps=Knob(float, 1e-6, "GRPO std epsilon (> 0: a group of equal rewards has std 0)",
                 vc.positive),
    adv_kl_beta=Knob(float, 0.01, "REINFORCE++: KL coefficient folded into the reward",
                     vc.nonnegative),
    gamma=Knob(float, 1.0, "GAE / REINFORCE++ discount", vc.probability),
    lam=Knob(float, 1.0, "GAE / REINFORCE++ lambda", vc.probability),
    gdpo_weights=Knob(tuple, None, "GDPO component weights, one per reward component"),
    opob_tis_cap=Knob(float, None, "VCPO compatibility switch: W also times min(w, 8)^2",
                      vc.positive),
    gigpo_omega=Knob(float, 1.0, "GiGPO: weight omega of the step-level advantage",
                     vc.nonnegative),
    gigpo_gamma=Knob(float, 0.95, "GiGPO: discount of the per-turn return-to-go",
                     vc.probability),
    gigpo_std=Knob(bool, True, "GiGPO: divide both levels by the group std (False: centre only)",
                   _BOOL),
    policy=Knob(str, "ppo_clip", "one of POLICIES (stages.py), or a registered name",
                vc.one_of(POLICIES)),
    eps_low=Knob(float, 0.2, "epsilon_low of the clip range", vc.nonnegative),
    eps_high=Knob(float, 0.2, "epsilon_high of the clip range", vc.nonnegative),
    dual_clip=Knob(float, None, "dual-clip bound c (True -> 3)"),
    kl_beta=Knob(float, 0.0, "beta of the KL loss term (0 = off)", vc.nonnegative),
    kl_kind=Knob(str, "k3", "estimator of the KL loss term (KL_KINDS)", vc.one_of(KL_KINDS)),
    entropy_coef=Knob(float, 0.0, "entropy bonus coefficient (0 = off)", vc.nonnegative),
    tis_level=Knob(str, None, "None or one of TIS_LEVELS: truncated IS vs the sampler",
                   vc.one_of(TIS_LEVELS)),
    tis_cap=Knob(float, 2.0, "C of truncated IS (None = untruncated)", vc.positive),
    mis_level=Knob(str, None, "None or one of MIS_LEVELS: masked IS (reject outside the band)",
                   vc.one_of(MIS_LEVELS)),
    mis_low=Knob(float, None, "MIS band's lower end of the ratio (None = open)", _BELOW_ONE),
    mis_high=Knob(float, 2.0, "MIS band's upper end of the ratio (None = open)", _ABOVE_ONE),
    mis_mode=Knob(str, "weight", 'one of MIS_MODES: kept rows weighted by rho, or by 1 ("mask")',
                  vc.one_of(MIS_MODES)),
    icepop_beta=Knob(float, None, "IcePop band upper bound beta > 1 (None = off)",
                     vc.in_range(1.0, None, low_inclusive=False)),
    icepop_alpha=Knob(float, None, "IcePop lower bound alpha in (0, 1) (None = 1 / beta)",
                      vc.in_range(0.0, 1.0, low_inclusive=False, high_inclusive=False)),
    geo_mean_is=Knob(bool, False, "geometric-mean sequence IS weight", _BOOL),
    geo_mean_cap=Knob(float, None, "its truncation C (None = untruncated)", vc.positive),
    minpro=Knob(bool, False, "MinPRO minimum-prefix-ratio weight", _BOOL),
    decoupled_cap=Knob(float, None, "AReaL behaviour-weight cap (None = off)", vc.positive),
    decoupled_mode=Knob(str, "mask", "one of DECOUPLED_MODES", vc.one_of(DECOUPLED_MODES)),
    m2po_tau=Knob(float, None, "M2PO second-moment threshold tau (None = off)", vc.positive),
    ace_alpha=Knob(float, None, "ACE strength (None = off)", vc.nonnegative),
    value_coef=Knob(float, 0.0, "PPO value loss coefficient", vc.nonnegative),
    value_clip=Knob(float, 0.2, "PPO value loss clip", vc.positive),
    agg=Knob(str, "token-mean", "aggregation mode (AGG_MODES)", vc.one_of(AGG_MODES)),
    agg_norm=Knob(float, None, "C of ...-token-sum-norm", vc.positive),
    ess_scaling=Knob(bool, False, "VCPO ESS learning-rate multiplier", _BOOL),
    ess_rho_base=Knob(float, 1.0, "its base rho", vc.positive),
    ess_rule=Knob(str, "sqrt", "its rule (ESS_RULES)", vc.one_of(ESS_RULES)),
    distill_coef=Knob(float, None, "on-policy distillation: weight of the reverse-KL advantage",
                      vc.nonnegative),
))
_BASE = {name: knob.default for name, knob in KNOBS.items()}


PRESETS: dict[str, dict[str, Any]] = {
    "grpo": dict(kl_beta=0.04, kl_kind="k3", agg="seq-mean-token-mean"),
    "dapo": dict(eps_high=0.28),
    "dr_grpo": dict(advantage="dr_grpo", agg="seq-mean-token-sum-norm"),
    "gspo": dict(policy="gspo", eps_low=3e-4, eps_high=4e-4, agg="seq-mean-token-mean"),
    "vcpo": dict(advantage="opob", policy="reinforce_ratio", tis_level="sequence", tis_cap=8.0,
                 agg="seq-mean-token-mean", ess_scaling=True),
    "m2po": dict(policy="reinforce_ratio", tis_level="token", tis_cap=None, m2po_tau=0.04),
    "decoupled_ppo": dict(decoupled_cap=5.0),
    "ppo": dict(advantage="gae", value_coef=0.5),
    "rloo": dict(advantage="rloo"),
    "reinforce_pp": dict(advantage="reinforce_pp"),
    "reinforce_pp_baseline": dict(advantage="reinforce_pp_baseline"),
    "mc_grpo": dict(advantage="mc_grpo"),
    "on_policy_distill": dict(advantage="distill", distill_coef=1.0),
}

PRESET_KNOBS = tuple(_BASE)

PRESET_KNOB_DEFAULTS: Mapping[str, Any] = MappingProxyType(dict(_BASE))

PRESET_KNOB_TYPES: dict[str, type] = {name: knob.kind for name, knob in KNOBS.items()}


def _objective(name: str, knobs: Mapping[str, Any]) -> Objective:
  """``chain`` of the parts the knobs select (``_BASE`` supplies the unset ones)."""
  unknown = sorted(set(knobs) - set(_BASE))
  if unknown:
    raise ValueError(f"unknown objective option(s) {unknown}; valid: {sorted(_BASE)}")
  for key, value in knobs.items():
    problem = KNOBS[key].problem(value)
    if problem:
      raise ValueError(f"objective option {key}={value!r} {problem}")
  k = {**_BASE, **knobs}
  if k["value_coef"] and k["advantage"] in NO_RETURNS:
    raise ValueError(f"objective option value_coef={k['value_coef']!r} trains a critic on the "
                     f"returns of GAE (advantage='gae', the ppo preset); advantage="
                     f"{k['advantage']!r} computes none")
  est = make_advantage(k["advantage"], k)
  if k["distill_coef"] is not None and k["advantage"] != "distill":
    est = with_distillation(est, k["distill_coef"])  # the teacher's term beside the task's
  parts: list[Any] = [est]
  policy = st.make_policy(k["policy"], k)
  if policy is not None:
    parts.append(policy)
  if k["tis_level"] is not None:
    parts.append(st.truncated_is(k["tis_cap"], k["tis_level"]))
  if k["mis_level"] is not None:
    parts.append(st.masked_is(k["mis_low"], k["mis_high"], k["mis_level"], k["mis_mode"]))
  if k["icepop_beta"] is not None:
    parts.append(st.icepop(k["icepop_beta"], k["icepop_alpha"]))
  if k["geo_mean_is"]:
    parts.append(st.geo_mean_is(k["geo_mean_cap"]))
  if k["minpro"]:
    parts.append(st.minpro())
  if k["decoupled_cap"] is not None:
    parts.append(st.decoupled(k["decoupled_cap"], k["decoupled_mode"]))
  if k["m2po_tau"] is not None and k["policy"] != "m2po_clip_budget":
    parts.append(st.m2po(k["m2po_tau"]))
  if k["ace_alpha"] is not None:
    parts.append(st.ace(k["ace_alpha"]))
  if k["kl_beta"]:
    parts.append(st.kl_term(k["kl_beta"], k["kl_kind"]))
  if k["entropy_coef"]:
    parts.append(st.entropy_bonus(k["entropy_coef"]))
  if k["value_coef"]:
    parts.append(st.value_loss(k["value_coef"], k["value_clip"]))
  if k["ess_scaling"] or k["advantage"] == "opob":
    parts.append(st.ess_metrics())
  if k["ess_scaling"]:
    parts.append(vcpo_lib.scale_by_ess(k["ess_rho_base"], k["ess_rule"]))
  parts.append(aggregation(k["agg"], k["agg_norm"]))
  return chain(*parts, name=name)


def get_objective(name_or_config: str | Mapping[str, Any], **overrides: Any) -> Objective:
  """A named preset, optionally with overridden knobs: the way to build a configured objective
  (``chain`` is the way to compose one from parts).

  Args:
    name_or_config: a preset name (see ``PRESETS``) or a mapping with key ``"name"`` and any
      knobs (e.g. an ml-collections ConfigDict).
    **overrides: knobs that replace the preset's (and the mapping's) values.

  Returns:
    An ``Objective``.
  """
  if isinstance(name_or_config, str):
    name, cfg = name_or_config, {}
  elif isinstance(name_or_config, Mapping) or hasattr(name_or_config, "to_dict"):
    cfg = dict(name_or_config.to_dict() if hasattr(name_or_config, "to_dict")
               else name_or_config)
    if "name" not in cfg:
      raise ValueError("an objective config needs a 'name' key naming a preset")
    name = cfg.pop("name")
  else:
    raise ValueError(f"get_objective takes a preset name or a mapping, got "
                     f"{type(name_or_config).__name__}")
  if name not in PRESETS:
    raise ValueError(f"unknown objective {name!r}; choose one of {sorted(PRESETS)}")
  return _objective(name, {**PRESETS[name], **cfg, **overrides})
