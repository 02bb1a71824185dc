"""Config loading, overrides, validation and the one-line CLI error guard."""

import os
import subprocess
import sys

import ml_collections
import pytest

from rl_jax import config_utils as cu
from rl_jax.errors import CheckpointNotFoundError, ConfigError, RLJaxError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG_FILE = '''
import ml_collections
from ml_collections import config_dict

def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.name = arg or "default"
  c.model = ml_collections.ConfigDict(dict(num_layers=2, dropout=0.1, use_bias=True))
  c.mesh = ml_collections.ConfigDict(dict(axes=("data", "fsdp"), sizes=(1, 8)))
  c.seed = config_dict.placeholder(int)
  c.extra = None
  c.tag = "x"
  c.widths = [4, 4]
  if arg == "big":
    c.model.num_layers = 24
  elif arg not in (None, "small"):
    raise ValueError(f"unknown variant {arg!r}; choose small or big")
  return c
'''


@pytest.fixture
def cfg_path(tmp_path):
  path = tmp_path / "cfg.py"
  path.write_text(CONFIG_FILE)
  return str(path)


def test_load_plain_and_locked(cfg_path):
  c = cu.load_config(cfg_path)
  assert c.name == "default" and c.model.num_layers == 2
  with pytest.raises(AttributeError):
    c.new_field = 1  # locked: no new keys


def test_arg_is_passed(cfg_path):
  assert cu.load_config(f"{cfg_path}:big").model.num_layers == 24
  assert cu.load_config(f"{cfg_path}:small").name == "small"


def test_bad_arg_is_one_line_naming_file(cfg_path):
  with pytest.raises(ConfigError, match=r"cfg\.py.*get_config\('huge'\).*unknown variant") as e:
    cu.load_config(f"{cfg_path}:huge")
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("override,key,expected", [
    ("model.num_layers=4", "model.num_layers", 4),
    ("--config.model.num_layers=-3", "model.num_layers", -3),
    ("config.model.dropout=0.25", "model.dropout", 0.25),
    ("model.dropout=1", "model.dropout", 1.0),
    ("model.dropout=3e-4", "model.dropout", 3e-4),
    ("model.use_bias=false", "model.use_bias", False),
    ("model.use_bias=True", "model.use_bias", True),
    ("model.use_bias=0", "model.use_bias", False),
    ("model.use_bias=t", "model.use_bias", True),
    ("model.num_layers=0x10", "model.num_layers", 16),
    ("model.dropout=inf", "model.dropout", float("inf")),
    ("tag=hello world", "tag", "hello world"),
    ("tag='quoted'", "tag", "quoted"),
    ("tag=12", "tag", "12"),
    ("mesh.sizes=(2, 4)", "mesh.sizes", (2, 4)),
    ("mesh.sizes=2,4", "mesh.sizes", (2, 4)),
    ("mesh.axes=(data,tensor)", "mesh.axes", ("data", "tensor")),
    ("mesh.axes=('fsdp',)", "mesh.axes", ("fsdp",)),
    ("seed=7", "seed", 7),
    ("seed=None", "seed", None),
    ("extra=[1, 2]", "extra", [1, 2]),
    ("extra=some text", "extra", "some text"),
    ("widths=[8, 16]", "widths", [8, 16]),
    ("widths=8,16", "widths", [8, 16]),
])
def test_override_parsing(cfg_path, override, key, expected):
  c = cu.load_config(cfg_path, [override])
  value = cu.get_value(c, key)
  assert value == expected and type(value) is type(expected)


def test_overrides_apply_in_order(cfg_path):
  c = cu.load_config(cfg_path, ["model.num_layers=4", "model.num_layers=6"])
  assert c.model.num_layers == 6


def test_placeholder_keeps_its_type_after_none(cfg_path):
  c = cu.load_config(cfg_path, ["seed=None"], lock=False)
  with pytest.raises(ConfigError, match="seed"):
    cu.apply_overrides(c, ["seed=abc"])


