"""C4's two on-disk forms, generated small: AllenAI-style json.gz shards through `lm-prepare`, and a
TFDS c4/en:3.1.0 ArrayRecord dataset read by the real `tfds.data_source`."""

import collections
import gzip
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import filesystems
import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds
from conftest import make_documents
from etils import epath
from small import small_config

from data_pipelines import pipeline, prepare, records, sources, tokenizer
from lm.experiment import Experiment

tfds.disable_progress_bar()

with tfds.core.registered.skip_registration():

  class C4(tfds.core.GeneratorBasedBuilder):
    """Writes C4's TFDS layout and features ({text, url, timestamp}) from generated documents."""
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="en")]
    VERSION = tfds.core.Version("3.1.0")

    def __init__(self, docs, **kw):
      self.docs = docs
      super().__init__(**kw)

    def _info(self):
      text = tfds.features.Text()
      return tfds.core.DatasetInfo(
          builder=self, features=tfds.features.FeaturesDict({
              "text": text,
              "url": text,
              "timestamp": text
          }))

    def _split_generators(self, dl_manager):
      return {split: self._generate_examples(docs) for split, docs in self.docs.items()}

    def _generate_examples(self, docs):
      for doc in docs:
        yield doc["url"], doc


def c4_documents(n: int, seed: int) -> list[dict]:
  """Generated documents in C4's JSON shape, with non-ASCII text (bytes ≠ characters)."""
  docs = make_documents(n, seed)
  for i, d in enumerate(docs):
    d["text"] = d["text"].replace("moon", "mōon —")
    d["timestamp"] = f"2019-04-{i % 28 + 1:02d}T00:00:00Z"
  return docs


def _tok(corpus) -> tokenizer.Tokenizer:
  return tokenizer.Tokenizer(tokenizer.model_path(corpus, 320))


def _transitions(docs: list[dict], tok) -> collections.Counter:
  pairs = collections.Counter()
  for d in docs:
    ids = tok.encode(d["text"])
    pairs.update(zip(ids[:-1].tolist(), ids[1:].tolist()))
  return pairs


def _predicted(batches) -> collections.Counter:
  pairs = collections.Counter()
  for b in batches:
    w = b["weights"] > 0
    pairs.update(zip(b["inputs"][w].tolist(), b["targets"][w].tolist()))
  return pairs


@pytest.fixture(scope="module")
def c4_docs():
  return {"train": c4_documents(60, 10), "validation": c4_documents(24, 11)}


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory, c4_docs):
  root = tmp_path_factory.mktemp("tfds")
  C4(c4_docs, data_dir=str(root), file_format="array_record").download_and_prepare()
  return root


