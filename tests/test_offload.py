"""Host offload (``train.offload``): the offloaded parts really live in host memory, training
computes exactly what it computes without offload, checkpoints restore with offload switched
on or off, the memory plan counts those parts as host bytes, the steps lower for TPU and
CUDA, and a bad request fails in one line."""

import json
import shutil

import jax
import numpy as np
import pytest

from rl_jax import checkpoint, config_utils, metrics, settings, train
from rl_jax.errors import ConfigError
from rl_jax.train import memory, offload
from tests.tiny import QUICKSTART, TINY_MODEL

RUN = TINY_MODEL + [
    "mesh.num_devices=2", "sft.steps=1", "sft.batch_size=8", "train.steps=2",
    "train.batch_groups=4", "rollout.n=4",
    "loss.kl_beta=0.01", "train.eval_every=0", "train.checkpoint_every=1", "train.keep=10",
    "log.tensorboard=False",
]  # FSDP over 2 devices; step 1 supervised, steps 2-3 RL with a KL reference
BOTH = "train.offload=reference,optimizer"
HOST_FIELDS = ("opt_state", "ref_params")  # value_opt_state is {} (no critic)


def _config(cache, extra=()):
  return config_utils.load_config(QUICKSTART, RUN + [f"train.compile_cache={cache}", *extra])


def _kinds(tree) -> set:
  return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _same_state(a, b) -> None:
  """Bit-identical values, leaf by leaf (memory kinds may differ)."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb) and jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _numbers(workdir) -> list[dict]:
  """Every metric of every step except wall-clock timings."""
  timed = lambda k: "time" in k or k.endswith("_per_s")
  return [{k: v for k, v in r.items() if not timed(k)}
          for r in metrics.read_jsonl(str(workdir / "metrics.jsonl"))]


def _resume_from(src, step, dst) -> None:
  """``dst`` starts as a copy of ``src``'s checkpoint of ``step`` only."""
  shutil.copytree(src / "checkpoints" / str(step), dst / "checkpoints" / str(step))


def test_offload_trains_identically_and_resumes_either_way(tmp_path):
  """The same run with the reference and optimizer states in host memory gives bit-identical
  weights, optimizer states and metrics (the placement changes no arithmetic: the steps copy
  the values into device memory and run the same operations). Checkpoints are the same
  whichever placement wrote them, and a run without offload resumes with it bit-exactly."""
  cache = tmp_path / "cache"
  plain, off, resumed = tmp_path / "plain", tmp_path / "offload", tmp_path / "resumed"
  s = train.build_setup(_config(cache, [BOTH]))
  for step, fields in ((0, ("opt_state", "sft_opt_state")), (2, HOST_FIELDS)):
    abstract = train.abstract_state(s, step)  # the restore targets of both layouts
    for f in fields:
      assert _kinds(getattr(abstract, f)) == {"pinned_host"}, (step, f)
    assert _kinds(abstract.params) == {"device"}

  a = train.train(_config(cache), str(plain), progress=False)
  b = train.train(_config(cache, [BOTH]), str(off), progress=False)
  for f in HOST_FIELDS:
    assert _kinds(getattr(b, f)) == {"pinned_host"} and _kinds(getattr(a, f)) == {"device"}
  assert _kinds(b.params) == {"device"}
  _same_state(a, b)
  assert _numbers(off) == _numbers(plain) and len(_numbers(plain)) == 3

  # the plan: offloaded parts are host bytes, no longer device bytes
  pa = json.load(open(plain / memory.PLAN_FILE))
  pb = json.load(open(off / memory.PLAN_FILE))
  for part in ("rl_optimizer", "reference"):
    assert pb["state"]["rl"][part] == 0
    assert pb["host_state"]["rl"][part] == pa["state"]["rl"][part] > 0
  assert pb["state"]["rl"]["policy"] == pa["state"]["rl"]["policy"]
  assert sum(pa["host_state"]["rl"].values()) == 0 and pb["offload"] == ["optimizer", "reference"]
  assert pb["steps"]["rl_update"]["staged"] == pa["state"]["rl"]["rl_optimizer"]
  assert pb["steps"]["ref_logprobs"]["staged"] == pa["state"]["rl"]["reference"]
  live = pb["live_host_state"]  # measured from the buffers at step 0 (supervised layout)
  assert live == pb["host_state"]["sft"] and live["sft_optimizer"] > 0

  # every checkpoint holds the same values whichever placement wrote it
  plain_target = train.abstract_state(train.build_setup(_config(cache)), 2)
  for step in (1, 2, 3):
    target = plain_target if step > 1 else train.abstract_state(
        train.build_setup(_config(cache)), 1)
    _same_state(checkpoint.restore(str(plain / "checkpoints"), target, step)[0],
                checkpoint.restore(str(off / "checkpoints"), target, step)[0])
  # a checkpoint written without offload resumes with it
  _resume_from(plain, 2, resumed)
  c = train.train(_config(cache, [BOTH]), str(resumed), progress=False)
  assert _kinds(c.opt_state) == _kinds(c.ref_params) == {"pinned_host"}
  _same_state(a, c)
  assert _numbers(resumed) == _numbers(plain)[2:]


