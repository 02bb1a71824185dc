"""GSM8K/MATH files through TFDS (no TensorFlow) and math answer checking."""

import json
import re
import sys

import pytest

from rl_jax.data import files, tasks, verifiers

GSM8K = [
    {"question": "Tom has 3 apples and buys 1,000 more. How many?",
     "answer": "3 + 1000 = 1003\n#### 1,003"},
    {"question": "What is 2+2?", "answer": "2+2=4\n#### 4"},
    {"question": "Half of 7?", "answer": "#### 3.5"},
]
MATH = [
    {"problem": "Compute $1/2$.", "solution": "It is $\\boxed{\\frac{1}{2}}$."},
    {"problem": "Solve x+1=3.", "solution": "So $x = \\boxed{2}$ and not \\boxed{{3}}.x",
     "answer": "2"},
    {"problem": "Nested?", "solution": "\\boxed{\\sqrt{\\frac{a}{b}}}"},
]


def _jsonl(path, records, extra_lines=()):
  lines = [json.dumps(r) for r in records] + list(extra_lines)
  path.write_text("\n".join(lines) + "\n")
  return str(path)


def test_read_gsm8k_and_math(tmp_path):
  qa = files.read_qa(_jsonl(tmp_path / "g.jsonl", GSM8K, ["", "  "]), "auto")
  assert [r["reference"] for r in qa] == ["1003", "4", "3.5"]
  assert qa[0]["question"] == GSM8K[0]["question"]
  qa = files.read_qa(_jsonl(tmp_path / "m.jsonl", MATH), "math")
  assert [r["reference"] for r in qa] == ["\\frac{1}{2}", "2", "\\sqrt{\\frac{a}{b}}"]


def test_read_parquet(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  path = str(tmp_path / "m.parquet")
  pq.write_table(pa.Table.from_pylist([{"problem": r["problem"], "solution": r["solution"]}
                                       for r in MATH]), path)
  assert [r["reference"] for r in files.read_qa(path)][0] == "\\frac{1}{2}"


def test_a_final_answer_given_as_a_number_is_read(tmp_path):
  """JSON numbers as final answers: the text of the number, in both formats (a math
  record's number was skipped for its solution's \\boxed{})."""
  path = _jsonl(tmp_path / "n.jsonl", [{"question": "2+2?", "answer": 4},
                                        {"question": "7/2?", "answer": 3.5}])
  assert [qa["reference"] for qa in files.read_qa(path)] == ["4", "3.5"]
  path = _jsonl(tmp_path / "m.jsonl", [{"problem": "x?", "solution": "so \\boxed{5}",
                                        "answer": 7}])
  assert [qa["reference"] for qa in files.read_qa(path)] == ["7"]
  with pytest.raises(ValueError, match="line 1 has no gsm8k question"):
    files.read_qa(_jsonl(tmp_path / "b.jsonl", [{"question": "x?", "answer": True}]))


def test_file_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="data file not found"):
    files.read_qa(str(tmp_path / "missing.jsonl"))
  bad = _jsonl(tmp_path / "bad.jsonl", GSM8K[:1], ["{not json"])
  with pytest.raises(ValueError, match="line 2 is not valid JSON"):
    files.read_qa(bad)
  arr = _jsonl(tmp_path / "arr.jsonl", GSM8K[:1], ["[1, 2]"])
  with pytest.raises(ValueError, match="line 2 is not a JSON object"):
    files.read_qa(arr)
  (tmp_path / "empty.jsonl").write_text("\n")
  with pytest.raises(ValueError, match="no records"):
    files.read_qa(str(tmp_path / "empty.jsonl"))
  noans = _jsonl(tmp_path / "noans.jsonl", GSM8K[:2] + [{"question": "q", "answer": "no"}])
  with pytest.raises(ValueError, match="line 3 has no gsm8k question and final answer") as e:
    files.read_qa(noans)
  assert "gsm8k needs a 'question' string and an 'answer' that ends in '#### " in str(e.value)
  with pytest.raises(ValueError, match="unknown data format"):
    files.read_qa(noans, "csv")
  odd = _jsonl(tmp_path / "odd.jsonl", [{"text": "x"}])
  with pytest.raises(ValueError, match=f"^{odd}: line 1: cannot detect the format"):
    files.read_qa(odd)
  (tmp_path / "latin1.jsonl").write_bytes(b'{"question": "caf\xe9?", "answer": "#### 1"}\n')
  with pytest.raises(ValueError, match=r"latin1.jsonl: line 1 is not UTF-8 text \(invalid "
                                       r"continuation byte at byte 17\)"):
    files.read_qa(str(tmp_path / "latin1.jsonl"))
  (tmp_path / "x.csv").write_text("a,b\n")
  with pytest.raises(ValueError, match="unsupported file type"):
    files.read_qa(str(tmp_path / "x.csv"))
  with pytest.raises(ValueError, match="needs data.path"):
    tasks.get_task("file")