@pytest.fixture(scope="module")
def allenai_files(tmp_path_factory, c4_docs):
  """c4-{split}.0000i-of-0000n.json.gz files as AllenAI distributes C4."""
  root = tmp_path_factory.mktemp("allenai")
  for split, docs in c4_docs.items():
    n = 3 if split == "train" else 2
    for i in range(n):
      with gzip.open(root / f"c4-{split}.{i:05d}-of-{n:05d}.json.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs[i::n])
  return root


def _prepare(allenai_files, output, **kw):
  splits = {s: prepare.expand(f"{allenai_files}/c4-{s}.*.json.gz") for s in ("train", "validation")}
  return prepare.prepare(splits, epath.Path(output), progress=False, **kw)


def _data_cfg(source, data_dir, tok_path, **kw):
  return ml_collections.ConfigDict(dict(source=source, dir=str(data_dir), tokenizer=str(tok_path), **kw))


@pytest.mark.slow
def test_tfds_c4_validation_every_target_once_sharded_and_bytes(tfds_dir, c4_docs, small_corpus):
  tok = _tok(small_corpus)
  data = sources.resolve(_data_cfg("c4", tfds_dir, tok.path), 320)
  assert (len(data.train.source), len(data.validation.source)) == (60, 24)
  parts = [
      _predicted(
          pipeline.eval_dataset(data.validation, tok, seq_len=16, batch_size=4, shard=pipeline.Shard(i, 2)))
      for i in range(2)
  ]
  assert parts[0] + parts[1] == _transitions(c4_docs["validation"], tok)
  assert pipeline.split_bytes(data.validation) == sum(
      len(d["text"].encode("utf-8")) for d in c4_docs["validation"])
  assert pipeline.split_bytes(data.validation) > sum(len(d["text"]) for d in c4_docs["validation"])


def test_tfds_c4_per_host_shards_partition_train_and_resume_exactly(tfds_dir, small_corpus):
  tok = _tok(small_corpus)
  docs = sources.tfds_split(tfds_dir, "train")
  everything = sorted(docs.text(docs.source[i]) for i in range(len(docs.source)))
  seen = []
  for j in range(3):
    epoch = pipeline.epochs(docs, seed=1, shard=pipeline.Shard(j, 3))
    seen += [docs.text(epoch[i]) for i in range(len(range(j, 60, 3)))]
  assert sorted(seen) == everything  # no overlap, no gap across process indices

  make = lambda: iter(
      pipeline.train_dataset(docs, tok, seq_len=16, batch_size=4, seed=3, shard=pipeline.Shard(1, 2),
                             packing_bins=4))
  it = make()
  for _ in range(25):  # past the end of the shard's first epoch
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(4)]
  resumed = make()
  resumed.set_state(json.loads(json.dumps(state)))  # as a checkpoint stores it
  for want in expected:
    got = next(resumed)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.slow
def test_tfds_c4_evaluation_is_token_weighted_with_bits_per_byte(tfds_dir, c4_docs, small_corpus):
  c = small_config(small_corpus)
  c.data.update(source="c4", dir=str(tfds_dir), tokenizer=str(_tok(small_corpus).path), seq_len=16)
  c.eval.batch_size = 4
  exp = Experiment(c)
  result = exp.evaluate(exp.init_state().params, exp.eval_sets()["validation"]())
  n = sum(_transitions(c4_docs["validation"], _tok(small_corpus)).values())
  text_bytes = sum(len(d["text"].encode("utf-8")) for d in c4_docs["validation"])
  assert result["tokens"] == n
  assert result["bits_per_byte"] == pytest.approx(result["loss"] * n / math.log(2) / text_bytes)


def test_missing_or_unconvertible_tfds_data_fail_clearly(tmp_path, tfds_dir, small_corpus):
  cfg = _data_cfg("c4", tmp_path, _tok(small_corpus).path)
  with pytest.raises(
      FileNotFoundError, match=r"c4/en/3.1.0/dataset_info.json is missing.*"
      r"tfds build c4/en:3.1.0.*lm-prepare"):
    sources.resolve(cfg, 320)
  version = tmp_path / "c4" / "en" / "3.1.0"
  version.mkdir(parents=True)
  (version / "dataset_info.json").write_text((tfds_dir / "c4/en/3.1.0/dataset_info.json").read_text())
  (version / "c4-train.tfrecord-00000-of-00001").write_bytes(b"")
  with pytest.raises(FileNotFoundError, match="as TFRecord.*tfds convert_format"):
    sources.resolve(cfg, 320)
  with pytest.raises(ValueError, match="model.V=999 but the tokenizer .* has 320 pieces"):
    sources.resolve(_data_cfg("c4", tfds_dir, _tok(small_corpus).path), 999)
  with pytest.raises(ValueError, match="data.tokenizer is empty"):
    sources.resolve(_data_cfg("c4", tfds_dir, ""), 320)


