"""The streaming HF loader and writer (``rl_jax/models/hf.py``) against independent ones.

``_reference_load`` reads the same files with the ``safetensors`` library (whole tensors,
float32, stacked with ``np.stack`` and cast on the device): the loader rl_jax had before it
streamed. ``_reference_save`` writes ``hf_state_dict`` with ``safetensors.numpy.save_file``.
The streamed load must equal the reference bit for bit, the streamed export byte for byte.
"""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from rl_jax import models
from rl_jax.errors import ModelError
from rl_jax.models import hf as hf_mod
from rl_jax.models import quant
from tests.hf_utils import tiny_hf_model


# ----------------------------------------------------------------------------- references
def _reference_load(path, dtype):
  """(cfg, params) of ``path``: each tensor read whole by ``safe_open``, converted to float32,
  laid out by ``hf._to_ours``, stacked over layers with ``np.stack`` and cast to ``dtype``
  by ``jnp.asarray``."""
  cfg = models.read_hf_config(str(path), param_dtype=jnp.dtype(dtype).name,
                              dtype=jnp.dtype(dtype).name)
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    files = {k: os.path.join(path, v) for k, v in json.load(open(index))["weight_map"].items()}
  else:
    files = {}
    for f in sorted(os.listdir(path)):
      if f.endswith(".safetensors"):
        with safe_open(os.path.join(path, f), framework="flax") as h:
          files.update({k: os.path.join(path, f) for k in h.keys()})

  def get(name):
    with safe_open(files[name], framework="flax") as h:
      return np.asarray(h.get_tensor(name).astype(jnp.float32))

  put = lambda x: jnp.asarray(x, dtype)
  ours = lambda kind, w: hf_mod._to_ours(cfg, kind, w)  # pylint: disable=protected-access
  params = {"embed": put(get("model.embed_tokens.weight")),
            "final_norm": put(get("model.norm.weight"))}
  if not cfg.tie_word_embeddings:
    params["lm_head"] = put(get("lm_head.weight").T)
  shapes = models.param_shapes(cfg)
  layers = {}
  for key, suffix, kind in hf_mod._layer_map(cfg):  # pylint: disable=protected-access
    if key in shapes["layers"]:
      layers[key] = put(np.stack([ours(kind, get(f"model.layers.{i}.{suffix}"))
                                  for i in range(cfg.num_layers)]))
  params["layers"] = layers
  if cfg.is_moe:
    if cfg.dense_layers:
      params["mlp"] = {k: put(np.stack([get(f"model.layers.{i}.mlp.{k}_proj.weight").T
                                        for i in cfg.dense_layers]))
                       for k in ("gate", "up", "down")}
    moe = {"router": [], "expert_gate": [], "expert_up": [], "expert_down": []}
    for i in cfg.moe_layers:
      pre = f"model.layers.{i}.mlp."
      moe["router"].append(get(pre + "gate.weight").T)
      for key, proj in (("expert_gate", "gate"), ("expert_up", "up"), ("expert_down", "down")):
        moe[key].append(np.stack([get(f"{pre}experts.{e}.{proj}_proj.weight").T
                                  for e in range(cfg.num_experts)]))
    params["moe"] = {k: put(np.stack(v)) for k, v in moe.items()}
  return cfg, params


def _reference_save(cfg, params, path, max_shard_bytes):
  """The model files ``save_hf`` wrote before it streamed: ``hf_state_dict`` (float32 unless
  float16) through ``safetensors.numpy.save_file``, split into shards in its order."""
  tensors = {k: v.astype(np.float32) if v.dtype not in (np.float32, np.float16) else v
             for k, v in models.hf_state_dict(cfg, params).items()}
  os.makedirs(path)
  shards, cur, size = [], {}, 0
  for name, arr in tensors.items():
    if cur and size + arr.nbytes > max_shard_bytes:
      shards.append(cur)
      cur, size = {}, 0
    cur[name] = arr
    size += arr.nbytes
  shards.append(cur)
  if len(shards) == 1:
    save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
    weight_map.update({k: fname for k in shard})
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
               "weight_map": weight_map}, f, indent=2)


def _assert_bitwise_equal(got, want):
  got, want = jax.device_get(got), jax.device_get(want)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


