"""Value model for PPO: the decoder trunk with a scalar head instead of the LM head.

Value parameters are ``{"trunk": <decoder params without lm_head>, "head": [D]}``; the
trunk can be initialised from the policy (the usual PPO critic warm start).

Axis letters: the legend of ``rl_jax/__init__.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax.models import grouped
from rl_jax.models import transformer as tx
from rl_jax.models.config import ModelConfig

__all__ = ["init_value_params", "response_values", "value_axes", "values"]


def value_axes(cfg: ModelConfig):
  """Logical axes of the value parameters (``init_value_params``' tree)."""
  axes = dict(tx.param_axes(cfg))
  axes.pop("lm_head", None)
  return {"trunk": axes, "head": ("embed",)}


def init_value_params(cfg: ModelConfig, rng: jax.Array, policy_params=None):
  """Critic parameters; the trunk is copied from ``policy_params`` if given, head zeros."""
  trunk = policy_params if policy_params is not None else tx.init_params(cfg, rng)
  trunk = {k: v for k, v in trunk.items() if k != "lm_head"}
  return {"trunk": trunk, "head": jnp.zeros((cfg.hidden_size,), jnp.dtype(cfg.param_dtype))}


def _head(vparams, h):
  return jnp.einsum("...d,d->...", h.astype(jnp.float32), vparams["head"].astype(jnp.float32))


def values(cfg: ModelConfig, vparams, tokens, positions=None, attention_mask=None):
  """V(s_t) for every prefix: tokens int [B,T] -> float32 [B,T]."""
  return _head(vparams, tx.hidden_states(cfg, vparams["trunk"], tokens, positions,
                                              attention_mask))


def response_values(cfg: ModelConfig, vparams, prompt_tokens, prompt_lengths, response_tokens,
                    response_mask=None, shared_prefix: bool = True, packing=None):
  """Value of the state before each response token: [G,M,R] float32 (0 where masked).
  ``packing``: rows of several responses, as in ``grouped.response_logprobs``."""
  if grouped.runs_on_rows(cfg, packing, prompt_tokens.shape[1], response_tokens.shape[2],
                          shared_prefix):
    h, _ = grouped.row_states(cfg, vparams["trunk"], prompt_tokens, prompt_lengths,
                              response_tokens, packing[0])
    v = grouped.from_rows(_head(vparams, h), packing[1])
  else:
    h = grouped.response_hidden(cfg, vparams["trunk"], prompt_tokens, prompt_lengths,
                                response_tokens, shared_prefix)
    v = _head(vparams, h)
  return v if response_mask is None else jnp.where(response_mask, v, 0.0)