def test_bad_offload_requests_fail_in_one_line(tmp_path):
  with pytest.raises(ConfigError) as e:
    train.train(_config(tmp_path / "cache", ["train.offload=weights"]), str(tmp_path / "run"),
                progress=False)
  assert "\n" not in str(e.value) and "'weights'" in str(e.value), e.value
  assert not (tmp_path / "run" / memory.PLAN_FILE).exists()  # failed before planning
  parts = lambda value: settings.TrainSettings(offload=value).offload_parts
  assert parts("optimizer, reference,optimizer") == ("optimizer", "reference")
  assert parts("") == ()

  class NoHostMemory:  # the CPU devices here have pinned_host; a backend without it:
    platform, id, device_kind = "gpu", 3, "an old GPU"

    def addressable_memories(self):
      return jax.devices()[0].addressable_memories()[:1]  # the device memory only

  offload.check_backend(("reference",), jax.devices())  # the real devices have it
  offload.check_backend((), [NoHostMemory()])  # nothing requested: no check
  with pytest.raises(ConfigError) as e:
    offload.check_backend(("reference",), [NoHostMemory()])
  msg = str(e.value)
  assert "\n" not in msg and "pinned_host" in msg and "gpu device 3" in msg, msg


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_offloaded_steps_lower_for_accelerators(tmp_path, platform):
  """``jax.export`` lowers the offloaded RL update, supervised step and reference pass for
  TPU and CUDA: the offloaded arguments (and the updated optimizer state) carry the host
  memory kind and are moved to device memory inside the program. (Lowered, not compiled: no
  TPU or GPU compiler here.)"""
  s = train.build_setup(_config(tmp_path / "cache", [BOTH]))
  t = train.make_trainer(s, train.abstract_state(s))
  rl, sft = train.abstract_state(s, 2), train.abstract_state(s, 0)
  mb = memory.abstract_update_batch(t, s.train.batch_groups)
  args = (mb.prompt_tokens, mb.prompt_lengths, mb.tokens, mb.inputs.mask)
  n_opt = len(jax.tree.leaves(rl.opt_state))
  exported = {
      "rl_update": (jax.export.export(t.steps.rl_update, platforms=[platform])(
          rl.params, rl.opt_state, rl.value_params, rl.value_opt_state, mb), 2 * n_opt),
      "ref_logprobs": (jax.export.export(t.steps.ref_logprobs, platforms=[platform])(
          rl.ref_params, *args), len(jax.tree.leaves(rl.ref_params))),
  }
  B, T = s.sft.batch_size, s.prompt_len + s.rollout.max_new_tokens
  batch = [jax.ShapeDtypeStruct((B, T), dt, sharding=t.layout.rows(B))
           for dt in (np.int32, np.bool_, np.float32)]
  exported["sft"] = (jax.export.export(t.steps.sft, platforms=[platform])(
      sft.params, sft.sft_opt_state, *batch), 2 * len(jax.tree.leaves(sft.sft_opt_state)))
  for name, (e, host_values) in exported.items():
    text = e.mlir_module()
    assert e.platforms == (platform,), name
    assert text.count('mhlo.memory_kind = "pinned_host"') == host_values, name
    assert '_xla_buffer_placement = "device"' in text, name  # moved in inside the program