# -------------------------------------------------------------------------- checkpoints
def _rewrite(path, dtype=None, shards=1, fuse_experts=False, seed=0):
  """Rewrites the checkpoint in ``path`` (tiny): every tensor random (so float32 values
  round when loaded as bfloat16), stored as ``dtype`` ("F32", "BF16", "F16"), in ``shards``
  files with an index json; ``fuse_experts``: MoE experts as the fused per-layer
  ``experts.gate_up_proj`` [E,2F,D] / ``experts.down_proj`` [E,D,F]."""
  rng = np.random.default_rng(seed)
  tensors = {}
  for f in sorted(os.listdir(path)):
    if f.endswith(".safetensors"):
      with safe_open(os.path.join(path, f), framework="numpy") as h:
        tensors.update({k: h.get_tensor(k) for k in h.keys()})
      os.remove(os.path.join(path, f))
  if os.path.exists(os.path.join(path, "model.safetensors.index.json")):
    os.remove(os.path.join(path, "model.safetensors.index.json"))
  tensors = {k: rng.standard_normal(v.shape).astype(np.float32) * 0.3 for k, v in tensors.items()}
  if fuse_experts:
    for pre in sorted({k.split("experts.")[0] for k in tensors if ".experts." in k}):
      E = len({k for k in tensors if k.startswith(pre + "experts.")}) // 3
      gate = np.stack([tensors.pop(f"{pre}experts.{e}.gate_proj.weight") for e in range(E)])
      up = np.stack([tensors.pop(f"{pre}experts.{e}.up_proj.weight") for e in range(E)])
      down = np.stack([tensors.pop(f"{pre}experts.{e}.down_proj.weight") for e in range(E)])
      tensors[pre + "experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
      tensors[pre + "experts.down_proj"] = down
  cast = {None: np.float32, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
  names = sorted(tensors)
  groups = [names[i::shards] for i in range(shards)]
  weight_map = {}
  for i, group in enumerate(groups):
    fname = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
    _save_any({k: tensors[k].astype(cast[dtype]) for k in group}, os.path.join(path, fname))
    weight_map.update({k: fname for k in group})
  if shards > 1:
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {}, "weight_map": weight_map}, f)
  return tensors


def _save_any(tensors, fname):
  """``save_file`` for float32 / float16 and, through flax, bfloat16."""
  if any(v.dtype == ml_dtypes.bfloat16 for v in tensors.values()):
    from safetensors.flax import save_file as save_flax  # pylint: disable=import-outside-toplevel
    save_flax({k: jnp.asarray(v) for k, v in tensors.items()}, fname)
  else:
    save_file(tensors, fname)


MOE = dict(vocab_size=29, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
           num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
           max_position_embeddings=64, tie_word_embeddings=True)
GEMMA = dict(vocab_size=31, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=3,
             layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64)


def _hf_model(kind, path, **kw):
  """A tiny HF checkpoint written by ``transformers`` (config.json and HF tensor names)."""
  if kind in ("qwen3_moe", "gemma3"):
    import transformers  # pylint: disable=import-outside-toplevel
    if kind == "gemma3":
      model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA))
    else:
      model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**MOE))
    model.save_pretrained(str(path))
    return
  tiny_hf_model(kind, path, **kw)


LOAD_CASES = [
    ("llama", {}, dict(dtype="F32"), jnp.bfloat16),  # untied, float32 rounded to bf16
    ("llama", dict(tied=True, attention_bias=True), dict(dtype="BF16"), jnp.float32),
    ("qwen2", {}, dict(dtype="F16", shards=3), jnp.bfloat16),  # biases, sharded + index
    ("qwen3", dict(tied=True), dict(dtype="BF16", shards=2), jnp.bfloat16),
    ("qwen3", {}, dict(dtype="F32"), jnp.float32),
    ("gemma3", {}, dict(dtype="F32"), jnp.bfloat16),
    ("qwen3_moe", {}, dict(dtype="BF16", shards=2), jnp.float32),
]


@pytest.mark.parametrize("kind,model_kw,ckpt,dtype", LOAD_CASES,
                         ids=[f"{c[0]}-{c[2]['dtype']}-{jnp.dtype(c[3]).name}-{i}"
                              for i, c in enumerate(LOAD_CASES)])
def test_load_matches_reference(tmp_path, kind, model_kw, ckpt, dtype):
  _hf_model(kind, tmp_path, **model_kw)
  _rewrite(tmp_path, **ckpt)
  cfg, params = models.load_hf(str(tmp_path), dtype=dtype)
  ref_cfg, ref = _reference_load(tmp_path, dtype)
  assert cfg == ref_cfg
  _assert_bitwise_equal(params, ref)


