"""Checkpoint save/restore: bitwise round trips, re-sharding across meshes, keep-last-k,
clear errors on mismatches, partial saves (and a SIGKILL mid-save) never being restored, and
the on-disk layout being read whoever wrote it."""

import json
import os
import shutil
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from rl_jax import checkpoint
from rl_jax import sharding
from rl_jax.checkpoint import integrity
from rl_jax.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError


def _train_state(seed=0):
  """A realistic state: params, adam state after one update, step, keys, data position."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  params = {"w": jax.random.normal(k1, (8, 16)), "b": jax.random.normal(k2, (16,)),
            "emb": jnp.arange(32 * 8, dtype=jnp.bfloat16).reshape(32, 8) / 7}
  opt = optax.adam(1e-2)
  opt_state = opt.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  _, opt_state = opt.update(grads, opt_state, params)
  return {
      "params": params,
      "opt_state": opt_state,
      "step": 7,
      "rng": jax.random.key(3),
      "raw_rng": jax.random.PRNGKey(5),
      "data": {"position": np.array([3, 1, 4], np.int64), "epoch": 2, "frac": 0.25},
  }


def _abstract(tree):
  """Target for restore: arrays -> ShapeDtypeStruct with their sharding; host values as-is."""
  def one(x):
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x
  return jax.tree.map(one, tree)


def _assert_bitwise_equal(want, got):
  """Same tree, leaf types (Python number / numpy / jax), shapes, dtypes and exact values."""
  chex.assert_trees_all_equal_structs(want, got)
  assert jax.tree.leaves(jax.tree.map(type, want)) == jax.tree.leaves(jax.tree.map(type, got))
  chex.assert_trees_all_equal(want, got, strict=True)  # strict: shapes and dtypes too.


@pytest.mark.parametrize("async_save", [True, False])
def test_roundtrip_bitwise(tmp_path, async_save):
  state = _train_state()
  with checkpoint.Checkpointer(tmp_path / "ckpt", keep=3, save_every=1,
                               async_save=async_save) as ckpt:
    assert ckpt.save(7, state, metadata={"data_position": 3, "note": "x"})
    restored, meta = ckpt.restore(_abstract(state))
  _assert_bitwise_equal(state, restored)
  assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)
  assert meta == {"data_position": 3, "note": "x"}
  # The same checkpoint through the module-level functions, as a fresh process would.
  assert checkpoint.latest_step(tmp_path / "ckpt") == 7
  again, _ = checkpoint.restore(tmp_path / "ckpt", _abstract(state))
  _assert_bitwise_equal(state, again)


def test_restore_into_eval_shape_target(tmp_path):
  """The trainer's path: jax.eval_shape(init) gives the target (no shardings, jnp step)."""
  def init(key):
    params = {"w": jax.random.normal(key, (4, 4))}
    return {"params": params, "opt": optax.adamw(1e-3).init(params),
            "step": jnp.int32(11), "rng": jax.random.key(1)}

  state = init(jax.random.PRNGKey(0))
  ckpt = checkpoint.Checkpointer(tmp_path, save_every=5)
  ckpt.save(5, state)
  restored, meta = ckpt.restore(jax.eval_shape(init, jax.random.PRNGKey(1)))
  ckpt.close()
  _assert_bitwise_equal(state, restored)
  assert meta == {}


def test_host_values_are_copied_at_save(tmp_path):
  """An async save must not see in-place changes made after save() returns."""
  position = np.array([1, 2, 3])
  ckpt = checkpoint.Checkpointer(tmp_path)
  ckpt.save(1, {"pos": position, "w": jnp.ones(2)})
  position[:] = 0
  target = {"pos": np.zeros(3, np.int64), "w": jax.ShapeDtypeStruct((2,), jnp.float32)}
  restored, _ = ckpt.restore(target)
  ckpt.close()
  np.testing.assert_array_equal(restored["pos"], [1, 2, 3])


def _sharded_state(mesh, rules):
  """Params with logical axes, placed by rl_jax.sharding, plus adam moments placed alike."""
  axes = {"embed": ("vocab", "embed"), "up": ("embed", "mlp"), "norm": ("embed",)}
  shapes = {"embed": (16, 32), "up": (32, 64), "norm": (32,)}
  shards = sharding.logical_to_sharding(axes, mesh, rules, shapes)
  values = {k: np.arange(np.prod(s), dtype=np.float32).reshape(s) / 3 for k, s in shapes.items()}
  params = jax.tree.map(jax.device_put, values, shards)
  opt_state = optax.adam(1e-3).init(params)
  return {"params": params, "opt_state": opt_state, "rng": jax.random.key(9)}, axes, shapes


