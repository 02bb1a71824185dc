"""LoRA: the adapted forward against PEFT, the merged export, gradients of the adapters,
config errors, a trainer run that trains the adapters only and exports all three
directories, and adapter-only checkpoints."""

import functools
import json
import os
import shutil
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from rl_jax import checkpoint, config_utils, metrics, models, rollout, train
from rl_jax import config as config_lib
from rl_jax.errors import CheckpointError, ConfigError, ModelError
from rl_jax.train import resume
from tests.hf_utils import hf_logits, tiny_hf_model
from tests.tiny import QUICKSTART, TINY_MODEL

peft = pytest.importorskip("peft")


@functools.partial(jax.jit, static_argnums=0)
def _with_adapters(cfg, params):
  """``params`` with random non-zero adapters of ``cfg`` (B != 0, so they change the output)."""
  key = jax.random.key(1)
  ad = models.lora.init_adapters(cfg, key)
  ad = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.fold_in(key, x.size),
                                                           x.shape), ad)
  return models.lora.combine(params, ad)


@pytest.mark.parametrize("arch,targets", [("qwen2", "q,k,v,o,up,down")])  # biases; no gate
def test_adapters_match_peft_and_the_merged_export(tmp_path, arch, targets):
  """rl_jax's forward with unmerged adapters == PEFT's LoRA on the transformers model ==
  the merged ``save_hf`` export loaded by transformers."""
  base_dir, ad_dir, merged_dir = tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
  hf_model = tiny_hf_model(arch, base_dir, layers=2)
  cfg, base = models.load_hf(str(base_dir))
  cfg = cfg.replace(lora_rank=4, lora_alpha=8.0, lora_targets=models.lora.parse_targets(targets))
  params = _with_adapters(cfg, base)
  models.save_hf_adapter(cfg, params, str(ad_dir), base_model_name_or_path=str(base_dir))
  models.save_hf(cfg, params, str(merged_dir))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))

  ours = np.asarray(models.forward(cfg, params, jnp.asarray(tokens)))
  with_peft = hf_logits(peft.PeftModel.from_pretrained(hf_model, str(ad_dir)).eval(), tokens)
  merged = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(
      str(merged_dir), dtype=torch.float32).eval(), tokens)
  base_logits = np.asarray(models.forward(cfg.replace(lora_rank=0), base, jnp.asarray(tokens)))
  assert np.abs(ours - base_logits).max() > 1e-2  # the adapters matter
  np.testing.assert_allclose(ours, with_peft, atol=1e-4)
  np.testing.assert_allclose(merged, with_peft, atol=1e-4)
  config = json.loads((ad_dir / "adapter_config.json").read_text())
  assert config["r"] == 4 and config["lora_alpha"] == 8.0
  loaded = models.load_hf_adapter(cfg, str(ad_dir), str(base_dir))  # the export's inverse
  jax.tree.map(np.testing.assert_array_equal, loaded, jax.device_get(params["layers"]["lora"]))
  assert "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight" in load_file(
      str(ad_dir / "adapter_model.safetensors"))


def _tiny_lora_cfg():
  return models.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2,
                            num_heads=2, num_kv_heads=1, head_dim=8, lora_rank=2,
                            lora_alpha=4.0, lora_targets=models.lora.LORA_TARGETS)