def test_fused_experts_equal_per_expert(tmp_path):
  """The fused MoE expert layout loads to the same arrays as the per-expert one."""
  _hf_model("qwen3_moe", tmp_path)
  _rewrite(tmp_path, dtype="F32", seed=3)
  _, per_expert = _reference_load(tmp_path, jnp.bfloat16)
  _rewrite(tmp_path, dtype="F32", seed=3, fuse_experts=True)
  names = json.dumps(sorted(safe_open(str(tmp_path / "model.safetensors"), "numpy").keys()))
  assert "experts.gate_up_proj" in names and "experts.0." not in names
  _, fused = models.load_hf(str(tmp_path), dtype=jnp.bfloat16)
  _assert_bitwise_equal(fused, per_expert)


def test_load_places_on_shardings(tmp_path):
  """With shardings (fsdp 4 x tensor 2) every array ends on its sharding, same values."""
  tiny_hf_model("qwen3", tmp_path, hidden=32, inter=64, heads=4, kv_heads=2, head_dim=8)
  cfg = models.read_hf_config(str(tmp_path), param_dtype="bfloat16", dtype="bfloat16")
  mesh = jax.make_mesh((1, 4, 1, 2), ("data", "fsdp", "sequence", "tensor"))
  shardings = models.param_shardings(cfg, mesh, "fsdp_tp")
  _, params = models.load_hf(str(tmp_path), dtype=jnp.bfloat16, shardings=shardings)
  jax.tree.map(lambda x, sh: (assert_same_sharding(x, sh)), params, shardings)
  _assert_bitwise_equal(params, _reference_load(tmp_path, jnp.bfloat16)[1])


def test_own_buffers_lets_a_donating_program_reuse_the_loaded_memory(tmp_path):
  """On CPU the loader's arrays adopt their host buffers, which a donating program cannot
  reuse (the first update would hold the weights twice); ``own_buffers`` copies them, leaf by
  leaf, into buffers it can, with the same values."""
  tiny_hf_model("qwen3", tmp_path, hidden=32, inter=64, heads=4, kv_heads=2, head_dim=8)
  double = jax.jit(lambda p: jax.tree.map(lambda x: x * 2, p), donate_argnums=0)
  pointers = lambda tree: [x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)]
  _, adopted = models.load_hf(str(tmp_path), dtype=jnp.float32)
  before = pointers(adopted)
  assert not set(pointers(double(adopted))) & set(before)
  _, params = models.load_hf(str(tmp_path), dtype=jnp.float32)
  owned = hf_mod.own_buffers(params)
  _assert_bitwise_equal(owned, _reference_load(tmp_path, jnp.float32)[1])
  before = pointers(owned)
  assert pointers(double(owned)) == before


def assert_same_sharding(x, sh):
  assert x.sharding == sh, (x.sharding, sh)


@pytest.mark.parametrize("q,block", [("int4", 8), ("int8", 16)])
def test_quantised_load_equals_whole_base_quantisation(tmp_path, q, block):
  """``load_hf(quant=...)`` (layer by layer as read) gives ``quantize_base`` of the float
  load, bit for bit on the values and scales, also when placed on a mesh."""
  tiny_hf_model("qwen3", tmp_path, hidden=32, inter=64, layers=3, heads=4, kv_heads=2,
                head_dim=16)
  _rewrite(tmp_path, dtype="BF16", seed=1)
  cfg, params = models.load_hf(str(tmp_path), dtype=jnp.bfloat16, quant=q, quant_block=block)
  float_cfg, base = models.load_hf(str(tmp_path), dtype=jnp.bfloat16)
  want = jax.jit(lambda p: quant.quantize_base(cfg, p))(base)
  assert float_cfg == cfg.replace(quant="", quant_block=float_cfg.quant_block)
  for t in quant.targets(cfg):
    assert quant.is_quantized(params["layers"][t])
  assert params["layers"]["gate"].qvalue.dtype == jnp.dtype(q)
  _assert_bitwise_equal(params, want)
  mesh = jax.make_mesh((1, 4, 1, 2), ("data", "fsdp", "sequence", "tensor"))
  shardings = models.param_shardings(cfg, mesh, "fsdp_tp")
  _, placed = models.load_hf(str(tmp_path), dtype=jnp.bfloat16, shardings=shardings, quant=q,
                             quant_block=block)
  jax.tree.map(assert_same_sharding, placed, shardings)
  _assert_bitwise_equal(placed, want)


