"""`lm-prepare --seqio_task`: seqio Tasks and Mixtures registered by a user's module over local
documents, prepared into token-id shards, trained on and resumed exactly by lm-train, which imports
neither seqio nor TensorFlow; the C4 task's tokens against ours; the mistakes a user can make.

Needs the seqio extra (`.venv-seqio`, .ci/run); skipped where seqio is not installed. Offline: T5's
vocabulary and TFDS C4 are out of reach here, so a SentencePiece model trained on the test corpus with
T5's special ids (PAD 0, EOS 1, UNK 2, no BOS) stands in for the vocabulary, and seqio
FunctionDataSources over documents in C4's shape ({text, url, timestamp}, multi-line, non-ASCII) stand
in for TFDS c4/en:3.1.0, under the C4 task's own preprocessors (data_pipelines/seqio_tasks.py).
"""

import json
import os
import re
import runpy
import shutil
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
from conftest import make_documents
from etils import epath

seqio = pytest.importorskip("seqio")

import sentencepiece as spm  # noqa: E402

from data_pipelines import records, seqio_prepare, seqio_tasks, sources, tokenizer  # noqa: E402
from lm import train  # noqa: E402
from lm.runtime import run_log  # noqa: E402

HERE = os.path.dirname(__file__)
TASKS = '''"""seqio tasks over local documents, as a user's module registers them (tests/test_seqio.py)."""
import json
import pathlib

import seqio
import tensorflow as tf

from data_pipelines import seqio_tasks

HERE = pathlib.Path(__file__).parent
MODEL = str(HERE / "t5_like.model")


def source(name):
  docs = json.loads((HERE / f"{name}.json").read_text())

  def dataset_fn(split, shuffle_files):
    del shuffle_files
    return tf.data.Dataset.from_tensor_slices({k: [d[k] for d in docs[split]] for k in ("text", "url", "timestamp")})

  return seqio.FunctionDataSource(dataset_fn, splits=list(docs))


seqio_tasks.register_c4("local_c4", vocabulary=MODEL, source=source("c4"))
seqio_tasks.register_c4("local_more", vocabulary=MODEL, source=source("more"))
seqio.MixtureRegistry.add("local_mix", [("local_c4", 2.0), ("local_more", 1.0)])
seqio.TaskRegistry.add(
    "local_inputs_only", source=source("c4"),
    preprocessors=[seqio_tasks.c4_preprocessors()[0], seqio.preprocessors.tokenize],
    output_features={"inputs": seqio.Feature(seqio.SentencePieceVocabulary(MODEL), required=False)})
'''
CONFIG = """
from small import small_config

def get_config():
  c = small_config({data!r})
  c.train.update(steps=6, log_every_steps=1)
  c.checkpoint.every_steps = 3
  c.eval.every_steps = 6
  return c
"""


def c4_like(n: int, seed: int) -> list[dict]:
  docs = make_documents(n, seed)
  for d in docs:
    d["text"] = d["text"].replace("moon", "mōon —")
  return docs


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
  """A folder holding the user's task module, its documents and a T5-like SentencePiece model; on
  sys.path, as PYTHONPATH puts it for lm-prepare."""
  root = tmp_path_factory.mktemp("user_tasks")
  docs = {"c4": {"train": c4_like(40, 0), "validation": c4_like(12, 1)}}
  docs["more"] = {"train": c4_like(30, 2), "validation": c4_like(10, 3)}
  for name, splits in docs.items():
    (root / f"{name}.json").write_text(json.dumps(splits))
  lines = [line for d in docs["c4"]["train"] for line in d["text"].splitlines()]
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(root / "t5_like"),
                                 vocab_size=320, model_type="bpe", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                 byte_fallback=True, character_coverage=1.0, minloglevel=2)
  (root / "local_tasks.py").write_text(TASKS)
  sys.path.insert(0, str(root))
  yield root, docs
  sys.path.remove(str(root))


def _convert(name, shard, split, index, count):
  """One shard written as an lm-prepare worker writes it."""
  return seqio_prepare.convert((os.fspath(shard), split, split, index, count), name=name,
                               modules=("local_tasks",), length=0, tfds_data_dir="")


def _ids(shard) -> list[list[int]]:
  return [np.frombuffer(r, "<i4").tolist() for r in records.Shards([os.fspath(shard)])]