@pytest.mark.parametrize("override,pattern", [
    ("model.num_layerz=4",
     r"unknown config key 'model.num_layerz'.*did you mean 'model.num_layers'"),
    ("modle.num_layers=4", r"unknown config key 'modle.num_layers'"),
    ("model.num_layers.deeper=4", r"unknown config key 'model.num_layers.deeper'"),
])
def test_unknown_key_names_key(cfg_path, override, pattern):
  with pytest.raises(ConfigError, match=pattern) as e:
    cu.load_config(cfg_path, [override])
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("override,pattern", [
    ("model.num_layers=4.5", r"config.model.num_layers is an int field; got '4.5'"),
    ("model.num_layers=true", r"model.num_layers is an int field"),
    ("model.dropout=high", r"model.dropout is a float field"),
    ("model.use_bias=maybe", r"model.use_bias is a bool field"),
    ("model.use_bias=yes", r"model.use_bias is a bool field; got 'yes' \(use true or false\)"),
    ("model.num_layers=None", r"model.num_layers is a int field and cannot be None"),
    ("seed=1.5", r"config.seed is an int field"),
    ("model=3", r"config.model is a section"),
    ("model.num_layers", r"must look like KEY=VALUE"),
])
def test_wrong_type_is_config_error(cfg_path, override, pattern):
  with pytest.raises(ConfigError, match=pattern):
    cu.load_config(cfg_path, [override])


def test_missing_file(tmp_path):
  with pytest.raises(ConfigError, match=r"config file not found: .*nope\.py"):
    cu.load_config(str(tmp_path / "nope.py"))


@pytest.mark.parametrize("name,text,suffix,pattern", [
    ("empty.py", "X = 1\n", "", r"empty\.py defines no get_config"),
    ("broken.py", "def get_config(:\n", "", r"broken\.py failed to import: SyntaxError"),
    ("noarg.py", "import ml_collections\ndef get_config():\n"
     "  return ml_collections.ConfigDict()\n", ":x", r"takes no argument, but ':x' was given"),
    ("dict.py", "def get_config(arg=None):\n  return {'a': 1}\n", "",
     r"returned dict, expected an ml_collections.ConfigDict"),
])
def test_broken_config_file_is_one_config_error(tmp_path, name, text, suffix, pattern):
  path = tmp_path / name
  path.write_text(text)
  with pytest.raises(ConfigError, match=pattern):
    cu.load_config(f"{path}{suffix}")


def test_config_file_anywhere_imports_the_package(tmp_path):
  """A config file outside the repo imports rl_jax; sys.path is left alone."""
  path = tmp_path / "elsewhere" / "mine.py"
  path.parent.mkdir()
  path.write_text(
      "import ml_collections\n"
      "from rl_jax import config_utils\n"
      "from rl_jax.errors import ConfigError\n"
      "def get_config(arg=None):\n"
      "  c = ml_collections.ConfigDict(dict(n=4, arg=arg, error=ConfigError.__name__))\n"
      "  config_utils.check(c, 'n', config_utils.positive_int)\n"
      "  return c\n")
  before = list(sys.path)
  c = cu.load_config(f"{path}:x:y")
  assert (c.n, c.arg, c.error) == (4, "x:y", "ConfigError")
  assert sys.path == before


def test_config_file_cannot_import_a_sibling_top_level_package(tmp_path):
  """Nothing puts the config's grandparent on sys.path: share code through a package."""
  package = tmp_path / "proj" / "cfgs_sibling_test"
  package.mkdir(parents=True)
  (package / "__init__.py").write_text("")
  (package / "shared.py").write_text("N = 16\n")
  (package / "user.py").write_text(
      "import ml_collections\nfrom cfgs_sibling_test import shared\n"
      "def get_config(arg=None):\n"
      "  return ml_collections.ConfigDict(dict(n=shared.N))\n")
  before = list(sys.path)
  with pytest.raises(ConfigError, match=r"user\.py failed to import: ModuleNotFoundError: "
                     r"No module named 'cfgs_sibling_test'"):
    cu.load_config(str(package / "user.py"))
  assert sys.path == before


