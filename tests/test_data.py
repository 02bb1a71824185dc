"""Tokenizers and synthetic tasks (rl_jax.data.tokenizers, rl_jax.data.tasks)."""

import json

import hypothesis
import hypothesis.strategies as st
import pytest

from rl_jax.data import tasks, tokenizers


# ------------------------------------------------------------------ char tokenizer
def test_char_ids_are_fixed_and_roundtrip():
  tok = tokenizers.load_tokenizer("char")
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.encode("0") == [3]
  assert tok.vocab_size == 3 + len(tokenizers.CHARS)
  text = tokenizers.CHARS
  ids = tok.encode(text, add_bos=True, add_eos=True)
  assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
  assert len(set(ids[1:-1])) == len(text)
  assert tok.decode(ids) == text


def test_char_decode_stops_at_eos_and_skips_pad():
  tok = tokenizers.CharTokenizer()
  ids = tok.encode("12") + [tok.pad_id] + tok.encode("3") + [tok.eos_id] + tok.encode("99")
  assert tok.decode(ids) == "123"


def test_char_errors():
  tok = tokenizers.CharTokenizer()
  with pytest.raises(ValueError, match="'é' at position 2"):
    tok.encode("ab\u00e9")
  with pytest.raises(ValueError, match="outside"):
    tok.decode([tok.vocab_size])


# ------------------------------------------------------------------ HF tokenizer wrapper
def _write_hf_tokenizer(path, config=None, extra=None):
  import tokenizers as hf

  vocab = {"[PAD]": 0, "<|endoftext|>": 1, "[UNK]": 2, "hello": 3, "world": 4}
  tok = hf.Tokenizer(hf.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = hf.pre_tokenizers.Whitespace()
  tok.decoder = hf.decoders.WordPiece()
  tok.add_special_tokens(["[PAD]", "<|endoftext|>"])
  path.mkdir(exist_ok=True)
  tok.save(str(path / "tokenizer.json"))
  if config is not None:
    (path / "tokenizer_config.json").write_text(json.dumps(config))
  for name, content in (extra or {}).items():
    (path / name).write_text(json.dumps(content))
  return str(path)


def test_hf_tokenizer_special_ids_from_config(tmp_path):
  d = _write_hf_tokenizer(tmp_path / "m", {"eos_token": "<|endoftext|>",
                                           "pad_token": {"content": "[PAD]"}})
  tok = tokenizers.load_tokenizer(d)
  assert isinstance(tok, tokenizers.HFTokenizer)
  assert (tok.eos_id, tok.pad_id, tok.bos_id, tok.vocab_size) == (1, 0, None, 5)
  ids = tok.encode("hello world")
  assert ids == [3, 4]
  assert tok.decode([3, 0, 4, 1, 3]) == "hello world"


def test_hf_tokenizer_eos_fallbacks(tmp_path):
  d = _write_hf_tokenizer(tmp_path / "a", None, {"config.json": {"eos_token_id": 4}})
  tok = tokenizers.HFTokenizer(d)
  assert tok.eos_id == 4 and tok.pad_id == 4
  d = _write_hf_tokenizer(tmp_path / "b")
  assert tokenizers.HFTokenizer(d).eos_id == 1  # "<|endoftext|>" found in the vocabulary


@pytest.mark.parametrize("flag,post,want", [
    (True, False, True),     # add_bos_token (Gemma, Llama 2)
    (False, True, False),    # the flag wins over the post-processor
    (None, True, True),      # no flag: the post-processor prepends it (Llama 3)
    (None, False, False),
])
def test_prompts_start_with_bos_where_the_tokenizer_adds_one(tmp_path, flag, post, want):
  import tokenizers as hf

  tok = hf.Tokenizer(hf.models.WordLevel({"[PAD]": 0, "</s>": 1, "<bos>": 2, "[UNK]": 3,
                                          "hello": 4}, unk_token="[UNK]"))
  tok.pre_tokenizer = hf.pre_tokenizers.Whitespace()
  tok.add_special_tokens(["[PAD]", "</s>", "<bos>"])
  if post:
    tok.post_processor = hf.processors.TemplateProcessing(single="<bos> $A",
                                                          special_tokens=[("<bos>", 2)])
  tok.save(str(tmp_path / "tokenizer.json"))
  config = {"eos_token": "</s>", "bos_token": "<bos>"}
  if flag is not None:
    config["add_bos_token"] = flag
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  t = tokenizers.HFTokenizer(str(tmp_path))
  assert t.bos_id == 2 and t.add_bos == want
  assert t.encode("hello hello") == [4, 4]
  assert tokenizers.encode_prompt(t, "hello hello") == ([2, 4, 4] if want else [4, 4])
  char = tokenizers.CharTokenizer()  # the synthetic tasks' prompts: no bos
  assert tokenizers.encode_prompt(char, "1+2") == char.encode("1+2")


def test_load_tokenizer_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="neither 'char' nor a directory"):
    tokenizers.load_tokenizer(str(tmp_path / "missing"))
  with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
    tokenizers.load_tokenizer(str(tmp_path))


