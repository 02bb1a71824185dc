"""Import paths ``"module.path:attr"``: how a config names the user's own code.

One resolver for every config key that names code outside rl_jax: an environment factory
(``env.name=my_env:make``), a ``verifiers`` taskset function (``env.verifiers=my_tasks:load``)
and, by the same rule, agents and reward functions. ``resolve(path, key)`` imports the module
and returns the attribute; every mistake is one ``ConfigError`` line naming the key and the
path (no colon, a module that is not found or fails to import, a missing attribute).

Where the module is found, in order:

  1. ``sys.path``, as ``import`` would (the installed packages, and the working directory
     under ``python -m rl_jax.train``);
  2. the directories of the config files loaded so far (``load_config``), newest first: a
     file ``my_env.py`` next to ``my_run.py`` is ``env.name=my_env:make``;
  3. the working directory.

A module found in 2 or 3 is loaded from that directory without changing ``sys.path`` and
registered under its name in ``sys.modules`` (a directory with ``__init__.py`` is a package,
so ``my_pkg.envs:make`` works too). Such a module imports its siblings only as a package's
submodules (``from my_pkg import helpers``), or when its directory is on ``sys.path``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
import threading
from typing import Any, Sequence

from rl_jax.errors import ConfigError, RLJaxError

__all__ = ["call", "config_dirs", "is_import_path", "remember_config_dir", "resolve",
           "search_dirs"]

_DOTTED = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*"
_PATH = re.compile(rf"^({_DOTTED}):({_DOTTED})$")
_config_dirs: list[str] = []  # directories of the config files loaded, newest first
_lock = threading.RLock()  # a module being loaded may resolve paths itself


def is_import_path(text: Any) -> bool:
  """Whether ``text`` reads ``module.path:attr`` (dotted identifiers on both sides)."""
  return isinstance(text, str) and bool(_PATH.match(text.strip()))


def remember_config_dir(path: str) -> None:
  """Record the directory of a config file (``config_utils.load_config_file`` calls this) as
  a place to find the modules its import paths name."""
  d = os.path.dirname(os.path.abspath(path))
  with _lock:
    if d in _config_dirs:
      _config_dirs.remove(d)
    _config_dirs.insert(0, d)


def config_dirs() -> list[str]:
  """The config files' directories remembered so far, newest first."""
  with _lock:
    return list(_config_dirs)


def search_dirs() -> list[str]:
  """Where a module not on ``sys.path`` is looked for: the config dirs, then the working
  directory."""
  out = []
  for d in config_dirs() + [os.getcwd()]:
    if d not in out:
      out.append(d)
  return out


def _one_line(e: BaseException) -> str:
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _load_from(top: str, dirs: Sequence[str], prefix: str) -> bool:
  """Load the top-level module ``top`` from the first of ``dirs`` that holds it (registered
  in ``sys.modules``); False when none does."""
  importlib.invalidate_caches()  # a module written since the last look
  spec = importlib.machinery.PathFinder.find_spec(top, list(dirs))
  if spec is None or spec.loader is None:
    return False
  module = importlib.util.module_from_spec(spec)
  sys.modules[top] = module
  try:
    spec.loader.exec_module(module)
  except Exception as e:
    sys.modules.pop(top, None)
    raise ConfigError(f"{prefix}: importing {top!r} ({spec.origin}) failed: {_one_line(e)}"
                      ) from e
  return True


def _import(module: str, prefix: str):
  """``importlib.import_module(module)``, then the search dirs for its top-level name."""
  top = module.partition(".")[0]
  with _lock:
    if top not in sys.modules and importlib.util.find_spec(top) is None:
      if not _load_from(top, search_dirs(), prefix):
        raise ConfigError(f"{prefix}: no module named {top!r} on sys.path, in the config "
                          f"file's directory or in the working directory "
                          f"({', '.join(search_dirs())})")
  try:
    return importlib.import_module(module)
  except RLJaxError:
    raise
  except ModuleNotFoundError as e:
    if e.name == module or module.startswith(f"{e.name}."):
      raise ConfigError(f"{prefix}: no module named {module!r}") from None
    raise ConfigError(f"{prefix}: importing {module!r} failed: {_one_line(e)}") from e
  except Exception as e:  # the user's module raised while importing
    raise ConfigError(f"{prefix}: importing {module!r} failed: {_one_line(e)}") from e


def resolve(path: str, key: str = "import path", *, need_callable: bool = True) -> Any:
  """The object an import path ``"module.path:attr"`` names (``attr`` may be dotted).

  Args:
    path: ``"module.path:attr"``.
    key: the config key that holds it (``"env.name"``), for the error message.
    need_callable: require a callable.

  Returns:
    The attribute.

  Raises:
    ConfigError: one line ``<key>=<path>: ...``: not ``module:attr``, no such module, the
      module fails to import, no such attribute, or (``need_callable``) not callable.
  """
  prefix = f"{key}={path!r}"
  if not is_import_path(path):
    raise ConfigError(f"{prefix} is not an import path module:attr (e.g. my_env:make, a "
                      "function make in my_env.py)")
  module_name, _, attr = path.strip().partition(":")
  obj = _import(module_name, prefix)
  for part in attr.split("."):
    if not hasattr(obj, part):
      where = getattr(sys.modules.get(module_name), "__file__", None) or module_name
      raise ConfigError(f"{prefix}: module {module_name!r} ({where}) has no attribute "
                        f"{attr!r}")
    obj = getattr(obj, part)
  if need_callable and not callable(obj):
    raise ConfigError(f"{prefix}: {attr} is a {type(obj).__name__}, not a callable")
  return obj


def call(path: str, key: str, *args: Any, **kwargs: Any) -> Any:
  """``resolve(path, key)(*args, **kwargs)``; an exception the call raises becomes one
  ``ConfigError`` line naming ``key`` and ``path`` (rl_jax's own errors pass through)."""
  fn = resolve(path, key)
  try:
    return fn(*args, **kwargs)
  except RLJaxError:
    raise
  except Exception as e:
    raise ConfigError(f"{key}={path!r}: calling {path.partition(':')[2].strip()} raised "
                      f"{_one_line(e)}") from e