# ------------------------------------------------------------------ validation
def _small():
  return ml_collections.ConfigDict(dict(
      rl=dict(num_samples=4, top_p=0.9, temp=1.0, name="grpo", limit=None)))


@pytest.mark.parametrize("key,check,value,bad", [
    ("rl.num_samples", cu.positive_int, 0, "must be a positive int, got 0"),
    ("rl.num_samples", cu.positive_int, 2.0, "must be a positive int, got 2.0"),
    ("rl.num_samples", cu.nonnegative_int, -1, "must be an int >= 0, got -1"),
    ("rl.top_p", cu.probability, 1.5, "must be a number in [0, 1], got 1.5"),
    ("rl.temp", cu.positive, 0.0, "must be a number > 0, got 0.0"),
    ("rl.temp", cu.nonnegative, -0.1, "must be a number >= 0, got -0.1"),
    ("rl.temp", cu.in_range(0, 2, high_inclusive=False), 2.0,
     "must be a number in [0, 2), got 2.0"),
    ("rl.name", cu.one_of(["grpo", "ppo"]), "gpro", "must be one of ['grpo', 'ppo'], got 'gpro'"),
])
def test_checks(key, check, value, bad):
  cu.check(_small(), key, check)  # The defaults pass.
  section, leaf = key.split(".")
  c = ml_collections.ConfigDict({section: {leaf: value}})
  with pytest.raises(ConfigError) as e:
    cu.check(c, key, check)
  assert str(e.value) == f"config.{key} {bad}"


def test_optional_and_choice_and_validate():
  c = _small()
  cu.check(c, "rl.limit", cu.optional(cu.positive_int))
  c.rl.limit = 0
  with pytest.raises(ConfigError, match="config.rl.limit must be a positive int, got 0"):
    cu.validate(c, {"rl.num_samples": cu.positive_int, "rl.limit": cu.optional(cu.positive_int)})
  with pytest.raises(ConfigError, match=r"config.rl.name must be one of \['ppo'\]"):
    cu.check_choice(c, "rl.name", ["ppo"])
  with pytest.raises(ConfigError, match="unknown config key 'rl.nope'"):
    cu.check(c, "rl.nope", cu.positive_int)


def test_one_of_reads_a_live_view_at_check_time():
  registry = {"grpo": None}
  check = cu.one_of(registry.keys())
  c = ml_collections.ConfigDict(dict(loss=dict(advantage="rloo")))
  with pytest.raises(ConfigError, match=r"config.loss.advantage must be one of \['grpo'\], got"):
    cu.validate(c, {"loss.advantage": cu.optional(check)})
  registry["rloo"] = None  # Registered after the check was built, e.g. by a config file.
  cu.validate(c, {"loss.advantage": cu.optional(check)})
  assert cu.check_choice(c, "loss.advantage", registry) == "rloo"  # A dict: its keys.

  class View:  # Any iterable, e.g. a registry's read-only name view.
    def __iter__(self):
      return iter(registry)

  assert cu.one_of(View())("rloo") is None
  assert cu.one_of(View())("ppo") == "must be one of ['grpo', 'rloo']"
  once = cu.one_of(name for name in ("a", "b"))  # A generator is read once, up front.
  assert once("b") is None and once("b") is None and once("c") == "must be one of ['a', 'b']"


def test_checks_are_importable_from_both_modules():
  from rl_jax import config_checks  # pylint: disable=g-import-not-at-top
  for name in config_checks.__all__:
    assert getattr(cu, name) is getattr(config_checks, name)
  assert set(config_checks.__all__) <= set(cu.__all__)
  assert all(hasattr(cu, name) for name in cu.__all__)


# ------------------------------------------------------------------ command line
def test_parse_cli(cfg_path, tmp_path):
  argv = ["prog", f"--config={cfg_path}:big", "--workdir", str(tmp_path),
          "--config.model.dropout=0.5", "--config.seed", "-2"]
  c, workdir = cu.parse_cli(argv)
  assert (c.model.num_layers, c.model.dropout, c.seed, workdir) == (24, 0.5, -2, str(tmp_path))


