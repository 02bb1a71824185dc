"""The exceptions rl_jax raises for mistakes a user can make.

Every error a user can cause (a bad config value, a missing checkpoint, a malformed data
file, a model/weights mismatch) is raised as a subclass of ``RLJaxError`` with a one-line
message that names the offending key, file or array. The command-line entry points catch
``RLJaxError`` (see ``rl_jax.config_utils.main_guard``) and print ``error: <message>``
instead of a traceback; anything else is a bug and keeps its traceback.

Each class also derives from the matching builtin so callers can catch it the ordinary way
(``except ValueError``, ``except FileNotFoundError``).
"""

from __future__ import annotations

__all__ = ["RLJaxError", "ConfigError", "CheckpointError", "CheckpointNotFoundError",
           "CheckpointCorruptError",
           "DataError", "ModelError", "WorkdirBusyError", "StorageError"]


class RLJaxError(Exception):
  """Base class of every error rl_jax raises for a user mistake."""


class ConfigError(RLJaxError, ValueError):
  """A config file, config key or config value is wrong."""


class CheckpointError(RLJaxError, ValueError):
  """A checkpoint cannot be written or does not match what restore asked for."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
  """No (complete) checkpoint exists where restore looked."""


class CheckpointCorruptError(CheckpointError):
  """A saved step does not read back whole (a file missing, changed or unreadable)."""


class DataError(RLJaxError, ValueError):
  """An input data file, task or tokenizer is malformed or missing something."""


class ModelError(RLJaxError, ValueError):
  """A model config, weights file or parameter tree is inconsistent."""


class WorkdirBusyError(RLJaxError, RuntimeError):
  """Another live run holds the workdir (``rl_jax.train.lock``)."""


class StorageError(RLJaxError, OSError):
  """A path (``gs://...``) cannot be used: its client is missing or it cannot be reached."""