def test_fresh_adapters_leave_the_model_unchanged_and_gradients_match_finite_differences():
  """B = 0 at init: the same logits bit for bit as the base; the adapter gradient of a
  scalar of the logits equals a central finite difference along a random direction."""
  cfg = _tiny_lora_cfg()
  tokens = jnp.asarray([[1, 5, 7, 2, 9]])

  @jax.jit
  def check(key):
    params = models.init_params(cfg, key)
    base, _ = models.lora.split(params)
    fresh = models.forward(cfg, params, tokens)
    plain = models.forward(cfg.replace(lora_rank=0), base, tokens)
    merged = jax.tree.map(jnp.array_equal, models.lora.merge(cfg, params), base)
    ad = _with_adapters(cfg, params)["layers"]["lora"]
    f = lambda a: jnp.sum(jnp.sin(models.forward(cfg, models.lora.combine(base, a), tokens)))
    leaves, tree = jax.tree.flatten(ad)
    keys = jax.random.split(jax.random.fold_in(key, 7), len(leaves))
    d = [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
    norm = jnp.sqrt(sum(jnp.sum(x * x) for x in d))
    direction = jax.tree.unflatten(tree, [x / norm for x in d])  # a unit direction
    eps = 1e-3
    shift = lambda sign: jax.tree.map(lambda x, d: x + sign * eps * d, ad, direction)
    fd = (f(shift(1.0)) - f(shift(-1.0))) / (2 * eps)
    grad = jax.grad(f)(ad)
    analytic = sum(jnp.sum(g * d) for g, d in zip(jax.tree.leaves(grad),
                                                   jax.tree.leaves(direction)))
    return fresh, plain, merged, analytic, fd

  fresh, plain, merged, analytic, fd = check(jax.random.key(0))
  np.testing.assert_array_equal(fresh, plain)
  assert all(jax.tree.leaves(merged))
  assert abs(float(analytic)) > 0.1
  np.testing.assert_allclose(float(analytic), float(fd), rtol=1e-3)


def test_sampler_decodes_unmerged_adapters_like_merged_weights():
  """``rollout.generate`` with the base and its adapters == with the merged weights."""
  cfg = _tiny_lora_cfg()
  params = _with_adapters(cfg, jax.jit(models.init_params, static_argnums=0)(
      cfg, jax.random.key(0)))
  merged = jax.jit(models.lora.merge, static_argnums=0)(cfg, params)
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
  run = lambda p: rollout.generate(cfg, p, prompts, n=1, max_new_tokens=4, temperature=1.0,
                                   seed=3)
  a, b = run(params), run(merged)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_adapters_are_laid_out_like_their_weights():
  """A keeps W's input axes, B its output axes; the rank axis is never sharded."""
  axes = models.param_axes(_tiny_lora_cfg())["layers"]["lora"]
  assert axes["q"] == {"a": ("layers", "embed", "lora_rank"),
                       "b": ("layers", "lora_rank", "q_heads", "head_dim")}
  assert axes["down"] == {"a": ("layers", "mlp", "lora_rank"), "b": ("layers", "lora_rank",
                                                                     "embed")}
  shapes = models.param_shapes(_tiny_lora_cfg())["layers"]["lora"]
  assert shapes["o"] == {"a": (2, 2, 8, 2), "b": (2, 2, 16)}


@pytest.mark.parametrize("override,message", [
    ("model.lora.targets=q,x", "config.model.lora.targets must be distinct names"),
    ("model.lora.targets=q,q", "config.model.lora.targets must be distinct names"),
    ("model.lora.rank=-1", "config.model.lora.rank must be"),
    ("model.lora.init=ones", "config.model.lora.init must be one of"),
    ("train.offload=reference", "train.offload=reference: with model.lora.rank > 0"),
    ("loss.preset=ppo", r"model.lora.rank=4: loss.preset='ppo' needs a value model, which LoRA "
                        r"does not support \(the critic has no adapters\)"),
    # rank 0 is "off": a LoRA setting beside it would be silently ignored
    ("model.lora.rank=0,model.lora.targets=q,v",
     r"model.lora.targets='q,v' needs model.lora.rank > 0: model.lora.rank=0, so LoRA is off"),
    ("model.lora.rank=0,model.lora.alpha=8.0", r"model.lora.alpha=8.0 needs model.lora.rank > 0"),
    ("model.lora.rank=0,model.lora.adapter_path=/tmp/x",
     r"model.lora.adapter_path='/tmp/x' needs model.lora.rank > 0"),
])
def test_bad_lora_config_fails_in_one_line(override, message):
  overrides = override.split(",model.") if ",model." in override else [override]
  overrides = [o if o.startswith("model.") or i == 0 else "model." + o
               for i, o in enumerate(overrides)]
  config = config_utils.load_config(QUICKSTART, overrides + ["model.lora.rank=4"]
                                    if "rank" not in override else overrides)
  with pytest.raises(ConfigError, match=message) as err:
    train.build_setup(config)
  assert "\n" not in str(err.value)


def test_lora_on_a_random_base_that_is_likely_to_stall_gets_one_note():
  """The quickstart at rank 8 (a frozen random LM head of std 0.02) stalls; the note says what
  to change. ``configs/quickstart.py:lora`` (std 0.1) and a checkpoint base get none."""
  (note,) = config_lib.notices(config_utils.load_config(QUICKSTART, ["model.lora.rank=8"]))
  assert note.startswith("note: model.lora.rank=8") and "\n" not in note
  assert "model.init_std to 0.1" in note
  assert not config_lib.notices(config_utils.load_config(QUICKSTART + ":lora"))
  assert not config_lib.notices(config_utils.load_config(QUICKSTART))


def test_moe_mlp_adapters_are_rejected():
  with pytest.raises(ModelError, match="attention projections of mixture-of-experts"):
    models.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=8, architecture="qwen3_moe",
                       num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
                       sparse_layers=(True,), qk_norm=True, lora_rank=2,
                       lora_targets=("q", "up"))