def test_quantised_load_bad_block(tmp_path):
  tiny_hf_model("qwen3", tmp_path, hidden=32, inter=64, heads=4, kv_heads=2, head_dim=16)
  with pytest.raises(ModelError, match="quant_block"):
    models.load_hf(str(tmp_path), quant="int4", quant_block=7)


def test_quantize_layers_wrong_layer_count():
  cfg = models.ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_layers=2,
                           num_heads=2, num_kv_heads=1, head_dim=8, quant="int8",
                           quant_block=8)
  with pytest.raises(ValueError, match="1 layers"):
    quant.quantize_layers(cfg, "gate", [np.ones((16, 32), np.float32)])


# ------------------------------------------------------------------------------- export
SAVE_CASES = [
    ("qwen3", dict(tied=True), jnp.bfloat16, 4 << 30, 0),
    ("llama", {}, jnp.float32, 4 << 30, 0),
    ("llama", dict(attention_bias=True), jnp.bfloat16, 30_000, 0),  # sharded + index
    ("qwen3", {}, jnp.float16, 20_000, 4),  # LoRA adapters merged into the export
    ("qwen3_moe", {}, jnp.bfloat16, 4 << 30, 0),
    ("gemma3", {}, jnp.float32, 4 << 30, 0),
]


@pytest.mark.parametrize("kind,model_kw,dtype,shard,rank", SAVE_CASES,
                         ids=[f"{c[0]}-{jnp.dtype(c[2]).name}-{c[3]}-r{c[4]}" for c in SAVE_CASES])
