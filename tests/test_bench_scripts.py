"""Smoke tests of the benchmark scripts at toy sizes (they are not timed here)."""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import config as config_lib

_SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def _load(name):
  """Imports scripts/<name>.py as a module (scripts/ is not a package)."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(_SCRIPTS, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_bench_shared_prefix_quick_reports_both_layouts(tmp_path):
  bench = _load("bench_shared_prefix")
  out = tmp_path / "report.md"
  result = bench.main(["--quick", "--repeats", "1", "--out", str(out)])
  (row,) = result["rows"]
  assert set(row["ms"]) == {"replicated", "packed"}
  assert all(ms > 0 for ms in row["ms"].values())
  assert row["diff"] <= bench.LOGPROB_TOL
  assert row["rho"] == bench.models.token_reduction(row["n"], row["p"], row["r"])
  assert row["flop_ratio"] > 1.0
  assert row["memory"]["packed"]["temp"] < row["memory"]["replicated"]["temp"]
  text = out.read_text()
  assert "| N | P | R | rho |" in text and "skipped" in text


def test_bench_shared_prefix_packed_logprobs_equal_replicated():
  bench = _load("bench_shared_prefix")
  cfg = bench.model_config(quick=True)
  params = bench.models.init_params(cfg, jax.random.key(3), std=0.2)
  batch = bench.make_batch(cfg, groups=2, n=3, p=10, r=5, seed=1)
  packed = bench.batch_logprobs(cfg, params, batch, shared_prefix=True)
  replicated = bench.batch_logprobs(cfg, params, batch, shared_prefix=False)
  np.testing.assert_allclose(packed, replicated, atol=1e-5)
  assert bench.max_logprob_diff(cfg, params, batch) <= 1e-5


def test_bench_shared_prefix_kernel_part_in_interpreter():
  bench = _load("bench_shared_prefix")
  res = bench.bench_kernel(2, 16, 8, heads=4, kv_heads=2, head_dim=8, dtype=jnp.float32,
                           repeats=1, interpret=True)
  assert set(res["ms"]) == {"kernel", "reference", "replicated"}
  assert res["max_diff"] < 1e-4


def test_bench_rollout_april_section_runs_at_toy_size():
  bench = _load("bench_rollout")
  cfg = bench.models.ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48,
                                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                                 max_position_embeddings=64)
  params = bench.models.init_params(cfg, jax.random.key(0), std=0.2)
  res = bench.bench_april(cfg, params, k=2, n=2, slots=4, new_tokens=16,
                          eos=list(range(3, 61, 5)), steps=2, warmup=1)
  assert set(res) == {"wait-for-all", "APRIL 2x", "APRIL 2x, staleness bound 1"}
  assert res["wait-for-all"]["stale"] == 0.0 and res["wait-for-all"]["lag"] == 0
  assert res["APRIL 2x, staleness bound 1"]["lag"] <= 1
  assert all(r["groups_s"] > 0 for r in res.values())


def test_bench_selection_counts_tokens_and_time_to_target():
  bench = _load("bench_selection")
  G, n = 2, 8
  rows = [{"phase": "sft", "step": 1, "eval_accuracy": 0.9},  # warm start: not counted
          {"phase": "rl", "step": 2, "response_length": 2.0, "rollout_tokens_per_s": 4.0},
          {"phase": "rl", "step": 3, "response_length": 2.0, "rollout_tokens_per_s": 16.0,
           "rollout_tokens": 96.0, "eval_accuracy": 0.3},
          {"phase": "rl", "step": 4, "response_length": 1.0, "rollout_tokens_per_s": 32.0,
           "eval_accuracy": 0.6},
          {"phase": "rl", "step": 5, "response_length": 1.0, "rollout_tokens_per_s": 32.0,
           "eval_accuracy": 0.4}]
  res = bench.to_target(rows, 0.5, G, n)
  # tokens: 32 (trained) + 96 (reported, dropped groups included) + 16; seconds: the first
  # RL step (compilation) left out, then 32 / 16 and 16 / 32
  assert (res["tokens"], res["seconds"], res["step"]) == (144.0, 2.5, 4)
  assert res["final_accuracy"] == 0.4 and res["total_tokens"] == 160.0
  assert bench.to_target(rows, 0.7, G, n)["step"] is None
  assert bench.method_overrides("beta") == ["data.selector=beta"]
  adaptive = bench.config_utils.load_config(bench.QUICKSTART,
                                            bench.BASE + bench.method_overrides("adaptive"))
  assert adaptive.data.group_size == "adaptive"
  config_lib.validate(adaptive)  # the benchmark's settings pass the config checks


def test_bench_update_runs_at_toy_size():
  """Two variants compiled with options (the fused MLP's exactness is
  tests/test_fused_layers.py's, the options' tests/test_compile_options.py's): the blocks of
  temporaries change no value."""
  bench = _load("bench_update")
  base, blocks = "fused+concat+xla_reductions", "fused+concat+xla_reductions+temp_blocks"
  res = bench.main(["--repeats", "1", "--variants", f"{base},{blocks}",
                    "--samples", "2", "--length", "4", "--hidden", "32", "--layers", "1"])
  assert res["max_diff"][blocks] == 0.0
  assert len(res["times_s"][base]) == 1 and res["times_s"][base][0] > 0
  assert res["first_s"][blocks] > 0 and len(res["faults"][blocks]) == 1


def test_bench_trl_step_summary_excludes_the_warm_up_step():
  bench = _load("bench_trl")
  begins, lengths = [0.0, 10.0, 12.0, 15.0], [9.0, 1.0, 2.0, 4.0]
  marks = [m for b, n in zip(begins, lengths) for m in (("begin", b), ("end", b + n))]
  sampled = [(5.0, 1000), (0.5, 900), (0.25, 1024), (1.0, 800)]
  got = bench.step_summary(marks, sampled)
  assert (got["grpo_first_s"], got["grpo_step_s"], got["grpo_worst_s"]) == (9.0, 2.0, 4.0)
  assert (got["grpo_sampling_s"], got["grpo_tokens"], got["grpo_steps"]) == (0.5, 900, 4)
  with np.testing.assert_raises(RuntimeError):  # a step without its sampling call
    bench.step_summary(marks, sampled[:3])
  side = {"sampler_tokens_per_s": 100.0, "grpo_step_s": 2.0, "grpo_first_s": 9.0}
  trl = {**side, "sampler_tokens_per_s": 25.0, "grpo_step_s": 3.0, "grpo_worst_s": 4.0,
         "grpo_sampling_s": 1.0, "grpo_tokens": 1000}
  text = bench.report({"rljax": [side, {**side, "grpo_step_s": 1.0}], "trl": [trl, trl]})
  assert "sampler 4.00x median, 4.00x worst; GRPO step 2.25x faster median, 1.50x worst" in text


def test_bench_rollout_sampling_at_toy_size():
  bench = _load("bench_rollout")
  cfg = bench.models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=88,
                                 num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                                 max_position_embeddings=64)
  params = bench.models.init_params(cfg, jax.random.key(0), std=0.05)
  res = bench.bench_sampling(cfg, params, batch=2, prompt_len=3, new_tokens=4, rounds=2,
                             threads=1)
  assert len(res["ratio"]) == 2 and all(r > 0 for r in res["ours"] + res["theirs"])
  np.testing.assert_allclose(res["ratio"], np.divide(res["ours"], res["theirs"]))


def test_accelerator_report_reduced_mode_on_cpu(monkeypatch):
  report = _load("accelerator_report")
  kernel = report.kernel_rows(reduced=True, repeats=1, sizes=[(2, 8, 4)])
  assert kernel[0]["fwd_diff"] < 1e-5 and kernel[0]["grad_diff"] < 1e-4
  assert report.device_peaks()[1:] == (None, None)  # no peak known for a CPU
  cfg, *_ = report._update_model(reduced=True)  # pylint: disable=protected-access
  for _, _, overrides in report.UPDATE_VARIANTS:  # every variant names config fields
    cfg.replace(**overrides)
  # One variant timed here (each is a compile; the accelerator run times them all).
  monkeypatch.setattr(report, "UPDATE_VARIANTS", report.UPDATE_VARIANTS[1:2])
  rows = report.update_mfu(reduced=True, repeats=1, peak_flops=None)
  assert [r["name"] for r in rows] == ["packed, layers unrolled"]
  # Forward + backward of every matmul weight over every token is at least 6 FLOPs per
  # weight and token: the count is not missing the matmuls (as a GPU cost analysis does).
  cfg = report.models.ModelConfig(architecture="qwen3", vocab_size=256, hidden_size=32,
                                  intermediate_size=96, num_layers=2, num_heads=4,
                                  num_kv_heads=2, head_dim=8, qk_norm=True)
  layer = 32 * (4 * 8) * 2 + 32 * (2 * 8) * 2 + 3 * 32 * 96  # q, o, k, v, gate/up/down
  tokens = 8 + 4 * 8
  assert rows[0]["flops"] >= 6 * (cfg.num_layers * layer) * tokens
  assert all(r["flops"] == rows[0]["flops"] and r["ms"] > 0 for r in rows)
  # the paged section: the kernel (Pallas interpreter here) agrees with its reference; the
  # live bytes are the valid positions' keys and values
  (args, tokens), = [report._paged_inputs(3, 2, 2, 16, 16, 40, jnp.float32)]  # pylint: disable=protected-access
  assert tokens == int(args[5].sum()) and int((args[3] >= 0).sum()) == args[1].shape[0]
  paged = report.paged_rows(reduced=True, repeats=1, peak_bw=None)
  assert len(paged) == 3 and all(r["out_diff"] < 1e-5 and r["lse_diff"] < 1e-5 for r in paged)
  assert paged[0]["live"] == 2 * tokens * 2 * 16 * 4 and paged[0]["fraction"] is None
  # the split GPU kernel beside it (interpreted): 2 rows of up to 32 key blocks, 4 programs
  assert [r["splits"] for r in paged] == [1, 1, 4]
  assert all(r["split_out_diff"] < 1e-5 and r["split_lse_diff"] < 1e-5 for r in paged)


def test_bench_memory_lora_checkpoint_writer_and_plan_verdict(tmp_path):
  """``bench_memory.py lora`` at toy size: the sharded checkpoint writer gives a checkpoint
  transformers and rl_jax both load (every tensor, no missing key), the LoRA/QLoRA overrides
  name config fields, and the verdict is the trainer's one-line MemoryPlanError."""
  import transformers  # pylint: disable=import-outside-toplevel
  from rl_jax import models  # pylint: disable=import-outside-toplevel
  bench = _load("bench_memory")
  shape = (64, 128, 2, 2, 1, True)  # hidden, intermediate, layers, heads, kv heads, tied
  bench.write_config(str(tmp_path), "toy", shape=shape, vocab=300)
  n = bench.write_weights(str(tmp_path), "toy", shard_bytes=100_000, shape=shape, vocab=300)
  assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
  model, info = transformers.Qwen3ForCausalLM.from_pretrained(str(tmp_path),
                                                              output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"]
  assert sum(p.numel() for p in model.parameters()) == n
  _, params = models.load_hf(str(tmp_path))
  assert sum(x.size for x in jax.tree.leaves(params)) == n
  config = config_lib.base_config()
  for o in bench.lora_overrides(16, "int4", steps=1) + bench.full_overrides(1):
    node, *path = config, *o.split("=", 1)[0].split(".")
    for key in path:  # every override names a field of the config
      node = node[key]
  plan = {"state": {"rl": {"policy": 6 << 30, "rl_optimizer": 12 << 30}},
          "peak": {"rl": 30 << 30}, "capacity": 24 << 30, "capacity_source": "host RAM"}
  verdict = bench.plan_verdict(plan)
  assert verdict.startswith("does not fit: memory plan: the rl phase needs 30.000 GiB")
  assert "\n" not in verdict
  assert bench.plan_verdict(dict(plan, peak={"rl": 20 << 30})).startswith("fits: ")


def test_bench_speculative_reuses_every_draft_of_an_unchanged_policy():
  """``bench_speculative`` stores the drafts as the trainer does: with no drift (p = q) the
  acceptance ratio is exactly 1, so every draft token is kept and nothing is decoded again
  (a misaligned or wrongly tempered stored distribution would reject some)."""
  bench = _load("bench_speculative")
  prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
  cfg, q, p = bench.policy_pair(32, drift=0.0)
  drafts = bench.make_drafts(cfg, q, prompts, m=2, r=8, seed=1)
  info = bench.speculative_rollout(cfg, p, prompts, drafts, m=2, r=8, seed=2)
  assert info == {"reused": 1.0, "longest_decode": 0}


def test_bench_tunix_prompt_tokens_sets_one_shared_prompt_and_the_rljax_side_runs_it(tmp_path):
  """``--prompt-tokens``: the prompt is that many tokens with its BOS, on every side; the
  rl_jax side's sampler and GRPO step take it whole (one step at toy length)."""
  bench = _load("bench_tunix")
  with np.testing.assert_raises(ValueError):
    bench.set_prompt_tokens(5)
  bench.set_prompt_tokens(40)
  assert len(bench.PROMPT.encode()) == 39 and bench.PROMPT.endswith("sort 302:")
  assert bench.MAX_PROMPT == 40 and bench.context(8) == 128
  bench.write_weights(str(tmp_path), new_tokens=8)
  res = bench.run_rljax(str(tmp_path), steps=2, repeats=1, n=2, new_tokens=8)
  assert res["sampler_tokens"] == 2 * 8 and res["grpo_steps"] == 2
  assert res["grpo_step_s"] > 0 and 0 < res["grpo_tokens"] <= 2 * 8


def test_bench_decode_attention_baseline_is_the_same_attention_and_runs():
  """The script's baseline (keys [.., len, H]) computes what ``decode_attention`` computes
  on length-last keys; the quick run reports both at equal outputs."""
  bench = _load("bench_decode_attention")
  rng = np.random.default_rng(2)
  G, M, N, K, H, P, R = 2, 3, 4, 2, 8, 5, 6
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, pk, pv = normal(G, M, N, H), normal(G, K, P, H), normal(G, K, P, H)
  sk, sv = normal(G, M, K, R, H), normal(G, M, K, R, H)
  pvalid = jnp.arange(P)[None, :] < jnp.array([[3], [5]])
  svalid = jnp.arange(R)[None, None, :] < jnp.array(rng.integers(1, R + 1, (G, M)))[..., None]
  base = bench.attention_keys_by_position(q, pk, pv, pvalid, sk, sv, svalid)
  new = bench.decode_attention(q, jnp.swapaxes(pk, -1, -2), pv, pvalid,
                               jnp.swapaxes(sk, -1, -2), sv, svalid)
  np.testing.assert_allclose(base, new, rtol=1e-6, atol=1e-6)
  (row,) = bench.main(["--quick", "--repeats", "1", "--steps", "2", "--layers", "1"])
  assert row["diff"] < 1e-5 and row["baseline_us"] > 0 and row["length_last_us"] > 0


def test_bench_micro_batches_reports_each_k_at_toy_size(tmp_path, monkeypatch):
  bench = _load("bench_micro_batches")
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the script writes its weights
  rows = bench.main(["--groups", "2", "--samples", "2", "--new-tokens", "8", "--ks", "1,2",
                     "--repeats", "1"])
  assert not os.listdir(tmp_path)  # the weights are removed when it ends
  assert set(rows) == {1, 2}
  assert all(r["temp_mb"] > 0 for r in rows.values())  # toy size: the sum outweighs activations
  assert rows[2]["max_abs_diff"] < 1e-6 and all(r["median_s"] > 0 for r in rows.values())


_SERVED_CHILD = """
import json, sys, time
side, fail = sys.argv[1], sys.argv[2] == "fail"
print("a log line", flush=True)
print("@@ " + json.dumps({"ready": True}), flush=True)
n = 0
for line in sys.stdin:
  name = line.strip()
  if name not in ("sample", "step"):
    break
  n += 1
  if fail and n == 2:
    sys.exit("gone")
  print("@@ " + json.dumps({"s": 0.001 * n, "tokens": 8, "side": side, "name": name, "n": n,
                           "t": time.time()}), flush=True)
"""


def test_lockstep_takes_turns_after_the_warmup_and_removes_the_weights(tmp_path, monkeypatch):
  """``bench_tunix.lockstep`` (``--lockstep``): both sides served at once on the shared
  weights; per command, the untimed warm-up turns, then the timed pairs with the first side
  first in even pairs; log lines skipped; a side that ends reports its stderr; the weights are
  gone however it ends."""
  bench = _load("bench_tunix")
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

  def command(side, weights, fail=None):
    assert "config.json" in os.listdir(weights)
    return [sys.executable, "-c", _SERVED_CHILD, side, "fail" if side == fail else "ok"]

  results = bench.lockstep(3, ("rljax", "peer"), 8, command, {"sample": 1, "step": 2})
  for name in ("sample", "step"):
    for side in ("rljax", "peer"):
      got = results[name][side]
      assert [a["name"] for a in got] == [name] * 3 and {a["side"] for a in got} == {side}
  # the peer's answers count its own turns: 1 warm-up sample, 3 timed, 2 warm-up steps, 3 timed
  assert [a["n"] for name in ("sample", "step") for a in results[name]["peer"]] == \
      [2, 3, 4, 7, 8, 9]
  for name in ("sample", "step"):  # rl_jax first in pairs 0 and 2, the peer first in pair 1
    first = [a["t"] < b["t"] for a, b in zip(results[name]["rljax"], results[name]["peer"])]
    assert first == [True, False, True]
  assert not os.listdir(tmp_path)
  with pytest.raises(RuntimeError, match="peer failed:(.|\n)*gone"):
    bench.lockstep(1, ("rljax", "peer"), 8, lambda s, w: command(s, w, fail="peer"),
                   {"sample": 1})
  assert not os.listdir(tmp_path)


def test_bench_tunix_served_rljax_side_answers_sampler_calls_and_grpo_steps(tmp_path):
  """``--side rljax --serve`` (the rl_jax child of ``--lockstep``) at toy size: ready, then one
  answer per command (the call's time and the tokens it sampled), until ``quit``."""
  bench = _load("bench_tunix")
  bench.write_weights(str(tmp_path), new_tokens=8)
  env = dict(os.environ, PYTHONPATH=os.path.dirname(_SCRIPTS))
  out = subprocess.run(
      [sys.executable, os.path.join(_SCRIPTS, "bench_tunix.py"), "--side", "rljax", "--serve",
       "--weights", str(tmp_path), "--samples", "2", "--new-tokens", "8"],
      input="sample\nstep\nstep\nquit\n", capture_output=True, text=True, env=env,
      timeout=600, check=True)
  answers = [json.loads(line[3:]) for line in out.stdout.splitlines() if line.startswith("@@ ")]
  assert answers[0] == {"ready": True} and len(answers) == 4
  assert answers[1]["tokens"] == 2 * 8 and all(a["s"] > 0 for a in answers[1:])
  assert all(0 < a["tokens"] <= 2 * 8 for a in answers[2:])


def test_bench_rounds_alternate_the_sides_and_remove_the_weights(tmp_path, monkeypatch):
  """``bench_tunix.alternate_sides`` (its rounds and ``bench_trl.py``'s): each side in its own
  process on the shared weights, the order swapped every round, results from the last line
  printed; the weights are gone afterwards, and after a side that fails too."""
  bench = _load("bench_tunix")
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the weights are written
  seen = []

  def command(side, weights, fail=None):
    seen.append((side, sorted(os.listdir(weights))))
    last = "raise SystemExit('no')" if side == fail else f"print(json.dumps({{'side': {side!r}}}))"
    return [sys.executable, "-c", f"import json; print('a log line'); {last}"]

  results = bench.alternate_sides(3, ("rljax", "peer"), 8, command)
  assert [side for side, _ in seen] == ["rljax", "peer", "peer", "rljax", "rljax", "peer"]
  assert all("config.json" in files for _, files in seen)
  assert results == {"rljax": [{"side": "rljax"}] * 3, "peer": [{"side": "peer"}] * 3}
  assert not os.listdir(tmp_path)
  with pytest.raises(RuntimeError, match="peer failed"):
    bench.alternate_sides(1, ("rljax", "peer"), 8, lambda s, w: command(s, w, fail="peer"))
  assert not os.listdir(tmp_path)


def test_bench_trim_times_the_cut_the_whole_budget_and_packed_rows_at_toy_size(tmp_path, monkeypatch):
  bench = _load("bench_trim")
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the script writes its weights
  out = bench.main(["--samples", "4", "--budget", "32", "--mean-length", "3", "--floor", "4",
                    "--pack-floor", "4", "--repeats", "1"])
  assert not os.listdir(tmp_path)  # the weights are removed when it ends
  rows = out["rows"]
  assert rows["whole budget"]["length"] == 32
  assert rows["cut"]["length"] == max(4, 1 << (out["longest"] - 1).bit_length()) < 32
  assert rows["cut, rows packed"]["length"] == rows["cut"]["length"]
  assert rows["cut, rows packed"]["rows"] < rows["cut"]["rows"] == 4
  assert max(out["max_abs_diff"].values()) < 1e-5
  assert all(r["median_s"] > 0 for r in rows.values())