# ------------------------------------------------------------------------- PEFT adapters in
PEFT_TARGETS = "q,k,o,up,down"  # heads in (q, k), heads out (o), both MLP layouts
PEFT_MODULES = ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"]


def _peft_adapter(base_dir, ad_dir, *, hidden=32, r=4, alpha=8, seed=0):
  """A tiny qwen3 base at ``base_dir`` (the char tokenizer's 99 tokens fit) and a random PEFT
  LoRA of it (A and B non-zero) saved at ``ad_dir``; returns the PEFT model."""
  tiny_hf_model("qwen3", base_dir, vocab=100, hidden=hidden, inter=64, layers=2, heads=2,
                kv_heads=1, head_dim=16, max_pos=64, seed=seed)
  base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
  torch.manual_seed(seed + 1)
  model = peft.get_peft_model(base, peft.LoraConfig(
      r=r, lora_alpha=alpha, target_modules=PEFT_MODULES, init_lora_weights=False))
  with torch.no_grad():  # B of the order of W, so the adapters change the logits
    for name, p in model.named_parameters():
      if "lora_" in name:
        p.copy_(0.3 * torch.randn_like(p))
  model.save_pretrained(str(ad_dir))
  return model.eval()


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory):
  root = tmp_path_factory.mktemp("peft")
  model = _peft_adapter(root / "base", root / "adapter")
  _peft_adapter(root / "other_base", root / "other_adapter", hidden=48, seed=3)
  return root, model


def _adapter_config(root, *extra):
  return config_utils.load_config(QUICKSTART, [
      "data.tokenizer=char", f"model.hf_path={root / 'base'}", "model.lora.rank=4",
      "model.lora.alpha=8", f"model.lora.targets={PEFT_TARGETS}", "sft.steps=0",
      f"model.lora.adapter_path={root / 'adapter'}", "mesh.num_devices=1", *extra])


def test_peft_adapter_loads_as_the_runs_adapters(peft_adapter):
  """``model.lora.adapter_path``: the run starts from the PEFT adapter, so rl_jax's logits
  equal PEFT's on the transformers base (and differ from the base's)."""
  root, model = peft_adapter
  s = train.build_setup(_adapter_config(root))
  params = jax.device_get(train.init_state(s).params)
  tokens = np.random.default_rng(0).integers(0, s.model_cfg.vocab_size, (2, 11))
  ours = np.asarray(models.forward(s.model_cfg, params, jnp.asarray(tokens)))
  base = np.asarray(models.forward(s.model_cfg.replace(lora_rank=0, lora_targets=()),
                                   models.lora.strip(params), jnp.asarray(tokens)))
  assert np.abs(ours - base).max() > 1e-1  # the loaded adapters matter
  np.testing.assert_allclose(ours, hf_logits(model, tokens), atol=1e-4)
  assert set(models.lora.split(params)[1]) == {"q", "k", "o", "up", "down"}


