"""Advantage estimators in one form, ``compute(ObjectiveInputs) -> Advantages``, and their
registry.

Every estimator reads the same record (``ObjectiveInputs``: rewards [G,M], mask [G,M,R] and
optional fields) and declares in ``needs`` the optional fields it reads, so a trainer never
has to know an estimator by name: it fills the fields that ``Objective.needs`` names.

Estimators are made by name from the preset knobs through a registry; a user adds one from
outside the package with ``register_advantage``:

    def my_factory(knobs):
      return AdvantageEstimator(lambda x: Advantages(x.rewards - x.rewards.mean()), "centred")
    register_advantage("centred", my_factory)
    obj = get_objective("grpo", advantage="centred")

The formulas are the plain functions of ``advantages.py`` and ``vcpo.py``; see the
"Advantages" and "VCPO" sections of docs/ALGORITHMS.md.

Axis letters: G groups (prompts), M samples per prompt, R response tokens, C reward
components, U turns.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax.numpy as jnp

from rl_jax.losses import advantages as adv_lib
from rl_jax.losses import turns as turns_lib
from rl_jax.losses import vcpo as vcpo_lib
from rl_jax.losses._registry import Registry
from rl_jax.losses._utils import check_choice
from rl_jax.losses.inputs import INPUT_FIELDS, Advantages, ObjectiveInputs, check_inputs
from rl_jax.losses.kl import kl_penalty

__all__ = ["ADVANTAGES", "AdvantageEstimator", "GRPO_SCALES", "MC_GRPO_SCALES",
           "TURN_FIELDS", "advantage_names", "dr_grpo", "gae", "gdpo", "gigpo", "grpo",
           "make_advantage", "mc_grpo", "opob", "register_advantage", "reinforce_pp",
           "reinforce_pp_baseline", "rloo", "distill", "with_distillation",
           "DISTILL_NEEDS", "NO_RETURNS", "sampled_reverse_kl"]

GRPO_SCALES = ("std", "none")
MC_GRPO_SCALES = ("mad", "none")
TURN_FIELDS = ("turn_rewards", "turn_ids", "turn_states")  # what GiGPO reads


class AdvantageEstimator(NamedTuple):
  """An advantage estimator.

  Attributes:
    compute: ``(ObjectiveInputs) -> Advantages``; pure and jittable.
    name: the estimator's name (``Objective.estimator``).
    needs: ObjectiveInputs fields it reads besides ``rewards`` and ``mask``.
  """

  compute: Callable[[ObjectiveInputs], Advantages]
  name: str
  needs: tuple[str, ...] = ()


def _estimator(name: str, fn: Callable[[ObjectiveInputs], Advantages],
               needs: tuple[str, ...] = (), required: tuple[str, ...] | None = None
               ) -> AdvantageEstimator:
  """Wrap ``fn`` with the input checks: shapes, and ``required`` (default ``needs``) present."""
  required = needs if required is None else required

  def compute(inputs: ObjectiveInputs) -> Advantages:
    check_inputs(inputs, required, name)
    return fn(inputs)

  return AdvantageEstimator(compute, name, tuple(needs))


def _rows(x, g: int, m: int):
  """[G,M,...] -> [G·M,...]."""
  return x.reshape(g * m, *x.shape[2:])


# ------------------------------------------------------------------- sequence-level
def grpo(scale: str = "std", eps: float = 1e-6) -> AdvantageEstimator:
  """GRPO group-normalised advantages: ``A_i = (s_i - mean_g) / (std_g + eps)`` -> [G,M].

  ``scale="none"`` is Dr.GRPO (``s_i - mean_g``). Reads rewards only.

  References: Shao et al. 2024, DeepSeekMath (GRPO); Liu et al. 2025, Understanding
  R1-Zero-Like Training (Dr.GRPO). docs/ALGORITHMS.md, "Advantages".
  """
  check_choice("scale", scale, GRPO_SCALES)
  return _estimator("grpo" if scale == "std" else "dr_grpo",
                    lambda x: Advantages(adv_lib.grpo_advantages(x.rewards, scale, eps)))


def dr_grpo() -> AdvantageEstimator:
  """Dr.GRPO: ``A_i = s_i - mean_g`` -> [G,M]. References: Liu et al. 2025 (Dr.GRPO)."""
  return grpo(scale="none")


def rloo() -> AdvantageEstimator:
  """RLOO leave-one-out baseline: ``A_i = s_i - mean_{j != i} s_j`` -> [G,M].

  References: Ahmadian et al. 2024, Back to Basics (RLOO). docs/ALGORITHMS.md, "Advantages".
  """
  return _estimator("rloo", lambda x: Advantages(adv_lib.rloo_advantages(x.rewards)))


def reinforce_pp_baseline() -> AdvantageEstimator:
  """REINFORCE++-baseline: group mean subtracted, whitened over tokens -> [G,M].

  Rows are weighted by ``lengths`` (loss tokens per sample); when ``lengths`` is None it is
  taken as ``mask.sum(-1)``.

  References: Hu 2025, REINFORCE++. docs/ALGORITHMS.md, "Advantages".
  """

  def fn(x: ObjectiveInputs) -> Advantages:
    lengths = x.lengths
    if lengths is None:
      lengths = jnp.sum(x.mask, axis=-1).astype(jnp.float32)
    return Advantages(adv_lib.reinforce_pp_baseline_advantages(x.rewards, lengths))

  return _estimator("reinforce_pp_baseline", fn, ("lengths",), required=())


def mc_grpo(scale: str = "mad", eps: float = 1e-3) -> AdvantageEstimator:
  """MC-GRPO: median baseline and MAD scale over M samples; the pivot row is dropped.

  Returns ``Advantages(advantages [G,M], keep=[G,M])``: the pivot (the median's sample) has
  advantage 0 and ``keep`` False, the other M - 1 rows carry ``mc_grpo_advantages``' values.

  References: Kim 2026, MC-GRPO: Median-Centered Group Relative Policy Optimization for
  Small-Rollout Reinforcement Learning. docs/ALGORITHMS.md, "Advantages".
  """
  check_choice("scale", scale, MC_GRPO_SCALES)

  def fn(x: ObjectiveInputs) -> Advantages:
    kept, rows = adv_lib.mc_grpo_advantages(x.rewards, scale, eps)  # [G,M-1]
    hit = rows[:, :, None] == jnp.arange(x.rewards.shape[1])[None, None, :]  # [G,M-1,M]
    adv = jnp.sum(jnp.where(hit, kept[:, :, None], 0.0), axis=1)
    return Advantages(adv, keep=jnp.any(hit, axis=1))

  return _estimator("mc_grpo", fn)


def gdpo(weights=None, eps: float = 1e-6) -> AdvantageEstimator:
  """GDPO: each of the C ``reward_components`` GRPO-normalised, weighted sum, whitened -> [G,M].

  References: Liu et al. 2026, GDPO: Group reward-Decoupled Normalization Policy
  Optimization for Multi-reward RL Optimization. docs/ALGORITHMS.md, "Advantages".
  """

  def fn(x: ObjectiveInputs) -> Advantages:
    return Advantages(adv_lib.gdpo_advantages(x.reward_components, weights, eps))

  return _estimator("gdpo", fn, ("reward_components",))


def opob(tis_cap: float | None = None) -> AdvantageEstimator:
  """VCPO off-policy optimal baseline: ``A_i = (s_i - b_g) / sigma_g`` -> [G,M].

  ``log w_i = sequence_log_weights(old_logp, behaviour_logp, mask)`` per row and
  ``grad_sq_norms`` (``per_row_grad_sq_norms`` or ``head_grad_sq_norms``) weight the
  baseline ``b_g = sum W s / sum W`` with ``W = w^2 ||grad log pi||^2``.

  References: VCPO (Variance-Controlled Policy Optimization), off-policy optimal baseline.
  docs/ALGORITHMS.md, "VCPO".
  """

  def fn(x: ObjectiveInputs) -> Advantages:
    g, m, _ = x.mask.shape
    log_w = vcpo_lib.sequence_log_weights(_rows(x.old_logp, g, m), _rows(x.behaviour_logp, g, m),
                                          _rows(x.mask, g, m)).reshape(g, m)
    return Advantages(vcpo_lib.opob_advantages(x.rewards, log_w, x.grad_sq_norms, tis_cap))

  return _estimator("opob", fn, ("old_logp", "behaviour_logp", "grad_sq_norms"))


# ---------------------------------------------------------------------- token-level
def reinforce_pp(kl_beta: float = 0.01, gamma: float = 1.0) -> AdvantageEstimator:
  """REINFORCE++: discounted token returns, whitened over the batch -> [G,M,R].

  Token reward: the sequence reward on the last loss token minus ``kl_beta * kl_t``, with
  ``kl_t = kl_penalty(old_logp, ref_logp, "k1")`` (the policy at the start of the step
  against the reference). ``kl_beta = 0`` reads neither log-prob.

  References: Hu 2025, REINFORCE++; Ouyang et al. 2022 (KL in the reward).
  docs/ALGORITHMS.md, "Advantages".
  """
  needs = ("old_logp", "ref_logp") if kl_beta else ()

  def fn(x: ObjectiveInputs) -> Advantages:
    g, m, r = x.mask.shape
    mask = x.mask.astype(bool)
    kl = None
    if kl_beta:
      kl = _rows(kl_penalty(jnp.where(mask, x.old_logp, 0.0), jnp.where(mask, x.ref_logp, 0.0),
                            "k1"), g, m)
    adv = adv_lib.reinforce_pp_advantages(x.rewards.reshape(g * m), _rows(mask, g, m), kl,
                                          kl_beta, gamma)
    return Advantages(adv.reshape(g, m, r))

  return _estimator("reinforce_pp", fn, needs)


def gae(gamma: float = 1.0, lam: float = 1.0, whiten: bool = True) -> AdvantageEstimator:
  """GAE with the critic's rollout-time ``values`` -> ``(advantages, returns)`` [G,M,R].

  The sequence reward sits on the last token of ``generated_mask`` (or ``mask`` when None),
so masking stale tokens from the loss never moves it; the scan, the whitening and the
returns run over the loss ``mask`` (a reward on a token outside it is not seen).

  References: Schulman et al. 2016, High-Dimensional Continuous Control Using GAE.
  docs/ALGORITHMS.md, "Advantages".
  """

  def fn(x: ObjectiveInputs) -> Advantages:
    g, m, r = x.mask.shape
    gen = (x.mask if x.generated_mask is None else x.generated_mask).astype(bool)
    t = jnp.arange(r)
    last = jnp.max(jnp.where(gen, t, -1), axis=-1, keepdims=True)
    token_rewards = jnp.where(t == last, x.rewards[..., None], 0.0)
    adv, ret = adv_lib.gae_advantages(_rows(token_rewards, g, m), _rows(x.values, g, m),
                                      _rows(x.mask, g, m), gamma, lam, whiten)
    return Advantages(adv.reshape(g, m, r), returns=ret.reshape(g, m, r))

  return _estimator("gae", fn, ("values",))


# ------------------------------------------------------------ on-policy distillation
DISTILL_NEEDS = ("teacher_logp", "behaviour_logp")  # what the reverse-KL advantage reads


def _reverse_kl_advantages(x: ObjectiveInputs, coef: float):
  """``coef · (teacher_logp - behaviour_logp)`` on the loss tokens, 0 elsewhere -> [G,M,R]."""
  mask = x.mask.astype(bool)
  gap = x.teacher_logp.astype(jnp.float32) - x.behaviour_logp.astype(jnp.float32)
  return jnp.where(mask, coef * gap, 0.0)


def sampled_reverse_kl(teacher_logp, behaviour_logp, mask):
  """Mean over the ``mask`` tokens of ``behaviour_logp - teacher_logp`` (all [G,M,R]): the
  single-sample estimate of the per-token reverse KL(μ || π_T) that ``distill`` minimises;
  float32 scalar, 0 without tokens."""
  mask = mask.astype(bool)
  gap = jnp.where(mask, behaviour_logp.astype(jnp.float32) - teacher_logp.astype(jnp.float32),
                  0.0)
  return jnp.sum(gap) / jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)


def distill(coef: float = 1.0) -> AdvantageEstimator:
  """On-policy distillation: each sampled token's advantage is ``coef · (log π_T(y_t | ·) -
  log μ(y_t | ·))`` -> [G,M,R], the negative of the single-sample estimate of the per-token
  reverse KL from the sampler μ (the policy that sampled, ``behaviour_logp``) to a frozen
  teacher π_T (``teacher_logp``). No reward is read: minimising the reverse KL on the
  student's own samples is the whole objective. Each token's advantage is its own (no
  return-to-go, no normalisation), so a token the teacher finds likelier than the student
  is pushed up and one it finds unlikelier is pushed down.

  References: Agarwal et al. 2024, On-Policy Distillation of Language Models (GKD); Gu et
  al. 2024 (MiniLLM); Qwen3 technical report 2025 and Lu & Thinking Machines 2025, "On-Policy
  Distillation" (the per-token reverse KL as the advantage). docs/ALGORITHMS.md,
  "On-policy distillation".
  """
  if not coef > 0:
    raise ValueError(f"distill_coef must be > 0, got {coef!r}")
  return _estimator("distill", lambda x: Advantages(_reverse_kl_advantages(x, coef)),
                    DISTILL_NEEDS)


def with_distillation(est: AdvantageEstimator, coef: float) -> AdvantageEstimator:
  """``est``'s advantages plus the reverse-KL advantage of ``distill(coef)``: a sequence-level
  [G,M] advantage is put on every token first, so the sum is token-level [G,M,R]; returns and
  ``keep`` pass through. The task reward and the teacher both steer the policy."""
  if not coef > 0:
    raise ValueError(f"distill_coef must be > 0, got {coef!r}")

  def fn(x: ObjectiveInputs) -> Advantages:
    out = est.compute(x)
    adv = out.advantages
    if adv.ndim == 2:
      adv = jnp.broadcast_to(adv[..., None], x.mask.shape)
    adv = jnp.where(x.mask.astype(bool), adv, 0.0) + _reverse_kl_advantages(x, coef)
    return out._replace(advantages=adv)

  needs = tuple(dict.fromkeys(est.needs + DISTILL_NEEDS))
  return _estimator(f"{est.name}+distill", fn, needs, DISTILL_NEEDS)


# ----------------------------------------------------------------------- turn-level
def gigpo(omega: float = 1.0, gamma: float = 0.95, scale: str = "std",
          eps: float = 1e-6) -> AdvantageEstimator:
  """GiGPO for multi-turn trajectories: ``A = A_E + omega * A_S`` per token -> [G,M,R].

  ``A_E`` is GRPO over the trajectory returns ``rewards`` [G,M]; ``A_S`` normalises the
  discounted return-to-go of each turn (``turn_rewards`` [G,M,U], discount ``gamma``) among
  the turns of the same prompt's M trajectories that start from the same environment state
  (``turn_states`` [G,M,U]), and reaches the tokens through ``turn_ids`` [G,M,R]. ``scale``
  ("std" or "none") normalises both levels; ``omega = 0`` is GRPO per token.

  References: Feng et al. 2025, Group-in-Group Policy Optimization for LLM Agent Training
  (GiGPO; omega = 1, gamma = 0.95). docs/ALGORITHMS.md, "Multi-turn trajectories".
  """
  check_choice("scale", scale, GRPO_SCALES)
  if not 0.0 <= gamma <= 1.0:
    raise ValueError(f"GiGPO gamma must be in [0, 1], got {gamma!r}")

  def fn(x: ObjectiveInputs) -> Advantages:
    return Advantages(turns_lib.gigpo_advantages(x.rewards, x.turn_rewards, x.turn_states,
                                                 x.turn_ids, x.mask, omega, gamma, scale, eps))

  return _estimator("gigpo", fn, TURN_FIELDS)


# ------------------------------------------------------------------------- registry
def _check_estimator(name: str, est: Any) -> None:
  if not isinstance(est, AdvantageEstimator):
    raise ValueError(f"advantage {name!r}: the factory must return a losses.AdvantageEstimator, "
                     f"got {type(est).__name__}")
  unknown = [n for n in est.needs if n not in INPUT_FIELDS]
  if unknown:
    raise ValueError(f"advantage {name!r} needs unknown inputs {unknown}; ObjectiveInputs "
                     f"fields are {list(INPUT_FIELDS)}")


_REGISTRY = Registry("advantage", _check_estimator)

ADVANTAGES = _REGISTRY.view  # live, read-only view of the registered names


def register_advantage(name: str, factory: Callable[[Mapping[str, Any]], AdvantageEstimator],
                       *, overwrite: bool = False) -> None:
  """Make ``get_objective(..., advantage=name)`` use ``factory``.

  Args:
    name: the value of the ``advantage`` knob that selects it.
    factory: ``(knobs) -> AdvantageEstimator``; ``knobs`` is the full preset knob dict
      (``PRESET_KNOB_DEFAULTS`` with the preset's and the caller's values), so it can read
      ``adv_eps``, ``gamma`` and the like.
    overwrite: replace an existing entry (otherwise a second registration raises).

  Raises:
    ValueError: bad name or factory, or ``name`` taken and ``overwrite`` False.
  """
  _REGISTRY.register(name, factory, overwrite=overwrite)


def advantage_names() -> tuple[str, ...]:
  """The registered advantage names, built-ins first."""
  return _REGISTRY.names()


def make_advantage(name: str, knobs: Mapping[str, Any]) -> AdvantageEstimator:
  """The estimator registered as ``name``, built from the full knob dict ``knobs``."""
  return _REGISTRY.make(name, knobs)


for _name, _factory in (
    ("grpo", lambda k: grpo("std", k["adv_eps"])),
    ("dr_grpo", lambda k: dr_grpo()),
    ("rloo", lambda k: rloo()),
    ("reinforce_pp", lambda k: reinforce_pp(k["adv_kl_beta"], k["gamma"])),
    ("reinforce_pp_baseline", lambda k: reinforce_pp_baseline()),
    ("mc_grpo", lambda k: mc_grpo()),
    ("gae", lambda k: gae(k["gamma"], k["lam"])),
    ("gdpo", lambda k: gdpo(k["gdpo_weights"], k["adv_eps"])),
    ("opob", lambda k: opob(k["opob_tis_cap"])),
    ("gigpo", lambda k: gigpo(k["gigpo_omega"], k["gigpo_gamma"],
                              "std" if k["gigpo_std"] else "none", k["adv_eps"])),
    ("distill", lambda k: distill(1.0 if k["distill_coef"] is None else k["distill_coef"])),
):
  register_advantage(_name, _factory)
del _name, _factory

# the built-in estimators without returns for a value loss to fit (GAE's are A + V)
NO_RETURNS = frozenset(name for name in advantage_names() if name != "gae")
