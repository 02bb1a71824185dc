"""Model-judged rewards (``reward.judge_path``, ``rl_jax.train.judge_stage``): the verdicts
against transformers on the same checkpoint and prompts, a short training run whose rewards
are the judge's, and the one-line setup errors."""

import json
import os
import re
import shutil

import jinja2
import numpy as np
import pytest
import tokenizers
import torch
from tokenizers import models as tok_models, pre_tokenizers

from rl_jax import config as config_lib, config_utils, metrics, settings, train
from rl_jax.errors import ConfigError
from rl_jax.train import judge_stage
from tests.hf_utils import tiny_hf_model
from tests.tiny import QUICKSTART, TINY_MODEL

G, M = 2, 4
TINY = TINY_MODEL + [
    "sft.steps=0", "train.steps=2", f"train.batch_groups={G}", f"rollout.n={M}",
    "rollout.temperature=1.0", "train.eval_every=0", "train.checkpoint_every=0",
    "log.tensorboard=False"]
# the quickstart's prompts ("sort 302:") and references ("023") are words of the judge's
# vocabulary; the policy's completions mostly map to <unk>
WORDS = (["<unk>", "</s>", "<pad>", "yes", "no", "Question", "Answer", "Reference", "Is",
          "the", "answer", "correct", "Score", "sort", ":", "?", "."]
         + [str(i) for i in range(10)] + [f"{i:02d}" for i in range(100)]
         + [f"{i:03d}" for i in range(1000)])
YES_NO = ("Question : {{ question }} Answer : {{ answer }} Reference : {{ reference }} "
          "Is the answer correct ?\n")
SCORE = "Question : {{ question }} Answer : {{ answer }} Score :"
ROWS = [("sort 302 :", "023", "023"), ("sort 7 1 9 :", "1 7 9", "179"),
        ("sort 05 :", "sort the answer 05 50 . yes no", "05"), ("sort :", "", "000"),
        ("sort 1 :", "?", "1")]


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
  """(directory, transformers model): a random one-layer Qwen3 over ``WORDS`` with a
  word-level tokenizer (eos ``</s>``, pad ``<pad>``, no bos) and the two templates."""
  path = tmp_path_factory.mktemp("judge")
  vocab = {w: i for i, w in enumerate(dict.fromkeys(WORDS))}
  model = tiny_hf_model("qwen3", path, vocab=len(vocab), hidden=32, inter=64, layers=1)
  tok = tokenizers.Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>",
                                                          "pad_token": "<pad>"}))
  (path / "yes_no.jinja").write_text(YES_NO)
  (path / "score.jinja").write_text(SCORE)
  return str(path), model


def _config(path, extra=()):
  return config_utils.load_config(QUICKSTART, TINY + [
      f"reward.judge_path={path}", f"reward.judge_template={path}/yes_no.jinja", *extra])


def _judge(config):
  """The judge the setup builds from ``config``'s reward settings."""
  reward = settings.from_section(settings.RewardSettings, "reward", config.reward)
  return judge_stage.make_judge(reward, config.model.dtype)


def _hf_ids(path, template, q, a, r):
  """The prompt as plain jinja2 renders it and the tokenizers library encodes it."""
  text = jinja2.Template(template).render(question=q, answer=a, reference=r)
  return tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json")).encode(text).ids


def test_yes_no_verdicts_match_transformers(judge_dir):
  """P(yes)/(P(yes)+P(no)) of the next token, batched and padded, equals transformers'
  softmax on each prompt alone."""
  path, model = judge_dir
  judge = _judge(_config(path))
  vocab = judge.tokenizer.vocab()
  assert (judge.yes, judge.no) == ((vocab["yes"],), (vocab["no"],))
  q, a, r = (list(x) for x in zip(*ROWS))
  prompts = judge.prompts(q, a, r)
  got = judge.verdicts(q, a, r)
  want = []
  for row, ids in zip(ROWS, prompts):
    assert ids == _hf_ids(path, YES_NO, *row)
    with torch.no_grad():
      logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
    p_yes, p_no = logp[vocab["yes"]].exp().item(), logp[vocab["no"]].exp().item()
    want.append(p_yes / (p_yes + p_no))
  np.testing.assert_allclose(got, want, atol=1e-4)
  assert got.dtype == np.float32 and np.ptp(got) > 1e-3  # the rows differ