def test_save_matches_reference_bytes(tmp_path, kind, model_kw, dtype, shard, rank):
  _hf_model(kind, tmp_path / "src", **model_kw)
  cfg, params = models.load_hf(str(tmp_path / "src"), dtype=dtype)
  if rank:
    cfg = cfg.replace(lora_rank=rank, lora_alpha=8.0, lora_targets=("q", "o", "gate", "down"))
    ad = models.lora.init_adapters(cfg, jax.random.key(0), "gaussian")
    ad = jax.tree.map(lambda x: x + 0.01 * jnp.ones_like(x), ad)  # B != 0: a real merge
    params = models.lora.combine(params, ad)
  out = models.save_hf(cfg, params, str(tmp_path / "new"), max_shard_bytes=shard)
  _reference_save(cfg, params, str(tmp_path / "ref"), shard)
  files = sorted(f for f in os.listdir(out) if f != "config.json")
  assert files == sorted(os.listdir(tmp_path / "ref"))
  assert (len(files) > 2) == (shard < 1 << 20)
  for f in files:
    assert (tmp_path / "new" / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f
  cfg_json = json.loads((tmp_path / "new" / "config.json").read_text())
  assert cfg_json["torch_dtype"] == ("float16" if dtype == jnp.float16 else "float32")


def test_safetensors_writer_mixed_dtypes(tmp_path):
  """Tensors of several dtypes lay out as safetensors' own writer lays them out."""
  rng = np.random.default_rng(0)
  tensors = {"b": rng.standard_normal((3, 5)).astype(np.float16),
             "a": rng.standard_normal((4,)).astype(np.float32),
             "c.x": rng.standard_normal((2, 2, 3)).astype(np.float64),
             "c": rng.standard_normal((7, 1)).astype(np.float32)}
  save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
  hf_mod._write_safetensors(  # pylint: disable=protected-access
      str(tmp_path / "new.safetensors"),
      [(k, v.shape, v.dtype, lambda v=v: v) for k, v in tensors.items()], {"format": "pt"})
  assert (tmp_path / "new.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_failed_export_keeps_the_old_one(tmp_path, monkeypatch):
  tiny_hf_model("qwen3", tmp_path / "src")
  cfg, params = models.load_hf(str(tmp_path / "src"))
  out = models.save_hf(cfg, params, str(tmp_path / "out"))
  before = {f: (tmp_path / "out" / f).read_bytes() for f in os.listdir(out)}

  def boom(*a, **k):
    raise OSError("disk full")

  monkeypatch.setattr(hf_mod, "_write_safetensors", boom)
  with pytest.raises(OSError, match="disk full"):
    models.save_hf(cfg, params, str(tmp_path / "out"))
  assert {f: (tmp_path / "out" / f).read_bytes() for f in os.listdir(out)} == before
  assert [f for f in os.listdir(tmp_path) if f.startswith(".tmp")] == []


def test_an_export_through_a_symlink_replaces_its_target(tmp_path):
  """``hf`` may be a link to a shared directory: the export lands there, the link stays (it
  was renamed aside before, and the shared directory never updated)."""
  tiny_hf_model("qwen3", tmp_path / "src")
  cfg, params = models.load_hf(str(tmp_path / "src"))
  (tmp_path / "shared").mkdir()
  (tmp_path / "shared" / "stale.txt").write_text("from an earlier export")
  os.symlink(tmp_path / "shared", tmp_path / "hf")
  models.save_hf(cfg, params, str(tmp_path / "hf"))
  assert os.path.islink(tmp_path / "hf") and not os.path.exists(tmp_path / "hf.old")
  assert "config.json" in os.listdir(tmp_path / "shared")
  assert "stale.txt" not in os.listdir(tmp_path / "shared")  # replaced whole, as ever
  _, again = models.load_hf(str(tmp_path / "hf"))
  jax.tree.map(np.testing.assert_array_equal, params, again)


# ------------------------------------------------------------------------ bad checkpoints
def _one_line(err):
  assert "\n" not in str(err.value)


def test_truncated_file(tmp_path):
  tiny_hf_model("qwen3", tmp_path)
  f = tmp_path / "model.safetensors"
  f.write_bytes(f.read_bytes()[:-100])
  with pytest.raises(ModelError, match="corrupt") as err:
    models.load_hf(str(tmp_path))
  _one_line(err)


def test_unreadable_dtype(tmp_path):
  tiny_hf_model("qwen3", tmp_path)
  f = tmp_path / "model.safetensors"
  data = f.read_bytes()
  n = int.from_bytes(data[:8], "little")
  header = data[8:8 + n].replace(b'"F32"', b'"C64"', 1)
  f.write_bytes(data[:8] + header + data[8 + n:])
  with pytest.raises(ModelError, match="dtype C64") as err:
    models.load_hf(str(tmp_path))
  _one_line(err)


def test_index_names_a_file_without_the_tensor(tmp_path):
  tiny_hf_model("qwen3", tmp_path)
  _rewrite(tmp_path, dtype="F32", shards=2)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  index["weight_map"]["model.norm.weight"] = [
      v for k, v in index["weight_map"].items() if v != index["weight_map"]["model.norm.weight"]][0]
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ModelError, match="lacks tensor 'model.norm.weight'") as err:
    models.load_hf(str(tmp_path))
  _one_line(err)


def test_bad_index_and_missing_shard(tmp_path):
  tiny_hf_model("qwen3", tmp_path)
  _rewrite(tmp_path, dtype="F32", shards=2)
  os.remove(tmp_path / "model-00002-of-00002.safetensors")
  with pytest.raises(ModelError, match="is missing"):
    models.load_hf(str(tmp_path))
  (tmp_path / "model.safetensors.index.json").write_text("[1, 2]")
  with pytest.raises(ModelError, match="not a valid safetensors index"):
    models.load_hf(str(tmp_path))


def test_release_host_memory_looks_up_libc_once(monkeypatch):
  """The learner trims the C heap before updates; the libc lookup (a subprocess) runs
  once."""
  import ctypes.util
  calls = []
  real = ctypes.util.find_library
  monkeypatch.setattr(ctypes.util, "find_library", lambda name: calls.append(name) or real(name))
  hf_mod._glibc_malloc_trim.cache_clear()
  try:
    results = [hf_mod.release_host_memory() for _ in range(3)]
  finally:
    hf_mod._glibc_malloc_trim.cache_clear()
  assert calls == ["c"]
  assert results == [results[0]] * 3 and results[0] == (hf_mod._glibc_malloc_trim() is not None)


def test_layer_tensors_the_model_type_has_no_place_for(tmp_path):
  """Qwen3 weights under config.json's ``"llama"`` would load without their q/k norms; a
  stale RoPE ``inv_freq`` buffer and tensors outside the layers are not weights and load."""
  tiny_hf_model("qwen3", tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
  with pytest.raises(ModelError, match="layer tensor.*no place for, e.g. 'model.layers.0.self_"
                     "attn.k_norm.weight'.*set model_type") as err:
    models.load_hf(str(tmp_path))
  _one_line(err)
  tiny_hf_model("llama", tmp_path)
  f = tmp_path / "model.safetensors"
  with safe_open(str(f), "np") as st:
    tensors = {k: st.get_tensor(k) for k in st.keys()}
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
  tensors["mtp.head.weight"] = np.ones((2, 2), np.float32)
  save_file(tensors, str(f))
  models.load_hf(str(tmp_path))
