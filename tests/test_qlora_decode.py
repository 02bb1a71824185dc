"""The sampler's decode of a quantised (int4) base under FSDP: each layer's int4 values are
all-gathered inside the decode loop, where the layer runs, not before the loop for every
layer at once (``quant.gathered``), and the decode on 8 fake devices draws the tokens and
log-probs it draws on one. A bf16 LoRA base's decode gathers one layer's weights at a time
(``transformer._sharded_stacks``): its temporaries do not grow with the layers, and each
layer's response pool is written and read in the layout it is passed in (no copy)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import models, rollout, sharding
from rl_jax.models import quant
from rl_jax.models import transformer as tx
from rl_jax.rollout import records
from rl_jax.rollout import sampler as sampler_lib

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def _cfg(layers=2, hidden=64, inter=64, heads=4, kv_heads=2, head_dim=16, block=16, vocab=61,
         quant="int4", param_dtype="float32"):
  return models.ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                            num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                            head_dim=head_dim, architecture="qwen3", qk_norm=True,
                            lora_rank=2, lora_alpha=4.0, lora_targets=TARGETS, quant=quant,
                            quant_block=block, param_dtype=param_dtype,
                            max_position_embeddings=256)


def _params(cfg):
  """An int4 base with non-zero adapters (B != 0), as a QLoRA run samples with."""
  params = models.init_params(cfg, jax.random.key(0), std=0.2)
  base, ad = models.lora.split(params)
  ad = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(x.size), x.shape), ad)
  return models.lora.combine(base, ad)


def test_int4_decode_on_8_devices_equals_1():
  """FSDP over 8 fake devices (each layer's int4 values and scales gathered per layer in
  the loop) draws the same tokens as one device, with log-probs to 1e-5."""
  cfg = _cfg()
  params = _params(cfg)
  assert quant.is_quantized(params["layers"]["q"])
  prompts = [[(7 * i + j) % 60 + 1 for j in range(1 + i % 5)] for i in range(4)]
  kw = dict(n=2, max_new_tokens=12, eos_id=[3], seed=5, temperature=1.0, page_size=4)
  one = rollout.generate(cfg, params, prompts, **kw)
  eight = rollout.generate(cfg, params, prompts, mesh=sharding.make_mesh({"fsdp": 8}),
                           rules="fsdp", **kw)
  np.testing.assert_array_equal(eight.tokens, one.tokens)
  np.testing.assert_array_equal(eight.mask, one.mask)
  np.testing.assert_allclose(eight.logprobs, one.logprobs, atol=1e-5, rtol=0)
  assert one.mask.sum() > len(prompts) * 2  # more than one token per sample was decoded


def _split_at_the_loop(hlo: str) -> tuple[list[str], list[str]]:
  """(instructions outside the decode's ``while_loop``, instructions inside it) of a compiled
  program's text: the entry computation and what it calls except the loop's body and
  condition, and the body with what it calls (fusions, async collectives)."""
  comps, name, entry = {}, None, None
  for line in hlo.splitlines():
    m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if m:
      name = m.group(2)
      comps[name] = []
      entry = name if m.group(1) else entry
    elif name is not None:
      comps[name].append(line)
  loop = next(l for l in comps[entry] if " while(" in l)
  body = re.search(r"body=%?([\w.\-]+)", loop).group(1)
  cond = re.search(r"condition=%?([\w.\-]+)", loop).group(1)

  def reach(root: str, skip: set[str]) -> list[str]:
    seen, todo, out = set(), [root], []
    while todo:
      c = todo.pop()
      if c in seen or c in skip or c not in comps:
        continue
      seen.add(c)
      out += comps[c]
      for line in comps[c]:
        todo += re.findall(r"%([\w.\-]+)", " ".join(re.findall(
            r"(?:calls|to_apply|body|condition|branch_computations|called_computations)="
            r"(\{[^}]*\}|%[\w.\-]+)", line)))
    return out

  return reach(entry, {body, cond}), reach(body, set())


def _int4_gathers(lines: list[str]) -> set[str]:
  """The shapes of the int4 (s4) results of the all-gathers among ``lines``, without a
  leading axis of 1 (a layer's slice of its stack, ``transformer._reread_frozen``)."""
  return {re.sub(r"^1,", "", dims) for line in lines
          for dims in re.findall(r"= s4\[([\d,]*)\][^ =]* all-gather\(", line)}


def _compile_decode(cfg, topology_name: str, M=2, R=32, S=16, pages=None, live=None):
  """The sampler's decode of ``cfg`` (FSDP over the topology's chips) compiled for a TPU
  topology by XLA:TPU, from abstract parameters and state (4 slots of ``M`` samples, prefix
  16, response ``R`` in pages of ``S``, a pool of ``pages`` pages (None: every sample's whole
  budget), ``live`` pages read (None: all))."""
  from rl_jax.train import topology  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh(devices=topology.topology_devices(topology_name))
  ctx = (mesh, sharding.get_rules("fsdp"))
  shapes = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
  params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                        shapes, models.param_shardings(cfg, mesh, "fsdp"))
  G, P = 4, 16
  state = sampler_lib.init_state.lower(cfg, G, M, P, R, ctx, S=S, pages=pages)
  state = state.compile().out_info
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                       state)
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype, sharding=rep)
  sp = jax.tree.map(spec, records.sampling_params(cfg, 1.0, 0, 1.0, [3], None)[0])
  i32 = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
  return sampler_lib.decode.lower(cfg, params, state, sp, i32, i32, i32, i32, filtered=False,
                                  ctx=ctx, live=live).compile()