# ------------------------------------------------------------------ tasks
@pytest.mark.parametrize("name,difficulty", [("arithmetic", 0), ("arithmetic", 3),
                                             ("countdown", 0), ("countdown", 2),
                                             ("sorting", 0), ("sorting", 2)])
def test_splits_disjoint_deterministic_and_verified(name, difficulty):
  task = tasks.get_task(name, difficulty, seed=3)
  train, held = task.split("train", 300), task.split("eval", 100)
  assert train == tasks.get_task(name, difficulty, seed=3).split("train", 300)
  assert not {e.prompt for e in train} & {e.prompt for e in held}
  assert len({e.prompt for e in train}) == len(train)
  tok = tokenizers.CharTokenizer()
  for e in train[:100] + held[:50]:
    assert task.verify(e.answer, e.answer) == 1.0
    assert task.verify(" " + e.answer + "\n", e.answer) == 1.0
    assert task.verify(e.answer + "0", e.answer) == 0.0
    tok.encode(e.prompt + e.answer)  # all inside the char vocabulary
  if difficulty == 0:
    assert max(len(e.prompt) for e in train + held) <= 24


def test_easiest_arithmetic_enumerates_two_digit_sums():
  task = tasks.get_task("arithmetic", 0, seed=0)
  train, held = task.split("train"), task.split("eval")
  both = {e.prompt: e.answer for e in train + held}
  assert len(both) == 10_000 and 1800 <= len(held) <= 2200
  assert both["57+68="] == "125" and both["0+0="] == "0"
  # Membership depends on the prompt only; the seed only reorders.
  other = tasks.get_task("arithmetic", 0, seed=1).split("eval")
  assert sorted(other) == sorted(held) and other != held
  small = tasks.get_task("arithmetic", 0, digits=1)
  assert len(small.split("train")) + len(small.split("eval")) == 100


def test_arithmetic_precedence():
  task = tasks.get_task("arithmetic", 4)
  for e in task.split("train", 50):
    expr = e.prompt[:-1]
    value, _ = tasks.parse_expression(expr)
    assert e.answer == str(int(value))
  assert tasks.Arithmetic(ops="+*", operands=3)._make([2, 3, 4], ["+", "*"]).answer == "14"


@pytest.mark.parametrize("completion,reward", [
    ("2*(5+3)", 1.0), ("(3+5)*2=16", 1.0), (" (5+3)*2 ", 1.0),
    ("3*5+2", 0.0),            # wrong value
    ("8*2", 0.0),              # 8 is not an allowed number
    ("(3+5)*2*1", 0.0),        # 1 is not allowed
    ("(3+5)*2+3-3", 0.0),      # 3 used twice
    ("16", 0.0), ("", 0.0), ("-(-16)", 0.0), ("16.0", 0.0),
    ("__import__('os').getcwd()", 0.0), ("(3+5)**2", 0.0), ("2/(5-5)*3", 0.0),
    ("(" * 300 + "3" + ")" * 300, 0.0),
])
def test_countdown_verifier(completion, reward):
  assert tasks.countdown_reward(completion, "(3+5)*2") == reward


def test_countdown_division_and_partial_use():
  assert tasks.countdown_reward("8/2", "(8/2)*3") == 0.0  # value 4, target 12
  assert tasks.countdown_reward("12", "(8/2)*3") == 0.0
  assert tasks.countdown_reward("6*2", "6*2*1") == 1.0    # a number may go unused


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(st.integers(0, 10_000), st.integers(0, 3))
def test_countdown_generated_references_are_valid(seed, difficulty):
  task = tasks.get_task("countdown", difficulty, seed=seed)
  e = task._sample(__import__("numpy").random.default_rng(seed))
  numbers, target = e.prompt[:-1].split(">")
  value, used = tasks.parse_expression(e.answer)
  assert value == int(target) and sorted(used) == sorted(map(int, numbers.split(",")))
  assert task.verify(e.answer, e.answer) == 1.0


@pytest.mark.parametrize("text", ["-3", "1.5", "x+1", "abs(3)", "2**3", "3 if 1 else 2"])
def test_parse_expression_rejects(text):
  with pytest.raises(ValueError):
    tasks.parse_expression(text)


def test_get_task_errors():
  with pytest.raises(ValueError, match="unknown task 'nope'"):
    tasks.get_task("nope")
  with pytest.raises(ValueError, match="difficulty must be in"):
    tasks.get_task("sorting", 9)
  with pytest.raises(ValueError, match="unknown options"):
    tasks.get_task("arithmetic", 0, digitz=2)
  with pytest.raises(ValueError, match="unknown split"):
    tasks.get_task("arithmetic").split("test")
  with pytest.raises(ValueError, match="eval_fraction"):
    tasks.get_task("arithmetic", eval_fraction=1.5)
  assert tasks.get_task("arithmetic", 0, digits=3).digits == 3
