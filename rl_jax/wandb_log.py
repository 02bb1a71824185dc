"""Optional Weights & Biases logging (``--config.log.wandb=True``); never required.

``wandb`` is imported only when the flag is on; if it is not installed the run stops before
anything compiles with one line saying so. The run id is kept in ``DIR/wandb_run_id``, so a
resumed training run keeps logging to the same W&B run. Logged per step: every numeric
metric of the ``metrics.jsonl`` row, at its step.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Mapping

from rl_jax import config as config_lib
from rl_jax.errors import ConfigError

__all__ = ["WandbSink", "check", "sinks"]


def _import_wandb():
  try:
    return importlib.import_module("wandb")
  except ImportError as e:
    raise ConfigError("config.log.wandb=True needs the wandb package (pip install wandb), "
                      f"which cannot be imported ({e}); or set --config.log.wandb=False") from None


def check(config) -> None:
  """Raises ConfigError (one line) if ``log.wandb`` is on and wandb cannot be imported (the
  rule is ``rl_jax.config.check_wandb``)."""
  config_lib.check_wandb(config)


class WandbSink:
  """A metrics sink (``write(step, record)``, ``close()``) that logs to one W&B run."""

  def __init__(self, config, workdir: str):
    wandb = _import_wandb()
    id_path = os.path.join(workdir, "wandb_run_id")
    run_id = open(id_path).read().strip() if os.path.exists(id_path) else wandb.util.generate_id()
    with open(id_path, "w") as f:
      f.write(run_id)
    self.run = wandb.init(project=config.log.wandb_project, name=config.log.wandb_name,
                          id=run_id, resume="allow", dir=workdir, config=config.to_dict())

  def write(self, step: int, record: Mapping[str, Any]) -> None:
    values = {k: v for k, v in record.items()
              if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    self.run.log(values, step=int(step))

  def close(self) -> None:
    self.run.finish()


def sinks(config, workdir: str) -> list:
  """The extra metrics sinks the config asks for ([] unless ``log.wandb``)."""
  return [WandbSink(config, workdir)] if config.log.wandb else []