@pytest.mark.parametrize("overrides,message", [
    (["model.lora.rank=8"], r"adapter_config.json r=4 but model.lora.rank=8; set "
                            r"model.lora.rank=4$"),
    (["model.lora.alpha=16"], r"adapter_config.json lora_alpha=8 but model.lora.alpha=16"),
    (["model.lora.targets=q,v"], r"adapter_config.json target_modules=.* \(targets "
                                 r"q,k,o,up,down\) but model.lora.targets=q,v"),
    (["adapter=other_adapter"], r"tensor 'base_model.model.model.layers.0.mlp.down_proj."
                                r"lora_B.weight' has shape \(48, 4\) but the base's weights "
                                r"and r=4 imply \(32, 4\) \(an adapter for another base\)"),
    (["adapter=renamed"], r"base_model_name_or_path='Qwen/Qwen3-0.6B' does not name "
                          r"model.hf_path="),
    (["adapter=missing"], r"model.lora.adapter_path=.*missing: adapter directory .* does not "
                          r"exist"),
])
def test_mismatched_peft_adapter_fails_in_one_line(peft_adapter, overrides, message):
  """An adapter of another rank, alpha, targets or base fails in ``build_setup`` (before
  anything is compiled), one line naming the field."""
  root, _ = peft_adapter
  extra = [o for o in overrides if not o.startswith("adapter=")]
  which = [o.split("=")[1] for o in overrides if o.startswith("adapter=")]
  if which == ["renamed"] and not (root / "renamed").exists():
    shutil.copytree(root / "adapter", root / "renamed")
    path = root / "renamed" / "adapter_config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps({**cfg, "base_model_name_or_path": "Qwen/Qwen3-0.6B"}))
  if which:
    extra.append(f"model.lora.adapter_path={root / which[0]}")
  with pytest.raises(ConfigError, match=message) as err:
    train.build_setup(_adapter_config(root, *extra))
  assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------ the trainer
LORA_RUN = TINY_MODEL + [
    "sft.steps=1", "sft.batch_size=8", "train.steps=1", "train.batch_groups=4", "rollout.n=4",
    "train.eval_every=0", "train.checkpoint_every=0", "log.tensorboard=False",
    "model.lora.rank=4", "loss.kl_beta=0.05", "optim.lr=1e-2"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  """A supervised + RL run with LoRA (KL to the base), its setup, and states along the way."""
  workdir = str(tmp_path_factory.mktemp("lora_run"))
  config = config_utils.load_config(QUICKSTART, LORA_RUN)
  state = train.train(config, workdir, progress=False)
  return workdir, train.build_setup(config), state


def test_lora_run_trains_adapters_only_and_exports_peft(lora_run):
  """The optimizer state has the adapters' shapes only, no reference copy exists, and the
  three exports agree: PEFT(hf_base + hf_adapter) == hf (merged) == rl_jax's forward."""
  workdir, s, state = lora_run
  _, adapters = models.lora.split(state.params)
  shapes = {x.shape for x in jax.tree.leaves(adapters)}
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert moments and all(x.shape in shapes for x in moments)
  assert not jax.tree.leaves(state.ref_params)
  b = jax.tree.leaves(adapters["q"]["b"])[0]
  assert float(jnp.abs(b).max()) > 0  # RL moved the adapters
  plan = json.loads(open(os.path.join(workdir, "memory_plan.json")).read())["state"]["rl"]
  assert plan["adapters"] > 0  # Adam's μ and ν of the adapters (and an int32 count):
  assert 2 * plan["adapters"] <= plan["rl_optimizer"] < 2 * plan["adapters"] + 64
  assert plan["sampler_copy"] > 0 and plan["reference"] == 0  # merged for the sampler; no copy

  config = json.loads(open(os.path.join(workdir, "hf_adapter", "adapter_config.json")).read())
  assert config["base_model_name_or_path"] == os.path.join(workdir, "hf_base")
  base_model = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.join(workdir, "hf_base"), dtype=torch.float32).eval()
  with_peft = peft.PeftModel.from_pretrained(base_model, os.path.join(workdir, "hf_adapter"))
  merged = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.join(workdir, "hf"), dtype=torch.float32).eval()
  tokens = np.random.default_rng(0).integers(0, s.model_cfg.vocab_size, (2, 12))
  ours = np.asarray(models.forward(s.model_cfg, jax.device_get(state.params), tokens))
  np.testing.assert_allclose(hf_logits(with_peft.eval(), tokens), ours, atol=1e-4)
  np.testing.assert_allclose(hf_logits(merged, tokens), ours, atol=1e-4)
  # each export readable as the workdir's other files are (the umask's modes, not 0700/0600)
  mask = os.umask(0)
  os.umask(mask)
  for name in ("hf", "hf_adapter", "hf_base"):
    root = os.path.join(workdir, name)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o777 & ~mask, name
    for f in os.listdir(root):
      assert stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode) == 0o666 & ~mask, (name, f)


