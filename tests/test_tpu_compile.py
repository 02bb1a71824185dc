"""The topology dry run (``rl_jax.train.topology``): the quickstart's programs compiled for a
v5e:2x2 slice on this CPU host with libtpu (the Pallas TPU kernels by Mosaic, not only
lowered), the FSDP update's FLOPs split over the chips with its gradient reduce-scattered,
and one ``error:`` line for each thing that can be wrong.

The test extra installs libtpu (``setup.py``: the ``tpu`` extra), so these run in CI; the
skip below is only a guard for an install without it. ``tests/conftest.py`` sets
``JAX_PLATFORMS=cpu`` and ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` before jax is imported.
"""

import copy
import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import jax
import pytest

import pallas_kernels
from rl_jax import config_utils, sharding, train
from rl_jax.errors import ConfigError
from rl_jax.train import memory, topology
from tests.tiny import QUICKSTART, ROOT

pytest.importorskip("libtpu", reason="libtpu is part of the test extra (pip install -e .[test])")

# the quickstart's RL stage (no supervised warm start: its program is the plain next-token
# step) with the separate old-log-prob pass it keeps, on 8 groups of 8 samples a step (the
# compile time grows with the batch; 2 groups per chip on 4 chips)
QUICK = ["sft.steps=0", "train.batch_groups=8", "train.dry_run=True"]


def _config(topology_name, overrides=()):
  return config_utils.load_config(
      QUICKSTART, QUICK + [f"dry_run.topology={topology_name}", *overrides])


@pytest.fixture(scope="module")
def quick_plan(tmp_path_factory):
  """``train`` of the quickstart with ``dry_run.topology=v5e:2x2`` (the CLI's path after the
  command line): the plan it wrote."""
  workdir = str(tmp_path_factory.mktemp("tpu_plan"))
  assert train.train(_config("v5e:2x2"), workdir, progress=False) is None
  with open(os.path.join(workdir, topology.PLAN_FILE)) as f:
    return json.load(f)


def test_quickstart_compiles_for_v5e_with_the_mosaic_kernel(quick_plan):
  """Every program of the RL step compiles for 4 v5e chips: the packed log-prob pass and the
  update run the Pallas TPU shared-prefix kernel (forward; the update also its backward
  kernels) compiled by Mosaic, per shard; the sampler's decode runs the paged-attention
  kernel, per shard; the sampler's programs compile; the update gathers the weights and
  reduce-scatters the gradient; it fits."""
  p = quick_plan
  assert p["chips"] == 4 and p["device_kind"] == "TPU v5 lite" and p["platform"] == "tpu"
  assert p["mesh"] == {"data": 1, "fsdp": 4, "sequence": 1, "tensor": 1}
  assert set(p["programs"]) == {"logprobs", "rl_update", "kv_init", "prefill", "decode"}
  progs = p["programs"]
  assert progs["logprobs"]["kernels"] == ["shared_prefix_attention_fwd"]
  # the sampler's decode reads each sample's response pages with the paged kernel
  assert progs["decode"]["kernels"] == ["paged_decode_attention"]
  assert set(progs["rl_update"]["kernels"]) == {
      "shared_prefix_attention_fwd", "shared_prefix_attention_dq",
      "shared_prefix_attention_dkv_context", "shared_prefix_attention_dkv_response"}
  for name, prog in progs.items():
    assert prog["peak"] < p["capacity"] == topology.CHIPS["v5e"].hbm, name
    if name != "kv_init":  # XLA's own time estimate for each of these small programs
      assert prog["flops"] > 0 and prog["seconds"] > 0 and prog["time_source"] == "xla", name
  assert progs["decode"]["calls"] == 5  # one step of the loop per new token
  # FSDP: the weights gathered layer by layer, the gradient leaving through a reduce-scatter
  # (XLA:TPU's all-reduce-scatter fusion)
  assert progs["rl_update"]["collectives"]["reduce-scatter"]["count"] >= 1
  assert "all-gather" in progs["rl_update"]["collectives"]
  est = p["estimate"]
  assert est["fits"] and est["rl_step"]["seconds"] > 0 and 0 < est["rl_step"]["mfu"] < 1
  # the model's FLOPs alone: each program's model count, never above its larger count
  rl = est["rl_step"]
  model = sum(prog["model_flops"] * prog["calls"] for n, prog in progs.items()
              if n != "sft") / (rl["seconds"] * p["chip"]["flops"])
  assert rl["model_mfu"] == pytest.approx(model) and 0 < rl["model_mfu"] <= rl["mfu"]