def _is_shape(x):
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def _target_on(mesh, rules, axes, shapes, key_dtype):
  """The abstract state on another mesh: params and moments placed by the rules there."""
  shards = sharding.logical_to_sharding(axes, mesh, rules, shapes)
  params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sh),
                        shapes, shards, is_leaf=_is_shape)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  count = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
  opt_state = (optax.ScaleByAdamState(count=count, mu=params, nu=params), optax.EmptyState())
  rng = jax.ShapeDtypeStruct((), key_dtype, sharding=replicated)
  return {"params": params, "opt_state": opt_state, "rng": rng}


@pytest.mark.parametrize("shape,rules", [({"data": 2, "tensor": 4}, "fsdp_tp"),
                                         ({"fsdp": 1}, "fsdp")])
def test_restore_onto_different_mesh(tmp_path, shape, rules):
  assert jax.device_count() == 8, "tests/conftest.py must give 8 fake CPU devices"
  mesh8 = sharding.make_mesh({"fsdp": 8})
  state, axes, shapes = _sharded_state(mesh8, "fsdp")
  assert state["params"]["up"].sharding.spec[0] == "fsdp"  # Really sharded when saved.
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state)

  devices = jax.devices()[:int(np.prod(list(shape.values())))]
  mesh = sharding.make_mesh(shape, devices=devices)
  target = _target_on(mesh, rules, axes, shapes, state["rng"].dtype)
  assert jax.tree.structure(target) == jax.tree.structure(state)
  restored, _ = checkpoint.restore(tmp_path, target)

  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
    assert got.sharding == want.sharding
  _assert_bitwise_equal(jax.device_get(state), jax.device_get(restored))
  if rules == "fsdp_tp":
    assert restored["params"]["up"].sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    assert restored["opt_state"][0].mu["embed"].sharding.spec[0] == "tensor"


def test_keep_last_k_and_save_every(tmp_path):
  state = {"w": jnp.zeros(3)}
  ckpt = checkpoint.Checkpointer(tmp_path, keep=2, save_every=2)
  assert not ckpt.should_save(0) and not ckpt.should_save(1) and ckpt.should_save(2)
  saved = [step for step in range(1, 8) if ckpt.save(step, {"w": jnp.full(3, step)})]
  assert saved == [2, 4, 6]
  assert ckpt.all_steps()[-1] == 6  # Known to the manager while it may still be written.
  assert ckpt.should_save(8) and not ckpt.should_save(7) and not ckpt.should_save(0)
  assert not ckpt.should_save(6) and not ckpt.should_save(4)  # Saved / older than saved.
  assert ckpt.save(7, {"w": jnp.full(3, 7)}, force=True)  # Forced: off the interval.
  ckpt.wait()
  assert ckpt.all_steps() == [6, 7] and ckpt.latest_step() == 7
  assert checkpoint.all_steps(tmp_path) == [6, 7] and checkpoint.latest_step(tmp_path) == 7
  assert sorted(os.listdir(tmp_path)) == ["6", "7"]
  assert not ckpt.save(7, state, force=True)  # Already saved: nothing to do.
  with pytest.raises(CheckpointError, match="cannot save step 5 .* newer step 7"):
    ckpt.save(5, state, force=True)
  restored, _ = ckpt.restore({"w": np.zeros(3, np.float32)}, step=6)
  np.testing.assert_array_equal(restored["w"], [6, 6, 6])
  ckpt.close()
  # A new manager on the directory starts from what is on disk.
  with checkpoint.Checkpointer(tmp_path, keep=2, save_every=2) as again:
    assert again.all_steps() == [6, 7] and not again.should_save(6) and again.should_save(8)


def test_keep_none_and_only_forced_saves(tmp_path):
  with checkpoint.Checkpointer(tmp_path, keep=None, save_every=0) as ckpt:
    assert not any(ckpt.should_save(step) for step in range(10))
    assert not ckpt.save(3, {"w": jnp.ones(2)})
    for step in range(1, 6):
      assert ckpt.save(step, {"w": jnp.ones(2)}, force=True)
  assert checkpoint.all_steps(tmp_path) == [1, 2, 3, 4, 5]