def test_every_export_serves_with_its_tokenizer(lora_run):
  """hf/, hf_base/ and hf_adapter/ each carry the run's tokenizer; what ``rl_jax.serve``
  loads from the adapter directory (its base with the adapters merged) has hf/'s logits."""
  from rl_jax.serve.checkpoint import load_served  # pylint: disable=import-outside-toplevel
  workdir, s, _ = lora_run
  for d in ("hf", "hf_base", "hf_adapter"):
    assert os.path.exists(os.path.join(workdir, d, "rl_jax_tokenizer.json")), d
  merged = load_served(os.path.join(workdir, "hf"))
  adapter = load_served(os.path.join(workdir, "hf_adapter"))
  assert adapter.chat.name == "builtin" and adapter.parser == "compact"
  tokens = np.random.default_rng(1).integers(0, s.model_cfg.vocab_size, (2, 12))
  np.testing.assert_allclose(np.asarray(models.forward(adapter.cfg, adapter.params, tokens)),
                             np.asarray(models.forward(merged.cfg, merged.params, tokens)),
                             atol=1e-5)


def test_rl_steps_leave_the_base_frozen(lora_run):
  """One more RL step from the finished state changes the adapters and nothing of the base
  (the supervised adapters were merged into it when RL began)."""
  _, s, state = lora_run
  t = train.make_trainer(s)
  before = jax.device_get(state.params)
  state, record, _ = train.rl_step(t, state)
  after = jax.device_get(state.params)
  base0, ad0 = models.lora.split(before)
  base1, ad1 = models.lora.split(after)
  for x, y in zip(jax.tree.leaves(base0), jax.tree.leaves(base1)):
    np.testing.assert_array_equal(x, y)
  assert any(np.any(x != y) for x, y in zip(jax.tree.leaves(ad0), jax.tree.leaves(ad1)))
  assert np.isfinite(record["kl"])


# ------------------------------------------------------------------------------ checkpoints
def test_checkpoints_without_warm_start_hold_adapters_and_rebuild_the_base(tmp_path):
  """``sft.steps=0``: the base is the config's, so no checkpoint holds it and nothing is
  written besides (``lora_checkpoint``, source ``config``); restore rebuilds it bit for bit,
  and a config that builds another base fails in one line."""
  overrides = TINY_MODEL + [
      "sft.steps=0", "train.steps=2", "train.batch_groups=4", "rollout.n=4",
      "train.eval_every=0", "train.checkpoint_every=1", "log.tensorboard=False",
      "model.lora.rank=4", "model.lora.targets=q,v", "optim.lr=1e-2"]
  config = config_utils.load_config(QUICKSTART, overrides)
  final = train.train(config, str(tmp_path), progress=False)
  ckpts = str(tmp_path / "checkpoints")
  assert checkpoint.all_steps(ckpts) == [1, 2]
  assert not (tmp_path / "checkpoints" / "base").exists()
  assert checkpoint.read_metadata(ckpts, 2)["lora_base"]["source"] == "config"
  assert {p.split("/")[2] for p in checkpoint.saved_leaves(ckpts, 2)
          if p.startswith("params/")} == {"lora"}
  s = train.build_setup(config)
  with checkpoint.Checkpointer(ckpts) as ckpt:
    state = resume.restore_state(s, ckpt, 2, train.abstract_state(s, 2))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params),
               jax.device_get(final.params))
  other = train.build_setup(config_utils.load_config(QUICKSTART, overrides + [
      "model.init_std=0.05"]))
  with checkpoint.Checkpointer(ckpts) as ckpt:
    with pytest.raises(CheckpointError, match="frozen LoRA base the config builds") as err:
      resume.restore_state(other, ckpt, 2, train.abstract_state(other, 2))
  assert "\n" not in str(err.value)