def test_score_verdicts_follow_transformers_greedy_decoding(judge_dir):
  """The "score" reader: the greedy continuation's ids are transformers' ``generate``'s, and
  the reward the first number of their text (NaN, then reward 0 and one exception, without)."""
  path, model = judge_dir
  judge = _judge(_config(path, [
      f"reward.judge_template={path}/score.jinja", "reward.judge_verdict=score",
      "reward.judge_max_tokens=6"]))
  q, a, r = (list(x) for x in zip(*ROWS))
  prompts = judge.prompts(q, a, r)
  got_ids = judge.continuations(prompts)
  hf_tok = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
  eos = hf_tok.token_to_id("</s>")
  want = []
  for ids, mine in zip(prompts, got_ids):
    with torch.no_grad():
      out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6,
                           eos_token_id=eos, pad_token_id=eos)
    new = out[0, len(ids):].tolist()
    new = new[:new.index(eos) + 1] if eos in new else new
    assert mine == new
    text = hf_tok.decode([t for t in new if t != eos])
    m = re.search(r"-?\d+(\.\d+)?", text)
    want.append(float(m.group()) if m else float("nan"))
  np.testing.assert_array_equal(judge.verdicts(q, a, r), np.asarray(want, np.float32))
  assert any(np.isfinite(want))


@pytest.mark.parametrize("text, value", [
    ("7", 7.0), ("score: 0.75 or 1", 0.75), ("-2 points", -2.0), ("about .5", 0.5),
    ("10/10", 10.0), ("no number", float("nan")), ("", float("nan"))])
def test_parse_score_reads_the_first_number(text, value):
  got = judge_stage.parse_score(text)
  assert got == value or (np.isnan(value) and np.isnan(got))


def test_rows_without_a_verdict_score_zero_and_are_counted():
  values, faults = judge_stage.as_values(np.asarray([0.5, np.nan, 3.0], np.float32))
  assert values == [0.5, None, 3.0] and faults == {"exceptions": 1, "timeouts": 0}
  _, faults = judge_stage.as_values(np.asarray([np.nan], np.float32), why="no number")
  assert faults["errors"] == ["no number"]  # what the run's note prints
  _, faults = judge_stage.as_values(np.asarray([1.0], np.float32), why="no number")
  assert "errors" not in faults


def test_training_rewards_are_the_judges_verdicts(judge_dir, tmp_path, monkeypatch):
  """A short run on the quickstart: each step's reward_mean is the mean of the judge's
  verdicts on that step's G·M rows (prompt, completion, reference), all in [0,1]."""
  path, _ = judge_dir
  calls = []
  verdicts = judge_stage.Judge.verdicts

  def recorded(self, questions, completions, references):
    out = verdicts(self, questions, completions, references)
    calls.append((list(questions), list(references), out))
    return out

  monkeypatch.setattr(judge_stage.Judge, "verdicts", recorded)
  train.train(_config(path), str(tmp_path), progress=False)
  rows = [r for r in metrics.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
          if "reward_mean" in r]
  assert len(rows) == len(calls) == 2
  for row, (questions, references, out) in zip(rows, calls):
    assert len(out) == G * M and questions[0].startswith("sort") and references[0].isdigit()
    assert ((out >= 0) & (out <= 1)).all() and np.ptp(out) > 0
    np.testing.assert_allclose(row["reward_mean"], out.mean(), rtol=1e-5)


# ------------------------------------------------------------------------ the errors
def _error(config) -> str:
  with pytest.raises(ConfigError) as e:
    train.build_setup(config)
  assert "\n" not in str(e.value)
  return str(e.value)