def test_a_decode_that_gathers_the_model_every_step_gets_a_note(quick_plan):
  """The quickstart's decode on 4 v5e chips split FSDP-style all-gathers every projection
  at each step (at least half the policy's bytes): the plan's notes say so and name the
  tensor size that splits the projections instead (2: the model's kv heads), for the
  sampler alone and for training too (with rollout devices only the sampler's, the training
  mesh being another). No note with a tensor axis, with few bytes gathered, or when no power
  of two divides the kv heads."""
  p = quick_plan
  gathered = p["programs"]["decode"]["collectives"]["all-gather"]["bytes"]
  assert gathered >= p["state"]["rl"]["policy"] * 4 / 2
  note = topology.decode_gather_note(p, kv_heads=2)
  assert note in p["notes"] and "--config.mesh.sampler_tensor=2 " in note
  assert "--config.mesh.rules=fsdp_tp --config.mesh.shape.tensor=2 " in note
  # 8 kv heads on the 4 chips: tensor 4 (the chips bound it); on 8 chips 8, and 4 kv heads
  # bound it there
  assert "--config.mesh.shape.tensor=4 " in topology.decode_gather_note(p, kv_heads=8)
  eight = dict(p, sampler_mesh=dict(p["sampler_mesh"], fsdp=8))
  assert "--config.mesh.sampler_tensor=8 " in topology.decode_gather_note(eight, kv_heads=8)
  assert "--config.mesh.sampler_tensor=4 " in topology.decode_gather_note(eight, kv_heads=4)
  tensor = dict(p, sampler_mesh=dict(p["sampler_mesh"], fsdp=2, tensor=2))
  assert topology.decode_gather_note(tensor, kv_heads=2) is None
  split = topology.decode_gather_note(p, kv_heads=2, rollout_devices=2)
  assert "--config.mesh.sampler_tensor=2 " in split and "fsdp_tp" not in split
  few = copy.deepcopy(p)
  few["programs"]["decode"]["collectives"]["all-gather"]["bytes"] = 1000
  assert topology.decode_gather_note(few, kv_heads=2) is None
  assert topology.decode_gather_note(p, kv_heads=1) is None


def test_update_calls_whose_groups_do_not_split_over_the_batch_chips_get_a_note(quick_plan):
  """An update call's groups that the mesh's batch chips do not divide (the rows then stay
  whole on every chip and the update all-reduces activations: Qwen3-8B on v6e-16 in
  docs/SCALING.md): a note naming ``train.minibatches`` where one splits them and the
  multiple of ``train.batch_groups`` that does; none when they split, nor for a mixture of
  experts. The quickstart's 8 groups over 4 chips split (its plan has no such note)."""
  assert not any("do not split over" in n for n in quick_plan["notes"])
  note = lambda overrides: topology.update_split_note(
      topology.build(_config("v5e:2x2", overrides)).trainer.setup)
  assert topology.batch_chips(topology.build(_config("v5e:2x2")).trainer.setup) == 4
  assert note([]) is None  # 8 groups, one call
  assert note(["train.minibatches=2"]) is None  # 4 a call
  two = note(["train.minibatches=4"])  # 2 a call over 4 chips
  assert two.startswith("each update call's 2 groups do not split over the 4 chips")
  assert "--config.train.minibatches=2 splits them (fewer, larger optimizer steps; or a " \
         "train.batch_groups that is a multiple of 16)" in two, two
  odd = note(["train.batch_groups=6", "train.minibatches=1"])  # no minibatches splits 6
  assert odd.endswith("a train.batch_groups that is a multiple of 4 splits them"), odd
  assert note(["train.batch_groups=2", "train.minibatches=1", "mesh.shape.fsdp=2",
               "mesh.shape.data=2"]) is not None  # batch axes data x fsdp: 4 chips
  assert note(["train.batch_groups=2", "train.minibatches=1", "mesh.shape.fsdp=1",
               "mesh.shape.tensor=4", "mesh.rules=fsdp_tp"]) is None  # one batch chip
  assert note(["train.minibatches=4", "model.architecture=qwen3_moe", "model.num_experts=4",
               "model.moe_intermediate_size=16"]) is None