@pytest.mark.parametrize("argv,pattern", [
    (["prog", "--workdir=/tmp/x"], "missing --config"),
    (["prog", "--config=CFG"], "missing --workdir"),
    (["prog", "--config=CFG", "--workdir=/tmp/x", "--bogus_flag=1"], "command line: .*bogus_flag"),
    (["prog", "--config=CFG", "--workdir=/tmp/x", "--config.model.num_layerz=1"], "num_layerz"),
])
def test_parse_cli_errors(cfg_path, argv, pattern):
  argv = [a.replace("CFG", cfg_path) for a in argv]
  with pytest.raises(ConfigError, match=pattern):
    cu.parse_cli(argv)


def test_errors_hierarchy():
  assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, RLJaxError)
  assert issubclass(CheckpointNotFoundError, FileNotFoundError)


GUARDED_SCRIPT = '''
import sys
sys.path.insert(0, {repo!r})
from rl_jax import config_utils
from rl_jax.errors import CheckpointNotFoundError

@config_utils.main_guard
def main(argv):
  if argv[1:2] == ["ckpt"]:
    raise CheckpointNotFoundError("no checkpoint in /tmp/nowhere")
  if argv[1:2] == ["bug"]:
    raise RuntimeError("a real bug")
  config, workdir = config_utils.parse_cli(argv)
  print("ok", config.model.num_layers, workdir)

main(sys.argv)
'''


def _run_guarded(tmp_path, *args):
  script = tmp_path / "guarded.py"
  script.write_text(GUARDED_SCRIPT.format(repo=REPO))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                        env=env, timeout=60, check=False)


def test_cli_guard_one_line_exit_2(tmp_path, cfg_path):
  ok = _run_guarded(tmp_path, f"--config={cfg_path}", "--workdir=W", "--config.model.num_layers=3")
  assert ok.returncode == 0 and ok.stdout.strip() == "ok 3 W", ok.stderr

  bad = _run_guarded(tmp_path, f"--config={cfg_path}", "--workdir=W", "--config.model.layers=3")
  assert bad.returncode == 2
  assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
  assert bad.stderr.startswith("error: unknown config key 'model.layers'")

  missing = _run_guarded(tmp_path, "--config=/nonexistent/cfg.py", "--workdir=W")
  assert missing.returncode == 2
  assert missing.stderr == "error: config file not found: /nonexistent/cfg.py\n"

  ckpt = _run_guarded(tmp_path, "ckpt")
  assert (ckpt.returncode, ckpt.stderr) == (2, "error: no checkpoint in /tmp/nowhere\n")

  bug = _run_guarded(tmp_path, "bug")
  assert bug.returncode == 1 and "Traceback" in bug.stderr


# ------------------------------------------------------------------ why not config_flags alone
def _config_flags(spec, *overrides):
  """Runs ml_collections.config_flags on the same command line, on fresh absl flag state."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  values = flags.FlagValues()
  argv = ["prog", f"--config={spec}", *(f"--config.{o}" for o in overrides)]
  holder = config_flags.DEFINE_config_file("config", None, "config", flag_values=values,
                                           sys_argv=argv)
  values(argv)
  return holder.value


@pytest.mark.parametrize("override,theirs,ours", [
    ("tag='quoted'", "'quoted'", "quoted"),
    ("mesh.axes=(data,tensor)", ("(data,tensor)",), ("data", "tensor")),
])
def test_config_flags_parses_these_overrides_differently(cfg_path, override, theirs, ours):
  key = override.split("=")[0]
  assert cu.get_value(_config_flags(cfg_path, override), key) == theirs
  assert cu.get_value(cu.load_config(cfg_path, [override]), key) == ours


@pytest.mark.parametrize("override", ["seed=None", "extra=[1, 2]", "widths=[8, 16]"])
def test_config_flags_rejects_these_overrides(cfg_path, override):
  """A placeholder set to None, a field that is None, a list field: config_flags refuses."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  with pytest.raises(flags.Error):
    _config_flags(cfg_path, override)
  cu.load_config(cfg_path, [override])