def test_a_tfds_split_missing_a_shard_names_it(tmp_path, tfds_dir, small_corpus):
  """Nothing checked that all N shards of a `-of-N` set were there."""
  version = tmp_path / "c4" / "en" / "3.1.0"
  version.mkdir(parents=True)
  (version / "dataset_info.json").write_text((tfds_dir / "c4/en/3.1.0/dataset_info.json").read_text())
  (version / "c4-train.array_record-00000-of-00002").write_bytes(b"")
  with pytest.raises(FileNotFoundError) as e:
    sources.resolve(_data_cfg("c4", tmp_path, _tok(small_corpus).path), 320)
  assert str(e.value) == (
      f"{version}/c4-train.array_record-00001-of-00002 is missing: the 'train' split in {version} has 1 of "
      f"its 2 shards; copy it again from where the dataset was built, or build it again with `tfds build "
      f"c4/en:3.1.0 --data_dir={tmp_path} --file_format=array_record`")


@pytest.mark.slow
def test_lm_prepare_converts_json_gz_shards(tmp_path, allenai_files, c4_docs, small_corpus):
  out = tmp_path / "text"
  result = subprocess.run([
      sys.executable, "-m", "launch.prepare", f"--train={allenai_files}/c4-train.*.json.gz",
      f"--validation={allenai_files}/c4-validation.*.json.gz", f"--output={out}", "--workers=2"
  ], capture_output=True, text=True, check=True)
  totals = json.loads(result.stdout[result.stdout.index("{"):])
  assert totals["train"]["documents"] == 60 and totals["validation"]["files"] == 2
  assert totals["validation"]["bytes"] == sum(len(d["text"].encode()) for d in c4_docs["validation"])
  assert "5/5" in result.stderr  # the progress bar reached the end
  tok = _tok(small_corpus)
  data = sources.resolve(_data_cfg("array_record", out, tok.path), 320)
  assert sorted(data.train.text(r) for r in data.train.source) == sorted(d["text"] for d in c4_docs["train"])
  batches = pipeline.eval_dataset(data.validation, tok, seq_len=16, batch_size=4)
  assert _predicted(batches) == _transitions(c4_docs["validation"], tok)


