"""On-policy distillation's teacher (``distill.teacher_path``): a frozen Hugging Face
checkpoint that scores the tokens the policy samples.

The student samples as in any RL step; the teacher's pass gives the log-probs of those
tokens under the teacher, ``teacher_logp`` [G,M,R] (``inputs.INPUTS``), and the objective's
estimator turns ``teacher_logp - behaviour_logp`` into per-token advantages
(``losses.distill``, ``losses.with_distillation``). The teacher never trains and is not in
the checkpoint: a resumed run reads it again from its directory.

* ``Setup.teacher_cfg``: the teacher's ``ModelConfig`` from its ``config.json``, built with
  the setup (``context.teacher_config``: the one error line of a teacher the run cannot use:
  no such directory, another vocabulary size, a tokenizer that maps ids to other strings
  than the policy's).
* ``load_teacher``: its weights, laid out on the training mesh by the same sharding rules as
  the policy (FSDP shards it like the policy), stored in the compute dtype, and in host memory
  with ``train.offload`` naming ``teacher``.
Its log-prob pass is ``steps.make_teacher_logprob_fn``: the policy's pass run with the
teacher's config and weights (the same temperature, packing and micro-batches).

The teacher may be a larger model of another architecture; it must share the policy's
vocabulary, since it reads the policy's token ids.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from rl_jax import models
from rl_jax.errors import ConfigError, ModelError
from rl_jax.train import offload
from rl_jax.train.context import Setup

__all__ = ["load_teacher", "teacher_shardings", "abstract_teacher", "offloaded"]


def offloaded(s: Setup) -> bool:
  """Whether ``train.offload`` names the teacher (kept in host memory between passes)."""
  return "teacher" in s.train.offload_parts


def teacher_shardings(s: Setup) -> Any:
  """The teacher's parameter shardings: the policy's rules on the training mesh (in host
  memory when offloaded)."""
  sh = models.param_shardings(s.teacher_cfg, s.mesh, s.rules)
  return jax.tree.map(offload.host_sharding, sh) if offloaded(s) else sh


def abstract_teacher(s: Setup) -> Any:
  """The teacher's weights as ShapeDtypeStructs on ``teacher_shardings`` (the memory plan
  and the TPU compile plan; nothing is read)."""
  shapes = jax.eval_shape(functools.partial(models.init_params, s.teacher_cfg),
                          jax.random.key(0))
  return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                      shapes, teacher_shardings(s))


def load_teacher(s: Setup) -> Any:
  """The teacher's weights, read from ``distill.teacher_path`` onto ``teacher_shardings``."""
  where = f"distill.teacher_path={s.distill.teacher_path}"
  if offloaded(s):
    offload.check_backend(("teacher",), s.mesh.devices.flat)
  device_sh = models.param_shardings(s.teacher_cfg, s.mesh, s.rules)
  try:
    _, params = models.load_hf(s.distill.teacher_path,
                               dtype=jnp.dtype(s.teacher_cfg.param_dtype), shardings=device_sh)
  except (ModelError, ValueError, KeyError) as e:
    raise ConfigError(f"{where}: {e}") from None
  if offloaded(s):
    params = jax.device_put(params, teacher_shardings(s))
  return params