def test_a_tensor_parallel_sampler_gathers_a_fifth_of_the_bytes_on_tpu(tmp_path, quick_plan):
  """``mesh.sampler_tensor=4`` on the same 4 v5e chips: training keeps FSDP over 4 (the
  same update), the sampler's programs compile for tensor 4 with the fsdp_tp rules, its
  decode still runs the paged kernel and all-gathers under a fifth of the FSDP decode's
  bytes per step (no gather note), and the memory plan counts its copy. (With
  ``sampler_tensor=2`` the mesh's fsdp 2 still gathers half of them.)"""
  assert train.train(_config("v5e:2x2", ["mesh.sampler_tensor=4"]), str(tmp_path),
                     progress=False) is None
  with open(tmp_path / topology.PLAN_FILE) as f:
    p = json.load(f)
  assert p["mesh"] == quick_plan["mesh"] and p["rules"] == "fsdp"
  assert p["sampler_mesh"] == {"data": 1, "fsdp": 1, "sequence": 1, "tensor": 4}
  assert p["sampler_rules"] == "fsdp_tp"
  decode, fsdp = p["programs"]["decode"], quick_plan["programs"]["decode"]
  assert decode["kernels"] == ["paged_decode_attention"]
  gathered = lambda prog: prog["collectives"].get("all-gather", {}).get("bytes", 0)
  assert gathered(decode) < gathered(fsdp) / 5, (gathered(decode), gathered(fsdp))
  assert p["programs"]["rl_update"]["collectives"] == quick_plan["programs"]["rl_update"][
      "collectives"]
  assert p["state"]["rl"]["sampler_copy"] > 0 and p["estimate"]["fits"]
  assert not any("all-gathers" in note for note in p["notes"])


@pytest.mark.parametrize("prompt_pages", [False, True])
def test_multi_turn_run_compiles_the_agent_engines_programs(tmp_path, prompt_pages):
  """With ``env.name`` the sampler's programs are the multi-turn engine's: its turn loop's
  decode (the paged kernel) and the incremental prefill of observations (``extend``), on the
  engine's own pool: R = env.max_total_tokens (40, bucketed to 64) on pages of
  min(rollout.page_size, R) = 64 tokens, one page per sample, not the single-turn engine's
  32-token pages of R = rollout.max_new_tokens. With ``rollout.prompt_pages`` the prefill
  still takes whole first prompts (and writes their ids after the first onto pages): the
  same programs, and the re-prefill of a first prompt longer than the admission's bucket
  (``resume``: compiled, its peak counted, no calls per step). Every sampler program counts
  in the step's rollout time, the rest in the learner's."""
  config = config_utils.load_config(
      os.path.join(ROOT, "configs", "agent_quickstart.py"),
      ["sft.steps=0", "train.batch_groups=4", "train.dry_run=True",
       "dry_run.topology=v5e:2x2", f"rollout.prompt_pages={prompt_pages}"])
  assert (config.env.max_total_tokens, config.rollout.page_size,
          config.rollout.max_new_tokens) == (40, 64, 32)
  assert train.train(config, str(tmp_path), progress=False) is None
  with open(tmp_path / topology.PLAN_FILE) as f:
    p = json.load(f)
  progs = p["programs"]
  sampler = {"prefill", "decode", "extend"} | ({"resume"} if prompt_pages else set())
  assert set(progs) == {"logprobs", "rl_update", "kv_init"} | sampler
  if prompt_pages:  # 64 positions (R, below the chunk) for as many samples as one call
    # takes: 4 rows (the smallest bucket; 16 x 64 is more than 4 slots x 32 prompt ids)
    assert progs["resume"]["calls"] == 0
    assert progs["resume"]["note"].startswith("re-prefill of 4 samples x 64 positions")
  assert progs["decode"]["kernels"] == ["paged_decode_attention"]
  # (with the prompt on pages R also holds the first prompt's ids after its first: at most
  # data.max_prompt_len - 1 + 40 = 63, so still 64)
  assert progs["decode"]["calls"] == 64  # a decode step per trajectory token at most
  assert progs["extend"]["calls"] == config.env.max_turns - 1
  # either layout: the admission at the engine's longest first prompt's bucket (16 ids)
  assert progs["prefill"]["note"].endswith(" x 16 prompt tokens")
  time = lambda names: sum(progs[n]["time_s"] * progs[n]["calls"] for n in names)
  est = p["estimate"]["rl_step"]
  assert est["rollout_s"] == pytest.approx(time(sampler))
  assert est["learner_s"] == pytest.approx(time({"logprobs", "rl_update"}))
  samples = 4 * config.rollout.n
  assert p["kv_pool"] == {"pages": samples, "max_pages": samples, "page_size": 64,
                          "tokens": samples * 64}
  assert all(prog["peak"] < p["capacity"] for prog in progs.values())