@pytest.mark.slow
def test_lm_prepare_resumes_after_being_killed(tmp_path):
  inputs, out = tmp_path / "in", tmp_path / "out"
  inputs.mkdir()
  texts = [f"document {i} " + "the quick brown fox " * (i % 50) for i in range(120_000)]
  for i in range(12):
    (inputs / f"part-{i:02d}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[i::12]))
  cmd = [
      sys.executable, "-m", "launch.prepare", f"--train={inputs}/part-*.jsonl",
      f"--validation={inputs}/part-00.jsonl", f"--output={out}", "--workers=1"
  ]
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
  stats = out / "stats"
  while not (stats.exists() and list(stats.glob("train.*.json"))):
    assert proc.poll() is None, "lm-prepare ended before it could be interrupted"
    time.sleep(0.005)
  os.killpg(proc.pid, signal.SIGKILL)  # the pool's workers too, mid-shard
  proc.wait()
  finished = {p.name: p.stat().st_mtime_ns for p in stats.glob("train.*.json")}
  assert 0 < len(finished) < 12
  shards = {name: (out / name.removesuffix(".json")).stat().st_mtime_ns for name in finished}

  splits = {
      "train": prepare.expand(f"{inputs}/part-*.jsonl"),
      "validation": prepare.expand(f"{inputs}/part-00.jsonl")
  }
  totals = prepare.prepare(splits, epath.Path(out), progress=False)
  assert totals["train"]["skipped"] == len(finished) and totals["train"]["documents"] == len(texts)
  assert {n: (out / n.removesuffix(".json")).stat().st_mtime_ns for n in finished} == shards
  docs = records.open_split(out, "train")
  assert sorted(docs.text(r) for r in docs.source) == sorted(texts)  # each exactly once
  assert not list(out.glob(".*.tmp"))  # the killed shard's partial file was redone and renamed


@pytest.mark.slow
def test_pretokenized_path_equals_raw_path_and_refuses_another_tokenizer(tmp_path, allenai_files,
                                                                         small_corpus):
  tok = _tok(small_corpus)
  _prepare(allenai_files, tmp_path / "text")
  _prepare(allenai_files, tmp_path / "ids", tokenizer=str(tok.path), pretokenize=True)
  raw = sources.resolve(_data_cfg("array_record", tmp_path / "text", tok.path), 320)
  ids = sources.resolve(_data_cfg("array_record", tmp_path / "ids", ""), 320)  # recorded model
  assert ids.train.format == records.TOKENS and ids.tokenizer.sha256 == tok.sha256
  for make in (lambda d: pipeline.train_dataset(d.train, tok, seq_len=16, batch_size=4, seed=2),
               lambda d: pipeline.eval_dataset(d.validation, tok, seq_len=16, batch_size=4)):
    for a, b in zip(_take(make(raw), 12), _take(make(ids), 12), strict=True):
      for k in a:
        np.testing.assert_array_equal(a[k], b[k])
  assert pipeline.split_bytes(ids.validation) == pipeline.split_bytes(raw.validation)

  other = tmp_path / "other.model"
  tokenizer.train(records.shard_paths(tmp_path / "text", "train"), other, 300)
  with pytest.raises(ValueError, match="pre-tokenized by .* but data.tokenizer is .*other.model"):
    sources.resolve(_data_cfg("array_record", tmp_path / "ids", other), 300)
  with pytest.raises(ValueError, match="pre-tokenized with another tokenizer"):
    _prepare(allenai_files, tmp_path / "ids", tokenizer=str(other), pretokenize=True)
  with pytest.raises(ValueError, match="holds pre-tokenized shards"):
    _prepare(allenai_files, tmp_path / "ids")


def _take(dataset, n):
  it = iter(dataset)
  return [b for b, _ in zip(it, range(n))]


def test_text_and_jsonl_inputs(tmp_path):
  (tmp_path / "a.txt").write_text("one whole document\nover two lines")
  with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
    f.write('{"text": "first"}\n\n{"text": "second", "url": "x"}\n')
  (tmp_path / "c.json").write_text('{"title": "no text"}\n')
  assert list(prepare.documents(epath.Path(tmp_path / "a.txt"))) == ["one whole document\nover two lines"]
  assert list(prepare.documents(epath.Path(tmp_path / "b.jsonl.gz"))) == ["first", "second"]
  with pytest.raises(ValueError, match=r"c.json, line 1: not a JSON object with a \"text\" field"):
    list(prepare.documents(epath.Path(tmp_path / "c.json")))
  assert prepare.expand(f"{tmp_path}/*.txt,{tmp_path}/b.jsonl.gz") == [
      tmp_path / "a.txt", tmp_path / "b.jsonl.gz"
  ]


@pytest.mark.slow
def test_prepare_refuses_a_directory_made_from_other_inputs(tmp_path):
  """Finished shards count as done for the inputs they were made from only."""

  def inputs(name: str, texts: list[str]) -> str:
    folder = tmp_path / name
    folder.mkdir()
    for i, t in enumerate(texts):
      (folder / f"part-{i}.jsonl").write_text(json.dumps({"text": t}) + "\n")
    return f"{folder}/part-*.jsonl"

  def run(pattern: str):
    splits = {"train": prepare.expand(pattern), "validation": prepare.expand(pattern)}
    return prepare.prepare(splits, epath.Path(tmp_path / "out"), progress=False)

  first = inputs("a", ["one", "two"])
  run(first)
  assert run(first)["train"]["skipped"] == 2  # the same inputs: done, kept
  with pytest.raises(
      ValueError, match=r"train.array_record-00000-of-00002 in .*out was made from "
      r".*a/part-0.jsonl \(16 bytes\), not from .*b/part-0.jsonl \(22 bytes\)"):
    run(inputs("b", ["other one", "other two"]))  # same names and count, other contents
  docs = records.open_split(tmp_path / "out", "train")
  assert sorted(docs.text(r) for r in docs.source) == ["one", "two"]


@pytest.mark.parametrize("name, content, message", [
    ("a.jsonl.gz", b'{"text": "plain"}\n', r"a.jsonl.gz: not a complete gzip file"),
    ("b.jsonl.gz", gzip.compress(b'{"text": "cut"}\n' * 50,
                                 mtime=0)[:-30], r"b.jsonl.gz: not a complete gzip file"),
    ("c.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n', r"c.jsonl, line 2: not UTF-8 text \(byte 0xe9"),
    ("d.txt", b"caf\xe9", r"d.txt: not UTF-8 text \(byte 0xe9 at 3\)"),
], ids=["not_gzip", "truncated_gzip", "jsonl_not_utf8", "txt_not_utf8"])
def test_unreadable_inputs_name_the_file_and_line(tmp_path, name, content, message):
  (tmp_path / name).write_bytes(content)
  with pytest.raises(ValueError, match=message):
    list(prepare.documents(epath.Path(tmp_path / name)))


def test_a_listed_input_that_does_not_exist_is_an_error(tmp_path):
  (tmp_path / "a.txt").write_text("x")
  with pytest.raises(FileNotFoundError, match=r"input .*/b.txt does not exist"):
    prepare.expand(f"{tmp_path}/a.txt,{tmp_path}/b.txt")
  with pytest.raises(ValueError, match=r"input .* is a directory; give its files, e.g. .*/\*.json.gz"):
    prepare.expand(str(tmp_path))
  assert prepare.expand(f"{tmp_path}/*.txt,{tmp_path}/*.json") == [epath.Path(tmp_path / "a.txt")]


@pytest.mark.slow
def test_an_empty_input_is_prepared_with_a_warning(tmp_path, capsys):
  (tmp_path / "full.jsonl").write_text('{"text": "words"}\n')
  (tmp_path / "empty.jsonl").write_text("")
  splits = {
      "train": prepare.expand(f"{tmp_path}/*.jsonl"),
      "validation": prepare.expand(f"{tmp_path}/full.jsonl")
  }
  totals = prepare.prepare(splits, epath.Path(tmp_path / "out"), progress=False)
  assert totals["train"]["documents"] == 1
  assert f"warning: {tmp_path}/empty.jsonl holds no documents" in capsys.readouterr().out


# Where mounting a small file system is not permitted: ArrayRecord's writer fails on the second
# train shard as it does on a full disk (every process imports sitecustomize, the pool's too).
FULL_DISK_WITHOUT_A_MOUNT = """
from data_pipelines import records

class _Writer:
  def __init__(self, path, options):
    self.path = path
  def write(self, record):
    if "train.array_record-00001" in self.path:
      raise ValueError("write() failed: No space left on device; writing " + self.path)
  def close(self):
    open(self.path, "wb").close()

records.array_record_module = type("array_record_module", (), {"ArrayRecordWriter": _Writer})
"""


@pytest.mark.slow
def test_lm_prepare_on_a_full_disk_is_one_line_and_the_rerun_resumes(tmp_path):
  """A file system with room for one train shard of three: one line names the shard, the file
  system and the fix; the finished shard is kept (the rerun, with room, skips it) and no partial
  file is left."""
  inputs, disk = tmp_path / "in", tmp_path / "disk"
  inputs.mkdir()
  rng = np.random.default_rng(0)
  words = np.array("the quick brown fox jumps over a lazy dog while seven wise kings sing".split())
  for name in ("train-0", "train-1", "train-2", "validation-0"):
    lines = (json.dumps({"text": " ".join(rng.choice(words, 300))}) + "\n" for _ in range(400))
    (inputs / f"{name}.json").write_text("".join(lines))
  with filesystems.small(disk, "400k") as mounted:
    out = disk / "data"
    cmd = [
        sys.executable, "-m", "launch.prepare", f"--train={inputs}/train-*.json",
        f"--validation={inputs}/validation-0.json", f"--output={out}", "--workers=1"
    ]
    if not mounted:
      (tmp_path / "sitecustomize.py").write_text(FULL_DISK_WITHOUT_A_MOUNT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.path.dirname(__file__)])}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    match = re.fullmatch(
        rf"lm-prepare: no space left on device: cannot write ({re.escape(str(out))}/\S+) \(on the file "
        r"system mounted at (\S+), [\d.]+ MB free\); free space on it; then run the same command "
        r"again: it keeps the finished shards and redoes the rest",
        result.stderr.splitlines()[-1])
    assert match and (not mounted or match[2] == str(disk)), result.stderr[-3000:]
    assert match[1] == str(out / "train.array_record-00001-of-00003")
    assert [p.name for p in (out / "stats").iterdir()] == ["train.array_record-00000-of-00003.json"]
    assert not list(out.glob(".*.tmp")), "a partial shard was left"
    if mounted:
      subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)
      result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
      assert result.returncode == 0, result.stderr[-3000:]
      totals = json.loads(result.stdout)
      assert totals["train"]["skipped"] == 1 and totals["train"]["documents"] == 1200