@pytest.mark.parametrize("source", ["{{ question | nosuchfilter }}", "{% if question %} yes",
                                    "{{ questoin }}", "{{ answer.nope.deeper }}"])
def test_a_template_that_does_not_render_is_one_line(judge_dir, tmp_path, source):
  path, _ = judge_dir
  (tmp_path / "bad.jinja").write_text(source)
  msg = _error(_config(path, [f"reward.judge_template={tmp_path}/bad.jinja"]))
  assert "does not render" in msg and "bad.jinja" in msg


@pytest.mark.parametrize("source,words", [
    (b"Question : {question} Answer : {answer} Is the answer correct ?",
     "never shows the judge the answer, so every row would get the same verdict: write it as "
     "{{ answer }} (jinja2)"),
    (b"Question : {{ question }} \xe9 Answer : {{ answer }}", "is not UTF-8 text"),
])
def test_a_template_that_cannot_judge_is_one_line(judge_dir, tmp_path, source, words):
  """A format string's ``{answer}`` renders as the text "{answer}": every row would get the
  judge's verdict on the same prompt. A Latin-1 file is not read as garbage."""
  path, _ = judge_dir
  (tmp_path / "bad.jinja").write_bytes(source)
  msg = _error(_config(path, [f"reward.judge_template={tmp_path}/bad.jinja"]))
  assert msg.startswith(f"reward.judge_template={tmp_path}/bad.jinja ") and words in msg


def test_a_tokenizer_larger_than_the_judge_is_one_line(judge_dir, tmp_path):
  """Token ids past the judge's embedding would read no verdict on any row."""
  path, _ = judge_dir
  small = tmp_path / "small"
  shutil.copytree(path, small)
  cfg = json.loads((small / "config.json").read_text())
  (small / "config.json").write_text(json.dumps({**cfg, "vocab_size": 20}))
  msg = _error(_config(str(small), [f"reward.judge_template={path}/yes_no.jinja"]))
  assert "its tokenizer has" in msg and "tokens but the model only 20" in msg


def test_missing_files_are_one_line(judge_dir, tmp_path):
  path, _ = judge_dir
  assert "no such file" in _error(_config(path, [f"reward.judge_template={tmp_path}/x.jinja"]))
  assert "no such directory" in _error(_config(str(tmp_path / "nowhere"), [
      f"reward.judge_template={path}/yes_no.jinja"]))
  (tmp_path / "config.json").write_text((open(os.path.join(path, "config.json")).read()))
  msg = _error(_config(str(tmp_path), [f"reward.judge_template={path}/yes_no.jinja"]))
  assert "no tokenizer.json" in msg
  os.remove(tmp_path / "config.json")
  (tmp_path / "tokenizer.json").write_text("{}")
  msg = _error(_config(str(tmp_path), [f"reward.judge_template={path}/yes_no.jinja"]))
  assert "no config.json" in msg


@pytest.mark.parametrize("extra, words", [
    (["reward.judge_verdict=maybe"], "reward.judge_verdict"),
    (["reward.group_fn=majority_vote"], "cannot be combined"),
    (["reward.judge_template="], "needs reward.judge_template"),
    (["env.name=calculator"], "not supported with env.name"),
])
def test_config_mistakes_are_one_line(judge_dir, extra, words):
  path, _ = judge_dir
  with pytest.raises(ConfigError, match=re.escape(words)) as e:
    config_lib.validate(_config(path, extra))
  assert "\n" not in str(e.value)


def test_template_without_a_judge_is_one_line(judge_dir):
  path, _ = judge_dir
  config = config_utils.load_config(QUICKSTART, TINY + [
      f"reward.judge_template={path}/yes_no.jinja"])
  with pytest.raises(ConfigError, match="needs reward.judge_path"):
    config_lib.validate(config)


def test_setup_does_not_read_the_weights(judge_dir):
  """build_setup checks the judge's files but reads its weights only on first use."""
  path, _ = judge_dir
  s = train.build_setup(_config(path))
  assert s.judge is not None and s.judge._params is None  # pylint: disable=protected-access
  assert s.reward_names == ()