def test_fsdp_update_flops_split_over_four_chips_with_a_reduce_scatter(quick_plan):
  """The update's FLOPs per chip on 4 chips are a quarter of one chip's (± 2 %), and its
  gradient leaves through a reduce-scatter (XLA:TPU's all-reduce-scatter fusion)."""
  built = topology.build(_config("v5e:1x1"))
  t, st = built.trainer, built.rl_state
  assert t.setup.mesh.size == 1
  batch = memory.abstract_update_batch(t, t.setup.geometry.rows)
  one = t.steps.rl_update.lower(st.params, st.opt_state, st.value_params,
                                st.value_opt_state, batch).compile()
  one_flops = topology.program_cost(one)["flops"]
  four = quick_plan["programs"]["rl_update"]
  assert four["flops"] * 4 == pytest.approx(one_flops, rel=0.02)
  assert four["collectives"]["reduce-scatter"]["count"] >= 1
  assert "all-gather" in four["collectives"]  # FSDP: the weights gathered layer by layer
  assert "reduce-scatter" not in topology.collectives(one.as_text())


def test_largest_batch_that_fits_is_compiled_and_the_next_is_not(quick_plan, monkeypatch):
  """With the v5e chip's HBM set to the quickstart's peak at 8 groups, the search reports 8
  (compiled: it fits) after compiling 16 for the slope; 12, the next multiple of 4 groups
  (one group per chip of the fsdp axis), compiled here, does not fit; the line names both."""
  peak = quick_plan["estimate"]["peak"]
  monkeypatch.setitem(topology.CHIPS, "v5e",
                      dataclasses.replace(topology.CHIPS["v5e"], hbm=peak))
  config = _config("v5e:2x2")
  mb = topology.max_batch(config, dict(quick_plan, capacity=peak))
  assert mb["step"] == 4 and mb["groups"] == 8 and mb["verified"], mb
  assert mb["points"]["8"]["fits"] and not mb["points"]["16"]["fits"]
  up = mb["next"]["groups"]
  assert up == 12 and not mb["next"]["compiled"] and mb["next"]["peak"] > peak
  over = topology.batch_peaks(config, up)
  assert not over["fits"] and over["peak"] > peak, over
  line = topology._max_batch_line(mb, peak)  # pylint: disable=protected-access
  assert line.startswith("largest train.batch_groups that fits: 8 (") and "12 predicted" in line


def test_the_plan_compiles_the_re_prefill_where_a_rollout_can_call_it():
  """``topology.reprefills``: a growing pool of single-turn groups never re-prefills; a fixed
  pool (preemptions), held groups (``rollout.partial``), prompts on pages (a long one is
  re-prefilled) and a multi-turn time-to-live (evictions) do, so their plans compile it."""
  from rl_jax import models, rollout  # pylint: disable=import-outside-toplevel
  cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                           num_heads=2, num_kv_heads=1, head_dim=16,
                           max_position_embeddings=512)
  single = lambda **kw: rollout.RolloutEngine(cfg, n=2, max_slots=2, max_new_tokens=64,
                                              max_prompt_len=16, page_size=16, **kw)
  assert not topology.reprefills(single(), partial=False)
  assert topology.reprefills(single(), partial=True)
  assert topology.reprefills(single(kv_pages=8), partial=False)
  assert topology.reprefills(single(prompt_pages=True), partial=False)
  multi = lambda **kw: rollout.AgentEngine(cfg, None, str, n=2, max_slots=2, max_prompt_len=16,
                                           max_total_tokens=64, deterministic=True,
                                           stop_ids=[1], **kw)
  assert not topology.reprefills(multi(ttl_steps=None), partial=False)
  assert topology.reprefills(multi(ttl_steps=4), partial=False)


def test_kernel_follows_the_mesh_platform():
  """``backend="auto"`` resolves by the platform of the mesh being traced for: the TPU
  kernel inside ``sharding.use`` on topology devices, the reference on this CPU host."""
  devices = topology.topology_devices("v5e:2x2")
  mesh = sharding.make_mesh({"fsdp": 4}, devices)
  assert pallas_kernels.resolve_backend() == "reference"
  with sharding.use(mesh, "fsdp"):
    assert pallas_kernels.resolve_backend() == "tpu" and sharding.platform() == "tpu"
  assert pallas_kernels.resolve_backend() == "reference" and sharding.platform() == "cpu"


@pytest.mark.parametrize("name", ["v9x:2x2", "v5e:2x2x2", "v5p:2x2", "v5e", "v6e:0x4"])
def test_unknown_topology_is_one_line(name):
  with pytest.raises(ConfigError, match="dry_run.topology") as e:
    topology.parse_topology(name)
  assert "\n" not in str(e.value) and "v5p:2x2x2" in str(e.value)