def test_the_c4_task_yields_our_tokens_and_a_shard_is_written_once(tasks_dir, tmp_path):
  """The built-in C4 task's preprocessors (over local documents and the stand-in model) give, per
  document, the ids our Tokenizer gives, which is what `lm-prepare --pretokenize` stores."""
  root, docs = tasks_dir
  builtin = seqio.get_mixture_or_task(seqio_tasks.C4_TASK)
  assert builtin.source.tfds_dataset.name == "c4/en:3.1.0"
  assert builtin.output_features["targets"].vocabulary.sentencepiece_model_file == seqio_tasks.T5_VOCABULARY
  local = seqio_prepare.provider("local_c4", ("local_tasks",))
  assert [type(p) for p in local.preprocessors] == [type(p) for p in builtin.preprocessors]
  ours = tokenizer.Tokenizer(root / "t5_like.model")
  assert ours.bos == -1 and ours.eos == 1  # T5's: no BOS
  texts = [d["text"] for d in docs["c4"]["train"]]
  for i in range(2):
    shard = tmp_path / records.shard_name("train", i, 2)
    (tmp_path / "stats").mkdir(exist_ok=True)
    stats = _convert("local_c4", shard, "train", i, 2)
    want = [ids.tolist() for ids in ours.encode_batch(texts[i::2])]
    assert _ids(shard) == want, "the seqio C4 task's token ids differ from our tokenizer's"
    assert stats["documents"] == len(want) and stats["tokens"] == sum(map(len, want))
    assert stats["bytes"] == sum(len(t.encode()) for t in texts[i::2])
  before = shard.stat().st_mtime_ns
  again = _convert("local_c4", shard, "train", 1, 2)
  assert again["skipped"] and shard.stat().st_mtime_ns == before  # a rerun keeps a finished shard


