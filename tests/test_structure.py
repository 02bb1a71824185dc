"""Package structure: no import cycles anywhere in rl_jax, the trainer's modules depend
downward by layer, every module declares ``__all__``, and the package never edits
``sys.path`` or imports the user's ``configs`` directory."""

import importlib
import re
import pathlib

import pytest

import rl_jax
from tests import import_graph

ROOT = pathlib.Path(rl_jax.__file__).parent
FILES = import_graph.modules(ROOT, "rl_jax")
GRAPH = import_graph.graph(ROOT, "rl_jax")
# The trainer by layer, top of the data flow last. A module may import the modules of lower
# layers and, in a layer that is not ``apart``, those of its own layer (the cycle test keeps
# those acyclic); the modules of an ``apart`` layer (producer and learner) never import
# each other.
TRAIN_LAYERS = [
    ("stages", ["streams", "group_size", "selection_stage", "speculative_stage",
                "agent_stage", "replay_stage", "judge_stage"], False),
    ("setup", ["inputs", "context", "on_policy", "startup", "offload", "lock", "accumulate",
               "teacher"], False),
    ("state", ["records", "queue", "state", "lora_checkpoint", "resume", "layout", "steps",
               "rollouts"], False),
    ("step", ["producer", "learner", "evaluation", "memory"], True),
    ("runner", ["runner", "topology"], False),
    ("loop", ["loop"], False),
]
TRAIN_MODULES = [m for _, mods, _ in TRAIN_LAYERS for m in mods]
# modules built on the trainer (the only ones outside rl_jax.train that may import it)
ABOVE_TRAINER = {"rl_jax.api"}


def test_no_import_cycle_in_the_package():
  cycle = import_graph.find_cycle(GRAPH)
  assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_cycle_finder_finds_cycles():
  assert import_graph.find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert import_graph.find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_trainer_modules_depend_downward_by_layer():
  train = {f"rl_jax.train.{m}" for m in TRAIN_MODULES}
  assert train | {"rl_jax.train", "rl_jax.train.__main__"} == {
      m for m in FILES if m.startswith("rl_jax.train")}
  below: set[str] = set()
  for layer, mods, apart in TRAIN_LAYERS:
    names = {f"rl_jax.train.{m}" for m in mods}
    for name in sorted(names):
      deps = GRAPH[name] & (train | {"rl_jax.train"})
      allowed = below | (set() if apart else names - {name})
      assert deps <= allowed, f"{name} ({layer}) imports {sorted(deps - allowed)}"
    below |= names
  # nothing below the trainer imports it
  outside = [m for m in FILES if not m.startswith("rl_jax.train") and m not in ABOVE_TRAINER]
  assert not [m for m in outside if any(d.startswith("rl_jax.train") for d in GRAPH[m])]


@pytest.mark.parametrize("module", sorted(FILES))
def test_module_declares_its_names(module):
  path = FILES[module]
  text = path.read_text()
  assert not re.search(r"sys\.path\s*(\.\w+\(|=|\+=)", text), f"{path} edits sys.path"
  assert "configs" not in {n.split(".")[0] for n in _top_level_imports(module)}
  if path.name == "__main__.py" or module == "rl_jax":
    return
  mod = importlib.import_module(module)
  names = getattr(mod, "__all__", None)
  assert isinstance(names, (list, tuple)), f"{module} has no explicit __all__"
  assert not [n for n in names if not hasattr(mod, n)], f"{module}.__all__ names missing"


def _top_level_imports(module):
  import ast  # pylint: disable=import-outside-toplevel
  out = set()
  for node in ast.walk(ast.parse(FILES[module].read_text())):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and not node.level:
      out.add(node.module or "")
  return out