def test_missing_libtpu_names_the_install_command(monkeypatch):
  monkeypatch.setattr(topology, "_libtpu_path", lambda: None)
  with pytest.raises(ConfigError) as e:
    topology.topology_devices("v5e:2x2")
  assert 'pip install -e ".[tpu]"' in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides,words", [
    (["mesh.shape.fsdp=8"], ["needs 8 devices", "4 chips of dry_run.topology=v5e:2x2"]),
    (["mesh.shape.fsdp=-1", "mesh.shape.tensor=3"], ["does not divide", "v5e:2x2"]),
    (["mesh.shape.fsdp=-1", "dry_run.num_slices=2", "mesh.shape.data=3"],
     ["does not divide", "num_slices=2"]),
])
def test_mesh_that_does_not_fit_the_topology_is_one_line(overrides, words):
  with pytest.raises(ConfigError) as e:
    topology.build(_config("v5e:2x2", overrides))
  assert all(w in str(e.value) for w in words), str(e.value)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("layers,words", [
    # 27 billion float32 parameters on 4 chips: the policy alone is over the HBM
    (32, ["the policy alone needs 25.50 GiB per chip > 15.75 GiB"]),
    # 6.8 billion: the policy fits (6.4 GiB per chip), its Adam moments do not; XLA:TPU
    # refuses the program that builds the state
    (8, ["the run's state does not fit 15.75 GiB per v5e chip", "RESOURCE_EXHAUSTED"]),
])
def test_state_that_cannot_fit_fails_before_compiling_steps(layers, words):
  """Full fine-tuning of a large float32 model with Adam on 4 v5e chips: one line with the
  bytes and the knobs, before any step is compiled."""
  big = ["model.hidden_size=8192", "model.intermediate_size=28672",
         f"model.num_layers={layers}", "model.num_heads=64", "model.num_kv_heads=8",
         "model.head_dim=128"]
  with pytest.raises(topology.TopologyPlanError) as e:
    topology.plan_topology(_config("v5e:2x2", big), echo=False)
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith("dry_run.topology=v5e:2x2: "), msg
  assert all(w in msg for w in words) and "optim.mu_dtype=bfloat16" in msg, msg


def test_program_that_cannot_fit_names_it_and_its_bytes():
  """``_check_fits`` on a plan whose update is over the HBM: the program, its bytes, the
  chip's HBM and the knobs."""
  plan = {"topology": "v5e:2x2", "capacity": 16 << 30, "capacity_source": "v5e HBM",
          "state": {"rl": {"policy": 6 << 30, "rl_optimizer": 8 << 30}},
          "programs": {"rl_update": {"phase": "rl", "peak": 20 << 30}},
          "estimate": {"fits": False, "peak_program": "rl_update", "peak": 20 << 30}}
  with pytest.raises(topology.TopologyPlanError) as e:
    topology._check_fits(plan)  # pylint: disable=protected-access
  msg = str(e.value)
  assert "program rl_update needs 20.00 GiB per chip > 16.00 GiB" in msg
  assert "train.micro_batches" in msg and "\n" not in msg


def test_topology_needs_train_dry_run():
  config = config_utils.load_config(QUICKSTART, ["dry_run.topology=v5e:2x2"])
  with pytest.raises(ConfigError, match="train.dry_run=True"):
    topology.check_requested(config)


