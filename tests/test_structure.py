"""Package structure: no import cycles anywhere in rl_jax, the trainer's modules depend
downward by layer, every module declares ``__all__``, and the package never edits
``sys.path`` or imports the user's ``configs`` directory."""

import importlib
import re
import pathlib

import pytest

import rl_jax
from rl_jax.train import layers as train_layers
from tests import import_graph

ROOT = pathlib.Path(rl_jax.__file__).parent
FILES = import_graph.modules(ROOT, "rl_jax")
GRAPH = import_graph.graph(ROOT, "rl_jax")
# The trainer by layer (``rl_jax.train.layers``, the one list): (name, modules, apart).
TRAIN_LAYERS = [(layer.name, list(layer.modules), layer.apart) for layer in train_layers.LAYERS]
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


def test_architecture_doc_lists_the_layers_as_the_code_does():
  """docs/ARCHITECTURE.md's table of modules by layer is the list in ``rl_jax.train.layers``."""
  doc = (ROOT.parent / "docs" / "ARCHITECTURE.md").read_text()
  rows = {}
  for line in doc.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 4 and cells[0] in {layer.name for layer in train_layers.LAYERS}:
      rows[cells[0]] = re.findall(r"`(\w+)`", cells[1])
  assert rows == {layer.name: list(layer.modules) for layer in train_layers.LAYERS}


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
