"""Named objectives reproducing published recipes, each one ``chain(...)`` of stages.

``get_objective("dapo")``, ``get_objective("grpo", kl_beta=0.0)`` or
``get_objective({"name": "gspo", "eps_high": 5e-4})`` (any mapping, e.g. an ml-collections
ConfigDict). Every preset accepts the same keyword knobs (``PRESET_KNOBS``); a preset only
sets different defaults.

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

References: Shao et al. 2024 (DeepSeekMath, GRPO: eps 0.2, beta 0.04, k3); Yu et al. 2025
(DAPO); Liu et al. 2025 (Dr.GRPO); Zheng et al. 2025 (GSPO); VCPO (mit-han-lab);
Zheng et al. 2025 (M2PO); Fu et al. 2025 (AReaL); Schulman et al. 2017 (PPO); Ahmadian et
al. 2024 (RLOO); Hu 2025 (REINFORCE++).
"""

from __future__ import annotations

from typing import Any, Mapping

from rl_jax.losses import compose as C
from rl_jax.losses import vcpo as vcpo_lib

ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "mc_grpo",
              "gae", "gdpo", "opob")
POLICIES = ("ppo_clip", "gspo", "reinforce", "reinforce_ratio", "m2po_clip_budget", "none")

_BASE = dict(
    advantage="grpo",        # one of ADVANTAGES
    adv_eps=1e-6,            # GRPO std epsilon
    adv_kl_beta=0.01,        # REINFORCE++: KL coefficient folded into the reward
    gamma=1.0, lam=1.0,      # GAE / REINFORCE++ discount and lambda
    gdpo_weights=None,       # GDPO component weights
    opob_tis_cap=None,       # VCPO compatibility switch: W also times min(w, 8)^2
    policy="ppo_clip",       # one of POLICIES
    eps_low=0.2, eps_high=0.2,  # epsilon_low / epsilon_high clip range
    dual_clip=None,          # dual-clip bound c (True -> 3)
    kl_beta=0.0, kl_kind="k3",  # beta and estimator of the KL loss term (0 = off)
    entropy_coef=0.0,        # entropy bonus coefficient (0 = off)
    tis_level=None,          # None, "token" or "sequence": truncated IS vs the sampler
    tis_cap=2.0,             # C of truncated IS (None = untruncated)
    decoupled_cap=None,      # AReaL behaviour-weight cap (None = off)
    decoupled_mode="mask",   # "mask" or "clamp"
    m2po_tau=None,           # M2PO second-moment threshold tau (None = off)
    ace_alpha=None,          # ACE strength (None = off)
    value_coef=0.0, value_clip=0.2,  # PPO value loss coefficient and clip
    agg="token-mean", agg_norm=None,  # aggregation mode and C for ...-token-sum-norm
    ess_scaling=False, ess_rho_base=1.0, ess_rule="sqrt",  # VCPO ESS lr multiplier
)

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
}

PRESET_KNOBS = tuple(_BASE)


def _advantage(k: dict) -> C.AdvantageEstimator:
  a = k["advantage"]
  if a == "grpo":
    return C.grpo("std", k["adv_eps"])
  if a == "dr_grpo":
    return C.dr_grpo()
  if a == "rloo":
    return C.rloo()
  if a == "reinforce_pp":
    return C.reinforce_pp(k["adv_kl_beta"], k["gamma"])
  if a == "reinforce_pp_baseline":
    return C.reinforce_pp_baseline()
  if a == "mc_grpo":
    return C.mc_grpo()
  if a == "gae":
    return C.gae(k["gamma"], k["lam"])
  if a == "gdpo":
    return C.gdpo(k["gdpo_weights"], k["adv_eps"])
  if a == "opob":
    return C.opob(k["opob_tis_cap"])
  raise ValueError(f"unknown advantage {a!r}; choose one of {list(ADVANTAGES)}")


def _policy(k: dict) -> C.LossStage | None:
  p = k["policy"]
  if p == "ppo_clip":
    return C.ppo_clip(k["eps_low"], k["eps_high"], k["dual_clip"])
  if p == "gspo":
    return C.gspo_clip(k["eps_low"], k["eps_high"])
  if p in ("reinforce", "reinforce_ratio"):
    return C.reinforce(ratio=p == "reinforce_ratio")
  if p == "m2po_clip_budget":
    return C.m2po_clip_budget(k["m2po_tau"] or 0.04)
  if p == "none":
    return None
  raise ValueError(f"unknown policy {p!r}; choose one of {list(POLICIES)}")


def build(name: str = "custom", **knobs: Any) -> C.Objective:
  """Build an objective from knobs (see ``_BASE`` for names and meanings)."""
  unknown = sorted(set(knobs) - set(_BASE))
  if unknown:
    raise ValueError(f"unknown objective option(s) {unknown}; valid: {sorted(_BASE)}")
  k = {**_BASE, **knobs}
  parts: list[Any] = [_advantage(k)]
  policy = _policy(k)
  if policy is not None:
    parts.append(policy)
  if k["tis_level"] is not None:
    parts.append(C.truncated_is(k["tis_cap"], k["tis_level"]))
  if k["decoupled_cap"] is not None:
    parts.append(C.decoupled(k["decoupled_cap"], k["decoupled_mode"]))
  if k["m2po_tau"] is not None and k["policy"] != "m2po_clip_budget":
    parts.append(C.m2po(k["m2po_tau"]))
  if k["ace_alpha"] is not None:
    parts.append(C.ace(k["ace_alpha"]))
  if k["kl_beta"]:
    parts.append(C.kl_term(k["kl_beta"], k["kl_kind"]))
  if k["entropy_coef"]:
    parts.append(C.entropy_bonus(k["entropy_coef"]))
  if k["value_coef"]:
    parts.append(C.value_loss(k["value_coef"], k["value_clip"]))
  if k["ess_scaling"] or k["advantage"] == "opob":
    parts.append(C.ess_metrics())
  if k["ess_scaling"]:
    parts.append(vcpo_lib.scale_by_ess(k["ess_rho_base"], k["ess_rule"]))
  parts.append(C.aggregation(k["agg"], k["agg_norm"]))
  return C.chain(*parts, name=name)


def get_objective(name_or_config: str | Mapping[str, Any], **overrides: Any) -> C.Objective:
  """A named preset, optionally with overridden knobs.

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
  return build(name, **{**PRESETS[name], **cfg, **overrides})