def test_mismatch_errors_name_the_leaf(tmp_path):
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, {"params": {"w": jnp.zeros((4, 8))}, "rng": jax.random.key(0), "n": 3})
  w = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  key = jax.eval_shape(lambda: jax.random.key(0))
  good = {"params": {"w": w}, "rng": key, "n": 0}
  assert checkpoint.restore(tmp_path, good)[0]["n"] == 3

  cases = [
      ({**good, "params": {"w": jax.ShapeDtypeStruct((4, 9), jnp.float32)}},
       r"leaf 'params/w' has shape \(4, 8\) in the checkpoint but the target wants \(4, 9\)"),
      ({**good, "extra": 0}, r"the target's leaf 'extra' is not in the checkpoint"),
      ({"params": {"w": w}, "rng": key}, r"the checkpoint's leaf 'n' is not in the target"),
      ({**good, "rng": jax.ShapeDtypeStruct((2,), jnp.uint32)},
       r"leaf 'rng' has shape \(\) in the checkpoint"),
      ({**good, "n": jax.random.key(0)}, r"leaf 'n' has dtype int64 in the checkpoint but the "
       r"target wants key<fry> \(typed vs raw PRNG key\)"),
      ({**good, "n": "three"}, r"restore target leaf 'n' is a str"),
  ]
  for target, pattern in cases:
    with pytest.raises(CheckpointError, match=pattern) as e:
      checkpoint.restore(tmp_path, target)
    assert "\n" not in str(e.value)


def test_partial_checkpoints_are_ignored(tmp_path):
  state = {"w": jnp.arange(4.0)}
  target = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(3, state)
  # What a crash leaves behind: orbax's tmp dir of an unfinished save (even with a commit
  # marker), and (on filesystems without atomic rename, or a half-copied run) a numbered dir
  # without the commit marker.
  tmp_save = tmp_path / "5.orbax-checkpoint-tmp-1700000000"
  (tmp_save / "state").mkdir(parents=True)
  (tmp_save / "commit_success.txt").write_text("done")
  (tmp_path / "9" / "state").mkdir(parents=True)
  (tmp_path / "9" / "manifest").mkdir()
  (tmp_path / "not_a_step").mkdir()
  assert checkpoint.latest_step(tmp_path) == 3
  assert checkpoint.all_steps(tmp_path) == [3]
  restored, _ = checkpoint.restore(tmp_path, target)
  np.testing.assert_array_equal(restored["w"], np.arange(4.0))
  with pytest.raises(CheckpointNotFoundError, match=r"no complete checkpoint for step 9 .* \[3\]"):
    checkpoint.restore(tmp_path, target, step=9)

  ckpt = checkpoint.Checkpointer(tmp_path)
  assert ckpt.all_steps() == [3] and ckpt.latest_step() == 3
  assert ckpt.incomplete_steps() == [9]  # what a resume sets aside before it trains
  assert ckpt.save(4, state)  # The incomplete 9/ is not a step, so 4 is the newest.
  ckpt.wait()
  assert not tmp_save.exists()  # Unfinished saves are deleted once a manager opens the dir.
  assert checkpoint.latest_step(tmp_path) == 4
  with pytest.raises(CheckpointError, match=r"9 exists but is not a complete checkpoint"):
    ckpt.save(9, state)
  shutil.rmtree(tmp_path / "9")
  assert ckpt.save(9, state)
  ckpt.close()
  assert checkpoint.all_steps(tmp_path) == [3, 4, 9]


@pytest.mark.parametrize("listing", ["[]", '{"files": []}', '{"files": {"x": {}}}',
                                     '{"files": {"x": {"size": "many"}}}', "{"])
def test_a_checksum_list_of_the_wrong_shape_is_a_damaged_step(tmp_path, listing):
  """``checksums.json`` that parses to something else than the list ``seal`` writes marks the
  step damaged (the resume sets it aside), not a TypeError from inside ``verify``."""
  with checkpoint.Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, {"w": jnp.arange(4.0)})
  step_dir = tmp_path / "1"
  integrity.seal(step_dir)
  assert integrity.verify(step_dir)
  (step_dir / integrity.CHECKSUMS).write_text(listing)
  with pytest.raises(CheckpointCorruptError, match=r"checksums.json is unreadable \(") as e:
    integrity.verify(step_dir)
  assert "\n" not in str(e.value)


_KILLED_SAVE = """
import os, signal, sys
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from rl_jax import checkpoint

directory = epath.Path(sys.argv[1])
ckpt = checkpoint.Checkpointer(directory, async_save=True)
ckpt.save(1, {"w": jnp.full(4, 1.0)})
ckpt.wait()
rename = ocp.path.atomicity.AtomicRenameTemporaryPath.finalize

async def finalize(self):
  if self.get_final().parent == directory:  # The step dir: every item is already written.
    (self.get() / "commit_success.txt").write_text("written, not yet renamed")
    os.kill(os.getpid(), signal.SIGKILL)
  return await rename(self)

ocp.path.atomicity.AtomicRenameTemporaryPath.finalize = finalize
ckpt.save(2, {"w": jnp.full(4, 2.0)})
ckpt.wait()
print("not killed")
"""