# ------------------------------------------------------------- async, APRIL and the dry run
def test_async_partial_rollouts_train_the_adapters_only_and_dry_run_plans_them(tmp_path,
                                                                              capsys):
  """``train.mode=async`` (one step off) with APRIL partial rollouts: groups are aborted
  and held across steps, the base stays bit for bit the config's (``sft.steps=0``) while
  the adapters train (the optimizer holds their moments only), and every RL row has a
  finite loss.
  ``train.dry_run`` of the same config prints the plan with the adapters apart from the
  base (the optimizer holds the adapters' moments only) and trains nothing."""
  # 4 groups of 2 in flight for 1 (the untrained policy ends ~1 response in 3 before 40
  # tokens, so the first group to complete leaves the others aborted and held); the entropy
  # bonus moves the adapters whatever the rewards
  overrides = TINY_MODEL + [
      "mesh.num_devices=1", "sft.steps=0", "train.steps=3", "train.batch_groups=1",
      "rollout.n=2", "rollout.max_new_tokens=40", "rollout.over_sampling=4",
      "rollout.max_staleness=3", "train.eval_every=0", "train.checkpoint_every=0",
      "log.tensorboard=False", "model.lora.rank=4", "optim.lr=1e-2", "loss.entropy_coef=0.01",
      "train.mode=async", "train.async_lag=1", "rollout.partial=True"]
  config = config_utils.load_config(QUICKSTART, overrides)
  state = train.train(config, str(tmp_path / "run"), progress=False)
  s = train.build_setup(config)  # after the run: its programs are compiled by then
  base0 = jax.device_get(models.lora.split(train.init_state(s).params)[0])
  base1, adapters = jax.device_get(models.lora.split(state.params))
  jax.tree.map(np.testing.assert_array_equal, base1, base0)
  assert all(np.abs(ad["b"]).max() > 0 for ad in adapters.values())  # B starts at 0
  shapes = {x.shape for x in jax.tree.leaves(adapters)}
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert moments and all(x.shape in shapes for x in moments)
  rows = [r for r in metrics.read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
          if r["phase"] == "rl"]
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert all(np.isfinite(r["loss"]) for r in rows)
  assert any(r["aborted_groups"] > 0 for r in rows), "no group held; APRIL not exercised"
  capsys.readouterr()

  dry = tmp_path / "dry"
  assert train.train(config_utils.load_config(QUICKSTART, overrides + ["train.dry_run=True"]),
                     str(dry), progress=False) is None
  out = capsys.readouterr().out
  assert "memory plan:" in out and "adapters" in out and "step rl_update" in out
  plan = json.loads((dry / "memory_plan.json").read_text())["state"]["rl"]
  assert plan["adapters"] > 0 and plan["policy"] > plan["adapters"]  # base counted apart
  assert 2 * plan["adapters"] <= plan["rl_optimizer"] < 2 * plan["adapters"] + 64
  assert not (dry / "metrics.jsonl").exists() and not (dry / "checkpoints" / "1").exists()


# ------------------------------------------------------------ the checkpoint's base fingerprint
def _numpy_bits(a: np.ndarray) -> int:
  """Σ bits(a_i)·(2i + 1) mod 2³² over a's row-major positions, in numpy (uint64 products)."""
  if a.dtype == jnp.bfloat16:
    u = a.view(np.uint16).astype(np.uint64)
  elif a.dtype == np.float32:
    u = a.view(np.uint32).astype(np.uint64)
  else:  # integers: their two's complement bits as uint32
    u = (a.astype(np.int64) & 0xFFFFFFFF).astype(np.uint64)
  i = np.arange(a.size, dtype=np.uint64).reshape(a.shape)
  return int((u * (2 * i + 1) % (1 << 32)).sum() % (1 << 32))