def test_int4_values_are_gathered_per_layer_inside_the_decode_loop():
  """The sampler's decode compiled for 4 v5e chips (FSDP, XLA:TPU): no int4 values are
  all-gathered before the ``while_loop``; each projection's are gathered in the loop body. When
  the gathered layout reached the per-layer slices made before the loop, every layer's
  gathered values were loop operands, held for the whole decode (Qwen3-32B int4 on
  v5e-8: 0.23 GiB per layer per chip)."""
  pytest.importorskip("libtpu", reason="compiling for a TPU topology needs libtpu")
  cfg = _cfg(layers=2, hidden=512, inter=1024, heads=4, kv_heads=2, head_dim=128, block=128,
             vocab=256)
  compiled = _compile_decode(cfg, "v5e:2x2")
  outside, inside = _split_at_the_loop(compiled.as_text())
  assert not _int4_gathers(outside)
  # each projection's values whole: q, o [512,4,128] (o laid out as [4,128,512]), k, v
  # [512,2,128], gate, up [512,1024], down [1024,512]
  assert _int4_gathers(inside) >= {"512,4,128", "4,128,512", "512,2,128", "512,1024",
                                   "1024,512"}, _int4_gathers(inside)


def test_bf16_decode_gathers_one_layer_at_a_time():
  """A bf16 LoRA base's decode compiled for 4 v5e chips (FSDP, XLA:TPU) at 2 and 4 layers:
  its temporaries grow by less than a quarter of one layer's gathered weights per layer
  (they fell from 2 to 4 layers when this was written). Each layer's all-gathers read slices
  made before the ``while_loop``, so nothing in the body ordered them after the layers
  before: XLA:TPU issued most layers' gathers at the top of the body and held their
  gathered weights at once, 0.87 of a layer's gathered weights more per layer here (Qwen3-32B
  on v5e-8: 0.78 GiB per layer); now each layer's sharded weights are re-read from their
  stacks once the layer's input exists (``transformer._sharded_stacks``)."""
  pytest.importorskip("libtpu", reason="compiling for a TPU topology needs libtpu")
  D, F, N, K, H = 2048, 16384, 16, 4, 128  # gathered MLP weights of 64 MiB: not in VMEM
  temp = {}
  for layers in (2, 4):
    cfg = _cfg(layers=layers, hidden=D, inter=F, heads=N, kv_heads=K, head_dim=H, vocab=256,
               quant="", param_dtype="bfloat16")
    temp[layers] = _compile_decode(cfg, "v5e:2x2").memory_analysis().temp_size_in_bytes
  layer = 2 * (3 * D * F + 2 * D * N * H + 2 * D * K * H)  # one layer's weights, bf16
  assert (temp[4] - temp[2]) / 2 < 0.25 * layer, (temp, layer)


def _relayouts(hlo: str, shapes: set[str]) -> list[str]:
  """The copies among a compiled program's instructions that change the layout of an array
  of one of ``shapes`` (e.g. "bf16[256,8,64,128]"), as "shape: from -> to"; copies that only
  move it between memory spaces (XLA:TPU's prefetches, ``S(n)`` in the layout) are not."""
  array = r"(\w+\[[\d,]*\])\{([^}]*)\}"
  layout = lambda text: re.sub(r"S\(\d+\)", "", text)
  defined, out = {}, []
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)", line)
    if not m:
      continue
    name, rest = m.groups()
    first = re.match(array, rest)
    if first:
      defined[name] = first.groups()
    copy = re.search(r" copy(-start)?\(%([\w.\-]+)\)", rest)
    if copy is None:
      continue
    if copy.group(1):  # copy-start: (destination, source, context)
      (dst_shape, dst), (_, src) = re.findall(array, rest)[:2]
    else:
      (dst_shape, dst), (_, src) = first.groups(), defined.get(copy.group(2), (None, None))
    if dst_shape in shapes and layout(dst) != layout(src or dst):
      out.append(f"{dst_shape}: {{{src}}} -> {{{dst}}}")
  return out