@pytest.mark.slow
def test_a_mixture_prepared_trains_and_resumes_exactly_without_tensorflow(tasks_dir, tmp_path):
  root, docs = tasks_dir
  data = tmp_path / "data"
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), HERE])}
  result = subprocess.run([
      sys.executable, "-m", "launch.prepare", "--seqio_task=local_mix", "--seqio_module=local_tasks",
      f"--output={data}", "--seqio_shards=train=3,validation=2", "--workers=2"
  ], capture_output=True, text=True, env=env, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "vocabulary: " in result.stdout and "(set model.V=320)" in result.stdout
  totals = json.loads(result.stdout[result.stdout.index("{"):])
  # Shard i is what seqio's own mixing gives for ShardInfo(i, 3): both tasks, in its proportions.
  mixture = seqio.get_mixture_or_task("local_mix")
  ours = tokenizer.Tokenizer(root / "t5_like.model")
  sources_of = {
      tuple(ids.tolist()): name for name in docs
      for ids in ours.encode_batch([d["text"] for d in docs[name]["train"]])
  }
  prepared = []
  for i in range(3):
    want = [
        x["targets"].tolist() for x in mixture.get_dataset(
            None, "train", shuffle=False, shard_info=seqio.ShardInfo(i, 3), num_epochs=1).as_numpy_iterator()
    ]
    prepared += _ids(data / records.shard_name("train", i, 3))
    assert prepared[-len(want):] == want
  assert totals["train"]["documents"] == len(prepared) and totals["validation"]["shards"] == 2
  assert {sources_of[tuple(ids)] for ids in prepared} == {"c4", "more"}
  stamp = json.loads((data / records.TOKENIZED_BY).read_text())
  assert stamp["seqio"] == {
      "task": "local_mix",
      "kind": "mixture",
      "vocabulary": str(root / "t5_like.model"),
      "extra_ids": 0
  }
  assert stamp["vocab_size"] == 320 and stamp["bos"] == -1
  cfg = ml_collections.ConfigDict(dict(source="array_record", dir=str(data), tokenizer=""))
  with pytest.raises(
      ValueError, match=rf"^model.V=384 but {re.escape(str(data))} holds seqio mixture "
      rf"'local_mix', tokenized by its vocabulary {re.escape(str(root))}/t5_like.model of 320 "
      rf"ids; set --config.model.V=320$"):
    sources.resolve(cfg, 384)
  with pytest.raises(
      ValueError, match=r"train.array_record-00000-of-00003 in .* was made from seqio "
      r"'local_mix', split 'train', shard 1 of 3, not from seqio 'local_c4', split 'train', "
      r"shard 1 of 3: .*use an empty --output directory"):
    _prepare("local_c4", data, shards={"train": 3, "validation": 2})
  assert json.loads((data / records.TOKENIZED_BY).read_text()) == stamp, "a refused run wrote nothing"

  # Trained from one process, then resumed by lm-train from the step-3 checkpoint: the same losses.
  config = tmp_path / "seqio_config.py"
  config.write_text(CONFIG.format(data=str(data)))
  whole = tmp_path / "whole"
  sys.path.insert(0, HERE)
  try:
    train.train_and_evaluate(runpy.run_path(str(config))["get_config"](), str(whole))
  finally:
    sys.path.remove(HERE)
  shutil.copytree(whole, tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "6")
  result = subprocess.run([
      sys.executable, "-X", "importtime", "-m", "lm.train", f"--config={config}",
      f"--workdir={tmp_path / 'resumed'}"
  ], capture_output=True, text=True, env={
      **os.environ, "PYTHONPATH": HERE
  }, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "resumed from the checkpoint at step 3" in result.stdout + result.stderr
  imported = {
      m.split(".")[0] for m in re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", result.stderr, re.M)
  }
  assert "jax" in imported and not imported & {"tensorflow", "tensorflow_text", "seqio"}
  losses = lambda w: {r["step"]: r["loss"] for r in run_log.read(w) if r["kind"] == "train"}
  assert losses(tmp_path / "resumed") == losses(whole) and sorted(losses(whole)) == list(range(1, 7))


def _prepare(name, output, modules=("local_tasks",), **kw):
  return seqio_prepare.prepare_task(name, epath.Path(output), modules=modules, progress=False, **kw)


@pytest.mark.parametrize(
    "name, kw, message",
    [
        ("local_c5", dict(), r"no seqio task or mixture 'local_c5' is registered \(near names: local_c4.*\); "
         r"give the name as its module registers it, and --seqio_module=PKG.MODULE for each module that "
         r"registers it$"),
        ("local_c4", dict(modules=("no_such_tasks",)), r"--seqio_module=no_such_tasks \(for --seqio_task="
         r"local_c4\) does not import: ModuleNotFoundError: No module named 'no_such_tasks'; install it, or put "
         r"the folder that holds it on PYTHONPATH$"),
        ("local_inputs_only", dict(), r"seqio task 'local_inputs_only' has no 'targets' output feature \(it "
         r"has: inputs\); lm-prepare reads a decoder-only task's targets: rekey its text to 'targets' and "
         r"tokenize it, as c4_v310_lm in data_pipelines/seqio_tasks.py does$"),
        ("local_c4", dict(splits={"validation": "test"}), r"seqio task 'local_c4' has no split 'test' \(its "
         r"splits: train, validation\); give --seqio_splits=train,validation=SPLIT to take our 'validation' "
         r"split from one of its$"),
        # The built-in C4 task, offline: TFDS c4/en:3.1.0 is not in the TFDS data dir given.
        (seqio_tasks.C4_TASK, dict(modules=(), tfds_data_dir="{tmp}/tfds"), rf"seqio task "
         rf"'{seqio_tasks.C4_TASK}' cannot list its splits .*; it reads TFDS c4/en:3.1.0 from {{tmp}}/tfds: "
         r"build it there first"),
    ])
def test_a_mistake_is_one_message_that_names_the_task_and_the_fix(tasks_dir, tmp_path, name, kw, message):
  kw = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in kw.items()}
  with pytest.raises(ValueError, match="^" + message.replace("{tmp}", re.escape(str(tmp_path)))):
    _prepare(name, tmp_path / "a", **kw)
  assert not (tmp_path / "a").exists(), "nothing is written for a refused preparation"


def test_split_and_shard_flags():
  assert seqio_prepare.parse_splits("train,validation=test") == {"train": "train", "validation": "test"}
  assert seqio_prepare.parse_shards("train=64", ["train", "validation"]) == {"train": 64, "validation": 8}
  assert seqio_prepare.parse_shards("3", ["train", "validation"]) == {"train": 3, "validation": 3}
  for wrong in ("0", "test=4", "many"):
    with pytest.raises(
        ValueError, match=rf"^--seqio_shards={wrong}: give a count of 1 or more for each "
        r"split, or SPLIT=COUNT pairs of the splits train, validation$"):
      seqio_prepare.parse_shards(wrong, ["train", "validation"])


@pytest.mark.slow
def test_lm_prepare_names_an_unknown_task_in_one_line(tasks_dir, tmp_path):
  root, _ = tasks_dir
  result = subprocess.run(
      [sys.executable, "-m", "launch.prepare", "--seqio_task=c4_v31_lm", f"--output={tmp_path / 'out'}"],
      capture_output=True, text=True, env={
          **os.environ, "PYTHONPATH": str(root)
      }, timeout=300)
  assert result.returncode == 1
  assert result.stderr == ("lm-prepare: no seqio task or mixture 'c4_v31_lm' is registered (near names: "
                           "c4_v310_lm); give the name as its module registers it, and --seqio_module="
                           "PKG.MODULE for each module that registers it\n")