def test_base_fingerprint_hashes_leaves_row_by_row_with_the_same_values():
  """The base fingerprint's per-leaf hash equals Σ bits·(2i + 1) mod 2³² computed in numpy
  (every dtype a base holds, stacked and not), also on 8 devices, and its program holds one
  row of a stacked leaf in temporaries, not a uint32 array of every leaf."""
  from rl_jax import sharding  # pylint: disable=import-outside-toplevel
  from rl_jax.train import lora_checkpoint  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  leaves = [np.asarray(rng.normal(size=(4, 6, 8)), jnp.bfloat16),
            np.asarray(rng.normal(size=(8, 16)), np.float32),
            np.asarray(rng.integers(-8, 8, (8, 8, 16)), jnp.int4),
            np.asarray(rng.integers(-128, 128, (3, 8)), np.int8),
            np.asarray(rng.normal(size=(1, 8)), jnp.bfloat16),
            np.asarray(rng.normal(size=(16,)), np.float32), np.float32(-1.5)]
  want = [_numpy_bits(np.asarray(a, np.int8) if a.dtype == jnp.int4 else np.asarray(a))
          for a in leaves]
  assert [int(v) for v in lora_checkpoint._hashes([jnp.asarray(a) for a in leaves])] == want
  mesh = sharding.make_mesh({"fsdp": 8})  # the trainer's meshes (axes of type Auto)
  sharded = [jax.device_put(a, jax.NamedSharding(mesh, jax.P("fsdp") if np.ndim(a) and
                                                 np.shape(a)[0] % 8 == 0 else jax.P()))
             for a in leaves]
  assert [int(v) for v in lora_checkpoint._hashes(sharded)] == want
  stacked = [jax.ShapeDtypeStruct((16, 256, 256), dt)
             for dt in (jnp.bfloat16, jnp.float32, jnp.int4, jnp.int8)] * 2
  temp = lora_checkpoint._hashes.lower(stacked).compile().memory_analysis().temp_size_in_bytes
  row = 256 * 256 * 4  # one row as uint32
  assert temp <= 2 * row, temp  # the whole-leaf sums held 16 rows per leaf, 8 leaves at once


def test_sampler_merge_weight_by_weight_equals_one_merge_program():
  """The trainer's merged sampler weights (``rollout.lora_merge``: one program per adapted
  weight) equal ``models.lora.merge`` in one program, bit for bit and laid out the same, on
  an 8-device FSDP mesh with trained-looking (non-zero) adapters."""
  config = config_utils.load_config(QUICKSTART + ":lora", TINY_MODEL + [
      "model.lora.targets=q,k,v,o,gate,up,down", "mesh.num_devices=8", "mesh.rules=fsdp"])
  setup = train.build_setup(config)
  layout = train.make_layout(setup)
  params = jax.tree.map(
      lambda x, sh: jax.device_put(
          jax.random.normal(jax.random.key(x.size), x.shape, jnp.float32).astype(x.dtype), sh),
      train.abstract_state(setup).params, layout.state.params)
  base_sh, _ = models.lora.split(layout.state.params)
  want = jax.jit(functools.partial(models.lora.merge, setup.model_cfg),
                 out_shardings=base_sh)(params)
  got = layout.sampler_weights(params)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("extra,base,adapters", [
    ([], jnp.bfloat16, jnp.float32),  # the frozen base in the compute dtype
    (["model.lora.base_dtype=float32"], jnp.float32, jnp.float32),  # asked otherwise
    (["model.param_dtype=bfloat16"], jnp.bfloat16, jnp.bfloat16),
])
def test_a_lora_base_is_stored_in_the_compute_dtype_unless_asked(extra, base, adapters):
  """With bf16 compute a LoRA run keeps its frozen base in bf16 (it is never updated: no
  float32 master copy) and its adapters in ``model.param_dtype`` (float32 by default), in the
  fresh state, its restore target and the KL reference alike; a model trained whole keeps
  ``model.param_dtype``."""
  config = config_utils.load_config(QUICKSTART + ":lora", TINY_MODEL + [
      "model.dtype=bfloat16", "loss.kl_beta=0.01"] + extra)
  s = train.build_setup(config)
  for params in (train.state.init_params(s), train.abstract_state(s).params):
    frozen, trained = models.lora.split(params)
    assert {x.dtype for x in jax.tree.leaves(frozen)} == {jnp.dtype(base)}
    assert {x.dtype for x in jax.tree.leaves(trained)} == {jnp.dtype(adapters)}
  whole = train.build_setup(config_utils.load_config(QUICKSTART, TINY_MODEL + [
      "model.dtype=bfloat16"]))
  assert {x.dtype for x in jax.tree.leaves(train.abstract_state(whole).params)} == {
      jnp.dtype(jnp.float32)}
  with pytest.raises(ConfigError, match="model.lora.base_dtype='float32' needs model.lora.rank"):
    train.build_setup(config_utils.load_config(QUICKSTART, ["model.lora.base_dtype=float32"]))
