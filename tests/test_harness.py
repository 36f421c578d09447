"""lm-harness (the `harness` extra): packed scoring against each request alone for every variant, rolling
log-likelihood against the model's own token log-probabilities, generation against lm-sample, tiny local
tasks of each request kind end to end and offline, the library's own tasks pointed at local files, no
torch, and both our lm-evaluate and the harness's lm-eval installed side by side."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from small import small_config

pytest.importorskip("lm_eval", reason="the harness extra: pip install -e '.[harness,test]'")

from conftest import WORDS  # noqa: E402

from data_pipelines import sources  # noqa: E402
from eval import sample  # noqa: E402
from eval.harness import model as harness_model, paired, scoring, tasks  # noqa: E402
from lm import checkpointing, decode, train  # noqa: E402
from lm.experiment import Experiment  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def trained(small_corpus, tmp_path_factory):
  """A workdir with a checkpoint at step 20 of the small model (softmax attention)."""
  workdir = tmp_path_factory.mktemp("run")
  c = small_config(small_corpus)
  c.train.steps = 20
  c.eval.every_steps = 20
  train.train_and_evaluate(c, str(workdir))
  return workdir


def restored(workdir, rows: int = 2) -> tuple[Experiment, object, harness_model.HarnessLM]:
  step, config = checkpointing.saved_config(str(workdir))
  exp = Experiment(config)
  _, params = checkpointing.load(str(workdir), step, exp.abstract_sharded_state())
  tokenizer = sources.load_tokenizer(config.data, exp.model_cfg.V)
  return exp, params, harness_model.HarnessLM(scoring.Scorer(exp, params, rows), tokenizer)


def direct_logprobs(exp: Experiment, params, tokens: list[int]) -> np.ndarray:
  """log p(tokens[i+1] | tokens[:i+1]) of one sequence, alone in its row (no segment ids), float64."""
  logits = np.asarray(exp.model.apply({"params": params}, np.asarray([tokens[:-1]], np.int32))[0], np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  return logp[np.arange(len(tokens) - 1), tokens[1:]]


@pytest.mark.parametrize("attention", ["softmax", "linear", "hyla", "hyla,softmax"])
def test_packed_scoring_equals_each_request_alone(small_corpus, attention):
  exp = Experiment(small_config(small_corpus, attention=attention))
  params = exp.init_state().params
  rng = np.random.default_rng(0)
  requests = [
      scoring.request([2, *rng.integers(4, 320, size=n)], list(rng.integers(4, 320, size=k)), 32)
      for n, k in ((3, 2), (10, 1), (0, 5), (20, 11), (5, 3), (1, 1), (14, 4), (40, 3))
  ]
  greedy = [2, 5, 6]  # a continuation of greedy choices, whose flag must say so
  for _ in range(3):
    logits = exp.model.apply({"params": params}, np.asarray([greedy], np.int32))[0, -1]
    greedy.append(int(np.argmax(logits)))
  requests.append(scoring.request(greedy[:3], greedy[3:], 32))
  scorer = scoring.Scorer(exp, params, rows=2)
  packed = scorer.score(requests)
  assert packed[-1][1] and not all(g for _, g in packed)
  assert len(scoring.pack(requests, 32)) < len(requests), "nothing was packed together"
  for r, (logp, greedy) in zip(requests, packed):
    alone = direct_logprobs(exp, params, list(r.tokens))[-r.scored:]
    assert logp == pytest.approx(alone.sum(), rel=1e-4, abs=1e-4), (attention, r)
    logits = exp.model.apply({"params": params}, np.asarray([r.tokens[:-1]], np.int32))[0]
    argmax = np.asarray(np.argmax(logits, -1))[-r.scored:]
    assert greedy == bool(np.all(argmax == np.asarray(r.tokens[-r.scored:])))
  assert len(requests[-2].tokens) == 33 and requests[-2].scored == 3  # too long: it kept its end


def test_rolling_loglikelihood_is_the_sum_of_token_logprobs(trained):
  exp, params, lm = restored(trained)
  short = " ".join(WORDS[:8])
  long = " ".join(np.random.default_rng(1).choice(WORDS, size=60))
  for text in (short, long):
    ids = [lm.prefix, *lm.encode(text)]
    # Windows of the context (32): the first predicts ids[1:33], then each next 32 from the 32 tokens
    # before them; the last window ends at the document's end with a full context.
    expected, predicted = 0.0, 0
    while predicted < len(ids) - 1:
      end = min(predicted + 32, len(ids) - 1)
      start = max(0, end - 32)
      expected += direct_logprobs(exp, params, ids[start:end + 1])[predicted - start:].sum()
      predicted = end
    (got,) = lm.loglikelihood_rolling([type("R", (), {"args": (text,)})()])
    assert got == pytest.approx(expected, rel=1e-5)
  assert len(lm.rolling_requests(long)) == -(-(len(lm.encode(long))) // 32) > 1


def test_generate_until_equals_lm_sample_greedy(trained):
  _, _, lm = restored(trained)
  prompt = "the quick brown fox"
  (expected,) = sample.sample(str(trained), prompt, max_new_tokens=10,
                              sampling=decode.Sampling(temperature=0))
  got = lm.generate(prompt, until=[], max_gen_toks=10)
  prompt_text = lm.sp.decode([lm.prefix, *lm.encode(prompt)])
  assert expected == prompt_text + got and got
  # A stop sequence cuts the continuation before it.
  word = got.split()[1] if len(got.split()) > 1 else got.split()[0]
  cut = lm.generate(prompt, until=[word], max_gen_toks=10)
  assert cut == got.split(word)[0]


def write_tasks(root: Path) -> Path:
  """Tiny local tasks, one per request kind, as JSON lines and YAML files in root; and PIQA (the
  harness's own task) as if lm-harness-download had written it."""
  rng = np.random.default_rng(2)
  sentence = lambda n: " ".join(rng.choice(WORDS, size=n))
  rows = {
      "choice": [{
          "question": sentence(4),
          "choices": [sentence(2), sentence(3)],
          "label": int(i % 2)
      } for i in range(5)],
      "lastword": [{
          "text": sentence(6)
      } for _ in range(4)],
      "rolling": [{
          "text": "\n".join(sentence(8) for _ in range(n))
      } for n in (1, 3, 9)],
      "generate": [{
          "prompt": sentence(4),
          "answer": sentence(1)
      } for _ in range(3)],
  }
  for name, docs in rows.items():
    (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
  common = lambda name: f"task: tiny_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n" \
                        f"    test: {root / (name + '.jsonl')}\ntest_split: test\n"
  (root / "tiny_choice.yaml").write_text(
      common("choice") + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_target: label\n"
      "doc_to_choice: choices\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
  (root / "tiny_lastword.yaml").write_text(
      common("lastword") + "output_type: loglikelihood\n"
      "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\ndoc_to_target: \"{{' '+text.split(' ')[-1]}}\"\n"
      "metric_list:\n  - metric: perplexity\n  - metric: acc\n")
  (root / "tiny_rolling.yaml").write_text(
      common("rolling") + "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
      "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
  (root / "tiny_generate.yaml").write_text(
      common("generate") +
      "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
      "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\nmetric_list:\n  - metric: exact_match\n")
  import pandas as pd
  (root / "piqa").mkdir()
  for split in ("train", "validation"):
    pd.DataFrame([{
        "goal": sentence(5),
        "sol1": sentence(3),
        "sol2": sentence(3),
        "label": i % 2
    } for i in range(4)]).to_parquet(root / "piqa" / f"{split}.parquet")
  (root / "piqa" / tasks.MANIFEST).write_text(
      json.dumps({
          "task": "piqa",
          "format": "parquet",
          "files": {
              "train": "train.parquet",
              "validation": "validation.parquet"
          }
      }))
  return root


TINY = ["tiny_choice", "tiny_lastword", "tiny_rolling", "tiny_generate", "piqa"]

# Runs lm-harness's entry in this process, recording any import of torch (attempted or done).
NO_TORCH = """
import atexit, builtins, json, sys
attempts = []
real = builtins.__import__
def watch(name, *args, **kwargs):
  if name == "torch" or name.startswith("torch."):
    attempts.append(name)
  return real(name, *args, **kwargs)
builtins.__import__ = watch
log = sys.argv[1]
atexit.register(lambda: open(log, "w").write(json.dumps(
    {"attempts": attempts, "loaded": sorted(m for m in sys.modules if m.split(".")[0] == "torch")})))
sys.argv = ["lm-harness", *sys.argv[2:]]
from eval.harness.cli import run
run()
"""


@pytest.mark.slow
def test_the_command_scores_tiny_local_tasks_offline_without_torch(trained, tmp_path):
  data = write_tasks(tmp_path)
  hf_home = tmp_path / "hf_home"  # an empty Hugging Face cache: nothing can come from one
  env = dict(os.environ, HF_HOME=str(hf_home), JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  torch_log = tmp_path / "torch.json"
  result = subprocess.run([
      sys.executable, "-c", NO_TORCH,
      str(torch_log), f"--workdir={trained}", f"--tasks={','.join(TINY)}", f"--data_dir={data}",
      "--batch_size=4"
  ], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads((trained / "harness" / "step_20.json").read_text())
  assert set(out["results"]) == set(TINY) and out["step"] == 20 and out["attention"] == "softmax"
  for task, n in (("tiny_choice", 5), ("tiny_lastword", 4), ("tiny_rolling", 3), ("tiny_generate", 3),
                  ("piqa", 4)):
    assert out["items"][task]["doc_id"] == list(range(n)), task
  assert 0 <= out["results"]["tiny_choice"]["acc,none"] <= 1
  assert out["results"]["tiny_choice"]["acc_stderr,none"] > 0
  assert out["results"]["tiny_rolling"]["word_perplexity,none"] > 1
  assert len(out["items"]["tiny_rolling"]["word_perplexity"][0]) == 2  # (log-likelihood, words)
  assert set(out["items"]["piqa"]) >= {"acc", "acc_norm"}
  assert "tiny_choice" in result.stdout and "|" in result.stdout  # the harness's table
  assert json.loads(torch_log.read_text()) == {"attempts": [], "loaded": []}
  assert not hf_home.exists() or not any((hf_home / "hub").glob("*"))


def test_a_task_without_local_data_names_the_download(tmp_path):
  (tmp_path / "data").mkdir()
  with pytest.raises(FileNotFoundError, match=r"no local data for arc_easy in .*lm-harness-download "
                     r"--tasks=arc_easy --out="):
    tasks.local_tasks(["arc_easy"], tmp_path / "data", tmp_path / "yaml")


def test_download_writes_every_split_the_task_reads(tmp_path, monkeypatch):
  """lm-harness-download without the network: the hub's load_dataset replaced by local data."""
  import datasets
  calls = []

  def load_dataset(path, name=None, **kwargs):
    calls.append((path, name))
    rows = [{"question": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "A"}]
    return datasets.DatasetDict(
        {s: datasets.Dataset.from_list(rows * 3) for s in ("train", "validation", "test")})

  monkeypatch.setattr(datasets, "load_dataset", load_dataset)
  (manifest,) = tasks.download(["arc_challenge"], tmp_path)
  assert calls == [("allenai/ai2_arc", "ARC-Challenge")]
  saved = json.loads(manifest.read_text())
  assert saved["files"] == {s: f"{s}.parquet" for s in ("train", "validation", "test")}
  assert saved["rows"] == {"train": 3, "validation": 3, "test": 3}
  include = tasks.local_tasks(["arc_challenge"], tmp_path, tmp_path / "yaml")
  written = (tmp_path / "yaml" / "arc_challenge.yaml").read_text()
  assert "arc_challenge.yaml" in written and "dataset_path: parquet" in written and include[1] == tmp_path


def test_our_lm_evaluate_and_the_harness_cli_both_run():
  # absl's --help exits 1 (tests/test_launch.py reads its listing the same way).
  ours = subprocess.run([str(BIN / "lm-evaluate"), "--help"], capture_output=True, text=True, timeout=300)
  assert "lm-evaluate" in ours.stdout and "--workdir" in ours.stdout and "--split" in ours.stdout
  for name in ("lm_eval", "lm-eval"):
    theirs = subprocess.run([str(BIN / name), "--help"], capture_output=True, text=True, timeout=300)
    assert theirs.returncode == 0 and "Language Model Evaluation Harness" in theirs.stdout, name
  for name in ("lm-harness", "lm-harness-download"):
    help_text = subprocess.run([str(BIN / name), "--help"], capture_output=True, text=True,
                               timeout=300).stdout
    assert "--tasks" in help_text, name


@pytest.mark.slow
def test_two_processes_score_as_one(trained, tmp_path):
  """Process 0 runs the harness, process 1 follows its broadcast steps (scoring and decoding): the
  same item scores as one process."""
  data = write_tasks(tmp_path)
  args = lambda out: [
      sys.executable, "-m", "eval.harness.cli", f"--workdir={trained}",
      "--tasks=tiny_choice,tiny_rolling,tiny_generate", f"--data_dir={data}", "--batch_size=4",
      f"--output={out}"
  ]
  env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  one = subprocess.run(args(tmp_path / "one.json"), capture_output=True, text=True, timeout=900, env=env,
                       cwd=ROOT)
  assert one.returncode == 0, one.stderr[-3000:]
  two = subprocess.run([
      sys.executable, "-m", "launch.cli", "processes", "-n", "2", "--xla_devices", "2", "--",
      *args(tmp_path / "two.json")
  ], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
  assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
  want, got = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
  for task in ("tiny_choice", "tiny_rolling", "tiny_generate"):
    for metric, values in want["items"][task].items():
      np.testing.assert_allclose(np.asarray(got["items"][task][metric], float), np.asarray(values, float),
                                 rtol=1e-5, err_msg=f"{task} {metric}")


def fake_rows(dataset_path: str, rng) -> list[dict]:
  """A few rows in the schema of each standard task's dataset."""
  sentence = lambda n: " ".join(rng.choice(WORDS, size=n))
  make = {
      "EleutherAI/wikitext_document_level":
          lambda: {
              "page": "\n".join(sentence(12) for _ in range(4))
          },
      "EleutherAI/lambada_openai":
          lambda: {
              "text": sentence(8)
          },
      "baber/piqa":
          lambda: {
              "goal": sentence(5),
              "sol1": sentence(3),
              "sol2": sentence(3),
              "label": 1
          },
      "Rowan/hellaswag":
          lambda: {
              "activity_label": sentence(1),
              "ctx_a": sentence(4),
              "ctx_b": sentence(2),
              "ctx": sentence(6),
              "endings": [sentence(3) for _ in range(4)],
              "label": "2"
          },
      "allenai/winogrande":
          lambda: {
              "sentence": f"{sentence(3)} _ {sentence(3)}",
              "option1": sentence(1),
              "option2": sentence(1),
              "answer": "1"
          },
      "allenai/ai2_arc":
          lambda: {
              "question": sentence(5),
              "choices": {
                  "text": [sentence(2) for _ in range(4)],
                  "label": list("ABCD")
              },
              "answerKey": "C"
          },
  }[dataset_path]
  return [make() for _ in range(3)]


@pytest.mark.slow
def test_the_standard_seven_download_and_run_from_local_files(trained, tmp_path, monkeypatch):
  """lm-harness-download for the seven standard tasks (the hub replaced by rows in each dataset's
  schema), then lm-harness on them with the library's own prompts and metrics, offline."""
  import datasets

  from eval.harness import cli
  rng = np.random.default_rng(3)
  load = lambda path, name=None, **kwargs: datasets.DatasetDict(
      {s: datasets.Dataset.from_list(fake_rows(path, rng)) for s in ("train", "validation", "test")})
  monkeypatch.setattr(datasets, "load_dataset", load)
  tasks.download(list(tasks.STANDARD), tmp_path / "data")
  monkeypatch.undo()
  for name in (*cli.OFFLINE, "DISABLE_MULTIPROC"):
    monkeypatch.setenv(name, "1")
  out = cli.harness(str(trained), list(tasks.STANDARD), data_dir=str(tmp_path / "data"), limit=2,
                    batch_size=2)
  assert set(out["results"]) == set(tasks.STANDARD)
  for task in tasks.STANDARD:
    assert out["items"][task]["doc_id"] == [0, 1], task
  assert out["results"]["wikitext"]["word_perplexity,none"] > 1
  assert set(paired.headline(out)) == set(tasks.STANDARD)