def _pool_decode(layers: int, K: int = 8, H: int = 128, S: int = 64, pages: int = 256):
  """The decode compiled for 4 v5e chips (FSDP, XLA:TPU; bf16, K kv heads of H, pages of S)
  at ``layers`` layers, and each chip's key and value pool shapes (a quarter of the pool:
  each chip holds the pages of its own slot's samples)."""
  cfg = _cfg(layers=layers, hidden=512, inter=512, heads=16, kv_heads=K, head_dim=H,
             vocab=256, quant="", param_dtype="bfloat16")
  cfg = dataclasses.replace(cfg, dtype="bfloat16")
  compiled = _compile_decode(cfg, "v5e:2x2", M=8, R=512, S=S, pages=pages, live=8)
  return compiled, {f"bf16[{pages // 4},{K},{H},{S}]", f"bf16[{pages // 4},{K},{S},{H}]"}


def test_decode_updates_each_layers_pool_in_place():
  """The decode compiled for 4 v5e chips (pages of 64, 8 kv heads of 128, bf16): no copy of
  a layer's response pool anywhere. XLA:TPU lays a key pool [Pg,K,H,S] out with H minor (S
  below the 128 lanes); the paged kernel read [H,S] pages and the token's K/V was scattered
  as [K,H] slabs, which wanted [Pg,S,K,H]: each layer's pool was carried by the loop in that
  layout, copied into it before the loop and copied into the kernel's in the body
  (temporaries 0.14 GiB more per layer for Qwen3-32B on v5e-8 with 256 pages). Now the
  kernel reads the key pages as [S,H] (``keys_by_row``) and the scatter writes one [H] row
  per kv head (``pages.write``): the pool stays in the layout it is passed in."""
  pytest.importorskip("libtpu", reason="compiling for a TPU topology needs libtpu")
  compiled, pool = _pool_decode(2)
  hlo = compiled.as_text()
  assert all(shape in hlo for shape in pool)
  copies = _relayouts(hlo, pool)
  assert not copies, copies[:2]


def test_the_decodes_temporaries_grow_by_less_than_a_quarter_pool_per_layer():
  """At 2 and 4 layers (``test_decode_updates_each_layers_pool_in_place``'s decode), the
  temporaries grow by less than a quarter of one layer's pool per layer, and neither copies
  a layer's pool."""
  pytest.importorskip("libtpu", reason="compiling for a TPU topology needs libtpu")
  temp = {}
  for layers in (2, 4):
    compiled, pool = _pool_decode(layers)
    assert not _relayouts(compiled.as_text(), pool)
    temp[layers] = compiled.memory_analysis().temp_size_in_bytes
  pool_bytes = 2 * 256 // 4 * 8 * 128 * 64 * 2  # one layer's keys and values per chip, bf16
  assert (temp[4] - temp[2]) / 2 < 0.25 * pool_bytes, (temp, pool_bytes)


def test_sharded_layer_weights_are_reread_in_the_decode_loop():
  """Under FSDP on 8 devices the decode's layer loop re-reads every projection from its stack
  (``transformer._reread_stacks``), of a LoRA tree and of its merged base (no adapters: what
  the sampler decodes with ``rollout.lora_merge``), and not the replicated norms; outside
  a mesh and on one device nothing (the CPU decode as it was)."""
  cfg = _cfg(quant="", param_dtype="bfloat16")
  params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
  for layers in (params["layers"], models.lora.strip(params)["layers"]):
    assert tx._reread_stacks(cfg, layers) is None
    with sharding.use(sharding.make_mesh({"fsdp": 1}, jax.devices()[:1]), "fsdp"):
      assert tx._reread_stacks(cfg, layers) is None
    with sharding.use(sharding.make_mesh({"fsdp": 8}), "fsdp"):
      stacks = tx._reread_stacks(cfg, layers)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(layers)[0]]
    reread = {p for p, a in zip(paths, stacks) if a is not None}
    assert {f"['{t}']" for t in TARGETS} <= reread, reread
    assert not {"['attn_norm']", "['mlp_norm']", "['q_norm']"} & reread, reread