def test_cli_prints_one_error_line_for_an_unknown_topology(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "rl_jax.train", f"--config={QUICKSTART}", f"--workdir={tmp_path}",
       "--config.train.dry_run=True", "--config.dry_run.topology=v5x:2x2"],
      cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode == 2
  lines = [line for line in out.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: dry_run.topology='v5x:2x2'"), lines


def test_host_platform_is_cpu_only_when_unset(monkeypatch):
  """The CLI's topology dry run runs JAX on the CPU unless the user chose a platform."""
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  topology.use_host_platform()
  assert os.environ["JAX_PLATFORMS"] == "cuda"
  monkeypatch.delenv("JAX_PLATFORMS")
  monkeypatch.delenv("ALLOW_MULTIPLE_LIBTPU_LOAD", raising=False)
  topology.use_host_platform()
  assert os.environ["JAX_PLATFORMS"] == "cpu" == jax.config.jax_platforms
  assert os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1"


def test_mfu_of_the_model_flops_alone_where_xla_counts_more():
  """Two programs of one second each on a chip of 100 FLOP/s: one where XLA counted a loop
  body once (40 of the model's 80 FLOPs), one where it counts 3x the model's (an MoE
  update's padded expert matmuls). ``mfu`` takes each program's larger count (80 + 60),
  ``model_mfu`` the model's (80 + 20); the printed line gives both."""
  prog = lambda flops, model: dict(time_s=1.0, calls=1, flops=flops, model_flops=model,
                                   peak=1, time_source="xla")
  plan = {"programs": {"decode": prog(40.0, 80.0), "rl_update": prog(60.0, 20.0)},
          "chip": {"flops": 100.0}, "peak": {"state": 0}, "capacity": 2}
  rl = topology._estimate(None, plan)["rl_step"]
  assert rl["mfu"] == pytest.approx(140 / 200) and rl["model_mfu"] == pytest.approx(100 / 200)
  assert topology._mfu(rl) == "70.0% (model FLOPs alone: 50.0%)"
  assert topology._mfu(dict(rl, model_mfu=0.7)) == "70.0%"
  assert topology._mfu(dict(mfu=0.7)) == "70.0%"  # a plan written before model_mfu
  assert topology._mfu(dict(mfu=None, model_mfu=None)) == "n/a"


def test_collectives_of_hlo_text():
  """Kinds, counts and result bytes; XLA:TPU's reduce-scatter fusion counts once as a
  reduce-scatter and the all-reduce inside it not at all; an async start counts its result."""
  hlo = "\n".join([
      "%all-reduce-scatter.1 (input: f32[1024,64]) -> f32[256,64] {",
      "  %all-reduce.2 = f32[1024,64]{1,0} all-reduce(%input), channel_id=1",
      "}",
      "ENTRY %main (p: bf16[256,64]) -> f32[256,64] {",
      "  %all-gather.1 = bf16[1024,64]{1,0:T(8,128)(2,1)} all-gather(%p), dimensions={0}",
      "  %ags = (bf16[256,64]{1,0}, bf16[1024,64]{1,0}) all-gather-start(%p), dimensions={0}",
      "  %agd = bf16[1024,64]{1,0} all-gather-done(%ags)",
      "  %cps = (bf16[8,64]{1,0}, bf16[8,64]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) "
      "collective-permute-start(%p), source_target_pairs={{0,1},{1,0}}",
      "  %cpd = bf16[8,64]{1,0} collective-permute-done(%cps)",
      "  %s = f32[] all-reduce(%x), to_apply=%add",
      "  ROOT %fusion.3 = f32[256,64]{1,0} fusion(%q), kind=kCustom, "
      "calls=%all-reduce-scatter.1",
      "}"])
  assert topology.collectives(hlo) == {
      "all-gather": {"count": 2, "bytes": 2 * 1024 * 64 * 2},
      "all-reduce": {"count": 1, "bytes": 4},
      "collective-permute": {"count": 1, "bytes": 8 * 64 * 2},
      "reduce-scatter": {"count": 1, "bytes": 256 * 64 * 4}}


def test_sweep_script_writes_models_that_parse(tmp_path):
  """scripts/tpu_plan.py's hand-written configs read as the published shapes (parameter
  counts), its stand-in tokenizer loads, and its data file's prompts have the set length;
  its table gives the model FLOPs' MFU in brackets where it differs."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  from rl_jax import models  # pylint: disable=import-outside-toplevel
  from rl_jax.data import tokenizers  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location(
      "tpu_plan", os.path.join(ROOT, "scripts", "tpu_plan.py"))
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  billions = {"qwen3-0.6b": 0.6, "qwen3-1.7b": 1.7, "qwen3-8b": 8.2, "qwen3-32b": 32.8,
              "qwen3-30b-a3b": 30.5, "gemma3-12b": 11.8}
  for name, size in billions.items():
    path = str(tmp_path / name)
    script.write_model(path, name)
    cfg = models.read_hf_config(path)
    shapes = jax.tree.leaves(models.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    count = sum(math.prod(x) for x in shapes) / 1e9
    assert count == pytest.approx(size, rel=0.05), name
    assert tokenizers.load_tokenizer(path).vocab_size <= cfg.vocab_size
  script.write_data(str(tmp_path / "data.jsonl"), 200)
  tok = tokenizers.load_tokenizer(str(tmp_path / "qwen3-8b"))
  with open(tmp_path / "data.jsonl") as f:
    question = json.loads(f.readline())["question"]
  assert len(tok.encode(question)) == 200
  gib = 1 << 30
  row = dict(model="m", topology="v5p:2x2x1", variant="full", peak=gib, capacity=2 * gib,
             peak_program="rl_update", fits=True, state=gib, step_s=2.0, rollout_s=1.0,
             learner_s=1.0, mfu=0.24, model_mfu=0.054)
  assert "| 24.0% (model FLOPs: 5.4%) |" in script.table([row])
  assert "| 24.0% |" in script.table([dict(row, model_mfu=None)])  # a row from before it


def test_sampler_copy_is_one_per_host_split_over_its_chips():
  """On a slice of two hosts (``v5p:2x2x2``: 4 chips each) every host samples from its own
  copy of the policy laid out over its 4 chips by the sampler's rules
  (``layout.per_process_shardings``: sharded within the host, replicated across hosts), so
  the memory plan's ``sampler_copy`` is a chip's share of the weights, not all of them."""
  from rl_jax.train import layout  # pylint: disable=import-outside-toplevel
  from rl_jax.train.context import build_setup  # pylint: disable=import-outside-toplevel
  from rl_jax.train import state as state_lib  # pylint: disable=import-outside-toplevel
  devices = topology.topology_devices("v5p:2x2x2")
  s = build_setup(_config("v5p:2x2x2"), devices)
  assert s.sampler_mesh is not s.mesh and s.sampler_mesh.devices.size == 4
  params = state_lib.abstract_state(s).params
  targets = layout.sampler_shardings(s.sampler_cfg, s.sampler_mesh, s.rules, params)
  spread = layout.per_process_shardings(s.mesh, s.sampler_mesh, targets, devices)
  grid = jax.tree.leaves(spread)[0].mesh
  assert dict(grid.shape) == {"processes": 2, **dict(s.sampler_mesh.shape)}
  assert (grid.devices[0] == s.sampler_mesh.devices).all()  # this host's row: its own chips
  assert {d.process_index for d in grid.devices[1].flat} == {1}
  whole = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
  copy = memory._sampler_copy_bytes(s, params)  # pylint: disable=protected-access
  assert whole / 4 <= copy < whole / 2, (copy, whole)  # most weights split over 4 chips


def test_sampler_compiles_on_a_host_whose_chips_are_not_the_first_ids(tmp_path):
  """On ``v6e:8x8`` (16 hosts of 2x2 chips) host 0 holds chips 0, 1, 8 and 9; libtpu aborts
  the process (SIGABRT) compiling a 4-chip program for those ids, so the dry run compiles
  the sampler's programs for the same places of a one-host ``v6e:2x2`` (ids 0-3). The plan
  runs in a subprocess: the abort would kill pytest."""
  out = subprocess.run(
      [sys.executable, "-m", "rl_jax.train", f"--config={QUICKSTART}", f"--workdir={tmp_path}",
       "--config.train.dry_run=True", "--config.dry_run.topology=v6e:8x8",
       *(f"--config.{o}" for o in QUICK[:2]), "--config.train.batch_groups=16"],
      cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode == 0, out.stderr[-2000:]
  with open(tmp_path / topology.PLAN_FILE) as f:
    plan = json.load(f)
  assert plan["hosts"] == 16 and plan["sampler_mesh"]["fsdp"] == 4
  assert {"kv_init", "prefill", "decode"} <= set(plan["programs"])
  assert plan["estimate"]["fits"]
  from rl_jax.train.context import build_setup  # pylint: disable=import-outside-toplevel
  s = build_setup(_config("v6e:8x8", ["train.batch_groups=16"]),
                  topology.topology_devices("v6e:8x8"))
  assert sorted(d.id for d in s.sampler_mesh.devices.flat) == [0, 1, 8, 9]
  host = topology._host_topology_mesh(s)  # pylint: disable=protected-access
  assert host.shape == s.sampler_mesh.shape
  assert sorted(d.id for d in host.devices.flat) == [0, 1, 2, 3]
  place = lambda m: [tuple(d.coords) for d in m.devices.flat]
  assert place(host) == place(s.sampler_mesh)  # host 0's 2x2 block is at the grid's origin


def test_moe_decode_layer_moves_tokens_not_experts_on_tpu():
  """XLA's TPU partitioner all-gathers every expert weight of a grouped matmul whose experts
  are split over the chips; the sampler's small batches move their tokens to the experts
  instead (``moe._local_experts_mlp``): compiled for v5e:2x2, no collective of the decode's
  expert layer moves as much as one chip's experts."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from rl_jax.models import moe  # pylint: disable=import-outside-toplevel
  from tests.test_moe_sharding import _collectives  # pylint: disable=import-outside-toplevel
  B, D, E, X, F = 16, 256, 16, 2, 128
  mesh = sharding.make_mesh({"fsdp": 4}, topology.topology_devices("v5e:2x2"))
  shapes = [(B, 1, D), (D, E), (E, D, F), (E, D, F), (E, F, D)]
  axes = [("batch", "length", None), (None, None)] + [("expert", None, None)] * 3

  def layer(x, w_router, w_gate, w_up, w_down):
    with sharding.use(mesh, "fsdp"):
      weights, ids, _ = moe.route(x, w_router, X, True)
      return moe.expert_mlp(x, weights, ids, w_gate, w_up, w_down)
  args = [jax.ShapeDtypeStruct(s, np.float32) for s in shapes]
  shardings = [NamedSharding(mesh, sharding.logical_to_spec(a, "fsdp", mesh, s))
               for a, s in zip(axes, shapes)]
  hlo = jax.jit(layer, in_shardings=shardings).lower(*args).compile().as_text()
  ops = _collectives(hlo)
  assert ops["all-gather"], ops  # the tokens and their routing
  one_chip = E // 4 * D * F
  for types in ops.values():
    for t in types:
      for dims in re.findall(r"\[([\d,]*)\]", t):
        assert math.prod(int(n) for n in dims.split(",") if n) < one_chip, ops


def _sequence_pool_script():
  """scripts/tpu_sequence_pool.py as a module."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location(
      "tpu_sequence_pool", os.path.join(ROOT, "scripts", "tpu_sequence_pool.py"))
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  return script


def test_paged_decode_over_a_sequence_axis_compiles_with_mosaic():
  """The sampler's decode on v5e:2x2 as fsdp 2 x sequence 2, the pool's pages split over both
  (``kv_cache.sequence_shards``: a sample's entries round-robin over the sequence chips):
  Mosaic compiles the paged kernel (one call per layer, each chip on its own pages under
  ``shard_map``), a chip holds a quarter of the pool, and no collective moves as much as
  one chip's share of a layer's pool."""
  from rl_jax import models  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh({"fsdp": 2, "sequence": 2}, topology.topology_devices("v5e:2x2"))
  cfg = models.ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
                           max_position_embeddings=1024, dtype="bfloat16",
                           prefix_attention="kernel")
  Pg = 8 * 64
  compiled, state = _sequence_pool_script().compile_decode(cfg, mesh, 8, 3, 128, 256, 16, Pg, 8)
  pool = state.suffix_k[0]
  assert pool.sharding.shard_shape(pool.shape)[0] == Pg // 4
  hlo = compiled.as_text()
  assert hlo.count("tpu_custom_call") == cfg.num_layers
  share = math.prod(pool.sharding.shard_shape(pool.shape))
  moved = re.findall(r"= \w+\[([\d,]*)\]\S* (?:all-gather|all-reduce|all-to-all|"
                     r"collective-permute|reduce-scatter)", hlo)
  assert all(math.prod(int(d) for d in dims.split(",") if d) < share for dims in moved), moved


def test_sequence_pool_script_splits_one_groups_pool_over_the_sequence_chips():
  """scripts/tpu_sequence_pool.py on a small model for v5e:2x2: one group's pool cannot be
  split over fsdp=4 (one slot), so every chip holds all of it; over sequence=4 a chip holds a
  quarter, and the decode's collectives shrink to the merge of the partial softmaxes. With
  the weights replicated over sequence=4, the decode re-reads each layer's weights from its
  stack in the loop (``transformer._sharded_stacks`` on an accelerator): the temporaries
  grow by less than a quarter of a layer's weights per layer (before, each layer's slice
  was a copy held for the whole decode: a layer's weights per layer)."""
  from rl_jax import models  # pylint: disable=import-outside-toplevel
  script = _sequence_pool_script()
  # layers of Qwen3-1.7B's width (smaller weights would sit in the chips' VMEM)
  cfg = models.ModelConfig(vocab_size=256, hidden_size=2048, intermediate_size=4096,
                           num_layers=2, num_heads=16, num_kv_heads=8, head_dim=128,
                           max_position_embeddings=2048, dtype="bfloat16",
                           param_dtype="bfloat16", prefix_attention="kernel")
  devices = topology.topology_devices("v5e:2x2")
  measure = lambda c, m: script.measure(c, devices, script.parse_mesh(m), 1, 4, 128, 1024, 64,
                                        1024)
  rows = [measure(cfg, m) for m in ("fsdp=4", "sequence=4")]
  whole = 2 * cfg.num_layers * 4 * 1024 * cfg.num_kv_heads * cfg.head_dim * 2 / (1 << 30)
  assert rows[0]["pool_gib"] == pytest.approx(whole)
  assert rows[1]["pool_gib"] == pytest.approx(whole / 4)
  assert all(r["kernels"] == "paged_decode_attention" for r in rows), rows
  assert rows[1]["collective_mib"] < rows[0]["collective_mib"]
  four = measure(dataclasses.replace(cfg, num_layers=4), "sequence=4")
  layer = (2048 * 6144 + 3 * 2048 * 4096) * 2 / (1 << 30)  # one layer's weights, bf16
  assert (four["temporaries_gib"] - rows[1]["temporaries_gib"]) / 2 < 0.25 * layer, (
      four, rows[1], layer)