def test_config_flags_scalar_parsing_matches(cfg_path):
  """int, float and bool go through the same absl parsers, so these agree."""
  overrides = ["model.num_layers=0x10", "model.dropout=2", "model.use_bias=F", "seed=7",
               "mesh.sizes=2,4", "tag=hello"]
  theirs = _config_flags(cfg_path, *overrides)
  ours = cu.load_config(cfg_path, overrides)
  for override in overrides:
    key = override.split("=")[0]
    assert cu.get_value(theirs, key) == cu.get_value(ours, key)
    assert type(cu.get_value(theirs, key)) is type(cu.get_value(ours, key))


def test_config_flags_defers_a_missing_file_and_wraps_get_config_errors(cfg_path, tmp_path):
  missing = str(tmp_path / "nope.py")
  config = _config_flags(missing)  # Parsing "succeeds" ...
  assert not isinstance(config, ml_collections.ConfigDict)
  with pytest.raises(OSError, match="nope.py"):  # ... and fails at the first access.
    _ = config.model
  with pytest.raises(ConfigError, match="config file not found"):
    cu.load_config(missing)

  from absl import flags  # pylint: disable=g-import-not-at-top
  with pytest.raises(flags.Error) as theirs:
    _config_flags(f"{cfg_path}:huge")
  assert "Traceback" in str(theirs.value) and "\n" in str(theirs.value)
  with pytest.raises(ConfigError) as ours:
    cu.load_config(f"{cfg_path}:huge")
  assert "\n" not in str(ours.value)


def test_config_flags_unknown_key_is_not_a_flag_error(cfg_path):
  """config_flags lets a raw AttributeError escape (a traceback under absl.app), naming only
  the last part of the key."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  with pytest.raises(AttributeError) as theirs:
    _config_flags(cfg_path, "model.num_layerz=4")
  assert not isinstance(theirs.value, flags.Error)
  assert "model.num_layerz" not in str(theirs.value)
  with pytest.raises(ConfigError) as ours:
    cu.load_config(cfg_path, ["model.num_layerz=4"])
  assert "\n" not in str(ours.value) and "did you mean 'model.num_layers'" in str(ours.value)


def test_config_flags_state_is_per_flag_values(cfg_path):
  """config_flags defines one flag per FlagValues; load_config is a plain, repeatable call."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "config", flag_values=values)
  with pytest.raises(flags.DuplicateFlagError):
    config_flags.DEFINE_config_file("config", None, "config", flag_values=values)
  a = cu.load_config(cfg_path, ["model.num_layers=3"])
  b = cu.load_config(cfg_path, ["model.num_layers=5"])
  assert (a.model.num_layers, b.model.num_layers) == (3, 5)
  assert "config" not in flags.FLAGS


ABSL_APP_SCRIPT = '''
from absl import app
from ml_collections import config_flags
CONFIG = config_flags.DEFINE_config_file("config")

def main(argv):
  print("ok", CONFIG.value.model.num_layers)

app.run(main)
'''


def test_absl_app_flag_error_is_not_one_line(tmp_path, cfg_path):
  """The plain absl.app + config_flags CLI prints a wrong-type override over several lines
  and exits 1; ours prints one ``error:`` line and exits 2."""
  script = tmp_path / "absl_cli.py"
  script.write_text(ABSL_APP_SCRIPT)
  args = [f"--config={cfg_path}", "--config.model.num_layers=4.5"]
  theirs = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=60, check=False)
  assert theirs.returncode == 1 and theirs.stderr.strip().count("\n") >= 1, theirs.stderr
  ours = _run_guarded(tmp_path, *args, "--workdir=W")
  assert ours.returncode == 2
  assert ours.stderr == "error: config.model.num_layers is an int field; got '4.5'\n"