@pytest.mark.slow
def test_lm_prepare_into_an_output_that_is_a_file_names_it(tmp_path):
  (tmp_path / "in.txt").write_text("a document")
  (tmp_path / "out").write_text("notes")
  result = subprocess.run([
      sys.executable, "-m", "launch.prepare", f"--train={tmp_path}/in.txt", f"--validation={tmp_path}/in.txt",
      f"--output={tmp_path}/out", "--workers=1"
  ], capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  assert result.stderr == f"lm-prepare: --output={tmp_path}/out is a file; give a directory (it is created if missing)\n"


@pytest.mark.slow
@pytest.mark.parametrize("train, extra, message", [
    ("{d}/b.txt", [], "input {d}/b.txt does not exist"),
    ("{d}", [], "input {d} is a directory; give its files, e.g. {d}/*.json.gz"),
    ("{d}/a.txt", ["--workers=0"], "--workers=0: give 1 or more worker processes"),
    ("{d}/a.txt", ["--seqio_task=c4_v310_lm"
                  ], "--seqio_task takes its text and vocabulary from the task; drop --train, --validation"),
])
def test_lm_prepare_input_mistakes_are_one_line(tmp_path, train, extra, message):
  """From the command, not only the library: a listed input that does not exist was a traceback."""
  (tmp_path / "a.txt").write_text("a document")
  result = subprocess.run([
      sys.executable, "-m", "launch.prepare", f"--train={train.format(d=tmp_path)}",
      f"--validation={tmp_path}/a.txt", f"--output={tmp_path}/out", *extra
  ], capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  assert result.stderr == f"lm-prepare: {message.format(d=tmp_path)}\n"


@pytest.mark.slow
def test_lm_prepare_without_inputs_or_without_the_seqio_extra_names_the_fix(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "launch.prepare", f"--train={tmp_path}/*.txt", f"--output={tmp_path}"],
      capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  assert result.stderr == "lm-prepare: give --train=GLOB and --validation=GLOB, or --seqio_task=NAME\n"
  if importlib.util.find_spec("seqio"):
    pytest.skip("seqio is installed here: tests/test_seqio.py covers --seqio_task")
  result = subprocess.run(
      [sys.executable, "-m", "launch.prepare", "--seqio_task=c4_v310_lm", f"--output={tmp_path}"],
      capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  assert result.stderr == (
      "lm-prepare: --seqio_task needs the seqio extra (No module named 'seqio'): pip install "
      "-e '.[seqio]', in a venv of its own (docs/guides/seqio.md)\n")