def test_sigkill_mid_save_is_never_restored(tmp_path):
  """A process killed while saving step 2 (all files written, the final rename not done)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(tmp_path)], env=env,
                        capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == -9, proc.stdout + proc.stderr
  leftovers = [p for p in os.listdir(tmp_path) if p.startswith("2.")]
  assert leftovers and os.path.exists(tmp_path / leftovers[0] / "commit_success.txt")
  target = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
  assert checkpoint.all_steps(tmp_path) == [1] and checkpoint.latest_step(tmp_path) == 1
  restored, _ = checkpoint.restore(tmp_path, target)
  chex.assert_trees_all_equal(restored, {"w": jnp.full(4, 1.0)})
  with checkpoint.Checkpointer(tmp_path) as ckpt:  # The rerun: same view, then step 2 again.
    assert ckpt.latest_step() == 1
    assert ckpt.save(2, {"w": jnp.full(4, 2.0)})
  assert sorted(os.listdir(tmp_path)) == ["1", "2"]
  restored, _ = checkpoint.restore(tmp_path, target)
  chex.assert_trees_all_equal(restored, {"w": jnp.full(4, 2.0)})


def test_reads_layout_written_by_plain_orbax(tmp_path):
  """The documented layout, written without rl_jax or a CheckpointManager, restores (cast)."""
  w = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
  pos = np.array([5, 6], np.int64)
  manifest = {"format": 1, "leaves": {
      "params/w": {"shape": [3, 4], "dtype": "float32"},
      "data/pos": {"shape": [2], "dtype": "int64"},
      "step": {"shape": [], "dtype": "int64"}}}
  writer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  writer.save(tmp_path / "12", args=ocp.args.Composite(
      state=ocp.args.StandardSave({"params": {"w": w}, "data": {"pos": pos},
                                   "step": np.asarray(12)}),
      metadata=ocp.args.JsonSave({"data_position": 40}),
      manifest=ocp.args.JsonSave(manifest)))
  assert json.loads((tmp_path / "12" / "manifest" / "metadata").read_text()) == manifest
  assert os.path.exists(tmp_path / "12" / "commit_success.txt")

  target = {"params": {"w": jax.ShapeDtypeStruct((3, 4), jnp.bfloat16)},
            "data": {"pos": np.zeros(2, np.int64)}, "step": 0}
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    assert ckpt.all_steps() == [12] and ckpt.metadata() == {"data_position": 40}
    restored, meta = ckpt.restore(target)
  assert meta == {"data_position": 40}
  _assert_bitwise_equal({"params": {"w": jnp.asarray(w, jnp.bfloat16)}, "data": {"pos": pos},
                         "step": 12}, restored)


def test_not_found_and_bad_inputs(tmp_path):
  target = {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}
  assert checkpoint.latest_step(tmp_path / "missing") is None
  with pytest.raises(CheckpointNotFoundError, match=r"no complete checkpoint in .*missing "
                     r"\(the directory does not exist\)"):
    checkpoint.restore(tmp_path / "missing", target)
  ckpt = checkpoint.Checkpointer(tmp_path / "c")
  with pytest.raises(FileNotFoundError, match="no complete checkpoint in"):
    ckpt.restore(target)
  with pytest.raises(CheckpointError, match="metadata is not JSON-serialisable"):
    ckpt.save(1, {"w": jnp.ones(2)}, metadata={"f": object()})
  with pytest.raises(CheckpointError, match=r"state leaf 'name' is a str"):
    ckpt.save(1, {"w": jnp.ones(2), "name": "abc"})
  with pytest.raises(CheckpointError, match="checkpoint step must be an int >= 0, got -1"):
    ckpt.save(-1, {"w": jnp.ones(2)})
  assert ckpt.latest_step() is None  # None of the failed saves left a checkpoint.
  ckpt.close()
  with pytest.raises(CheckpointError, match="keep must be an int >= 1, got 0"):
    checkpoint.Checkpointer(tmp_path / "d", keep=0)
  with pytest.raises(CheckpointError, match="save_every must be an int >= 0"):
    checkpoint.Checkpointer(tmp_path / "d", save_every=1.5)


def test_metadata_only(tmp_path):
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(2, {"w": jnp.ones(2)}, metadata={"config": {"lr": 1e-3}, "position": [1, 2]})
    assert ckpt.metadata() == {"config": {"lr": 1e-3}, "position": [1, 2]}
  assert checkpoint.read_metadata(tmp_path, step=2)["position"] == [1, 2]