def test_tfds_source_matches_memory_without_tensorflow(tmp_path):
  path = _jsonl(tmp_path / "g.jsonl", GSM8K)
  data_dir = str(tmp_path / "tfds")
  via_tfds = files.QASource(path, "gsm8k", "tfds", data_dir)
  in_memory = files.QASource(path, "gsm8k", "memory")
  assert len(via_tfds) == 3 and list(via_tfds) == list(in_memory)
  assert "tensorflow" not in sys.modules
  # An edited file gets a new builder config (content hash), never stale records.
  path = _jsonl(tmp_path / "g.jsonl", GSM8K[:2])
  assert len(files.QASource(path, "gsm8k", "tfds", data_dir)) == 2
  with pytest.raises(ValueError, match="line 2 is not valid JSON"):
    files.QASource(_jsonl(tmp_path / "b.jsonl", GSM8K[:1], ["{"]), "auto", "tfds", data_dir)


def test_file_task_splits(tmp_path):
  records = [{"question": f"What is {i} plus {i}?", "answer": f"#### {2 * i}"}
             for i in range(40)]
  train_path = _jsonl(tmp_path / "train.jsonl", records)
  test_path = _jsonl(tmp_path / "test.jsonl", GSM8K)
  task = tasks.get_task("file", path=train_path, eval_path=test_path, backend="memory",
                        template="Q: {question}\nA:")
  train, held = task.split("train"), task.split("eval")
  assert len(train) == 40 and len(held) == 3
  assert train[5] == tasks.Example("Q: What is 5 plus 5?\nA:", "10")
  assert task.verify("5+5 is \\boxed{10}", train[5].answer) == 1.0
  assert task.verify("#### 11", train[5].answer) == 0.0
  hashed = files.FileTask(path=train_path, eval_fraction=0.3, backend="tfds",
                          data_dir=str(tmp_path / "tfds"))
  tr, ev = list(hashed.split("train")), list(hashed.split("eval"))
  assert len(tr) + len(ev) == 40 and ev and not {e.prompt for e in tr} & {e.prompt for e in ev}
  assert len(hashed.split("train", size=4)) == 4
  # other braces in the template are literal text (MATH prompts ask for \boxed{})
  boxed = tasks.get_task("file", path=train_path, eval_path=test_path, backend="memory",
                         template="{question} Put the answer in \\boxed{}.")
  assert boxed.split("train")[5].prompt == "What is 5 plus 5? Put the answer in \\boxed{}."
  named = tasks.get_task("file", path=train_path, eval_path=test_path, backend="memory",
                         template="{question} Answer in \\boxed{answer}.")
  assert named.split("train")[5].prompt == "What is 5 plus 5? Answer in \\boxed{answer}."


@pytest.mark.parametrize("template,words", [
    ("Q: {question} A: {answer}", "has the field {answer}, which nothing fills"),
    ("{{question}}", "write the field as {question}, in one pair of braces"),
    ("{{ question }}", "write the field as {question}, in one pair of braces"),
])
def test_a_template_field_nothing_fills_is_one_line(tmp_path, template, words):
  """``{answer}`` would reach the model as the text "{answer}", and ``{{question}}`` wraps
  every question in braces: each is a mistake, not a prompt."""
  path = _jsonl(tmp_path / "t.jsonl", GSM8K)
  with pytest.raises(ValueError, match=re.escape(words)):
    tasks.get_task("file", path=path, template=template, backend="memory")


@pytest.mark.parametrize("text,answer", [
    ("so \\boxed{12} then #### 13", "12"),
    ("work\n#### 1,234\n", "1,234"),
    ("we get 3, then 4.5 dollars.", "4.5"),
    ("total 1,200 apples", "1200"),
    ("\\boxed{\\frac{a}{\\sqrt{b}}}", "\\frac{a}{\\sqrt{b}}"),
    ("nothing here", None),
])
def test_final_answer(text, answer):
  assert verifiers.final_answer(text) == answer


@pytest.mark.parametrize("completion,reference,reward", [
    ("The answer is \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("#### 1,003", "1003", 1.0),
    ("She has 42 apples.", "42", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{x^2+1}", "1+x^2", 1.0),
    ("#### 41", "42", 0.0),
    ("\\boxed{-18}", "18", 0.0),
    ("I do not know", "42", 0.0),
])
def test_math_reward(completion, reference, reward):
  assert verifiers.math_reward(completion, reference) == reward
