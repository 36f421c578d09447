"""Text and JSON(.gz) files → ArrayRecord shards that `data.source=array_record` reads (the library
of `lm-prepare`, whose command line is launch/prepare.py).

Inputs: `.json`/`.jsonl` files of one JSON object with a "text" field per line (C4's own format,
{"text", "url", "timestamp"}), `.txt` files that are one document each; any of them gzipped (`.gz`).
Globs may be local or gs://. Every input file becomes one output shard, written by a pool of worker
processes; a shard counts as done once its stats file (documents, UTF-8 bytes, tokens, and the name
and size of the input it was made from) exists, so a run that was interrupted picks up where it
stopped when started again with the same arguments; other inputs stop with a message.
With --pretokenize a record holds the document's token ids (as the training pipeline would make them)
and DIR/tokenized_by.json records the tokenizer, which training then insists on.
"""

import functools
import gzip
import itertools
import json
import multiprocessing
import os
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import tqdm
from etils import epath

from data_pipelines import records, storage, tokenizer as tokenizer_lib

GROUP = 256  # documents per SentencePiece call when pre-tokenizing


def expand(patterns: str) -> list[epath.Path]:
  """Comma-separated globs (local or gs://; wildcards in the file name) → sorted files. A path
  without wildcards must exist: a typo is an error, not a file silently left out."""
  files = []
  for pattern in filter(None, patterns.split(",")):
    path = epath.Path(pattern)
    if any(c in path.name for c in "*?["):
      files += path.parent.glob(path.name)
    elif path.is_dir():
      raise ValueError(f"input {pattern} is a directory; give its files, e.g. {path}/*.json.gz")
    elif path.exists():
      files.append(path)
    else:
      raise FileNotFoundError(f"input {pattern} does not exist")
  return sorted(set(f for f in files if f.exists()))


def documents(path: epath.Path) -> Iterator[str]:
  """The texts of one input file. A file that is not what its name says (gzip, UTF-8, JSON lines)
  is a ValueError naming the file (and the line)."""
  name = path.name.removesuffix(".gz")
  if not name.endswith((".txt", ".json", ".jsonl")):
    raise ValueError(f"{path}: unknown input format; expected .txt, .json or .jsonl (optionally .gz)")
  n = 0
  try:
    with path.open("rb") as raw:
      f = gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw
      if name.endswith(".txt"):
        yield f.read().decode("utf-8")
        return
      for n, line in enumerate(f, 1):  # bytes, decoded per line: an error names its line
        if line.strip():
          try:
            yield json.loads(line.decode("utf-8"))["text"]
          except UnicodeDecodeError:
            raise
          except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}, line {n}: not a JSON object with a \"text\" field") from e
  except UnicodeDecodeError as e:
    where = f", line {n}" if n else ""
    raise ValueError(f"{path}{where}: not UTF-8 text (byte {e.object[e.start]:#x} at {e.start})") from e
  except (gzip.BadGzipFile, EOFError, zlib.error) as e:
    raise ValueError(f"{path}: not a complete gzip file ({e or 'it ends early'}); download it again") from e


def _stats_of(texts: Iterator[str], stats: dict) -> Iterator[str]:
  for text in texts:
    stats["documents"] += 1
    stats["bytes"] += len(text.encode("utf-8"))
    yield text


def _tokenized(texts: Iterator[str], tok: tokenizer_lib.Tokenizer, stats: dict):
  while group := list(itertools.islice(texts, GROUP)):
    for ids in tok.encode_batch(group):
      stats["tokens"] += len(ids)
      yield ids


def convert(job: tuple[str, str, str], tokenizer: str) -> dict:
  """Writes one input file as one shard (unless done before); returns the shard's stats."""
  source, shard, split = epath.Path(job[0]), epath.Path(job[1]), job[2]
  stats_file = records.stats_path(shard)
  if stats_file.exists():
    return {"split": split, "skipped": True, **json.loads(stats_file.read_text())}
  # What the shard was made from: it counts as done for the same input only (_check_made_from).
  stats = {
      "source": os.fspath(source),
      "source_bytes": source.stat().length,
      "documents": 0,
      "bytes": 0,
      "tokens": 0
  }
  texts = _stats_of(documents(source), stats)
  if tokenizer:
    records.write_shard(shard, _tokenized(texts, _worker_tokenizer(tokenizer), stats), records.to_ids)
  else:
    records.write_shard(shard, ({"text": t} for t in texts))
  records.write_stats(shard, stats)  # last: the shard is done only once its stats exist
  return {"split": split, "skipped": False, **stats}


def _check_made_from(jobs: list[tuple[str, str, str]]) -> None:
  """Refuses to keep finished shards that other inputs made (another file name or size)."""
  for source, shard, _ in jobs:
    stats_file = records.stats_path(epath.Path(shard))
    if not stats_file.exists():
      continue
    saved, size = json.loads(stats_file.read_text()), epath.Path(source).stat().length
    if (epath.Path(saved["source"]).name != epath.Path(source).name or
        saved.get("source_bytes", size) != size):
      raise ValueError(
          f"{stats_file.name.removesuffix('.json')} in {stats_file.parent.parent} was made from "
          f"{saved['source']} ({saved.get('source_bytes', '?')} bytes), not from {source} ({size} "
          f"bytes): the directory holds a preparation of other inputs; use an empty --output "
          f"directory, or give the inputs it was made from")


@functools.cache
def _worker_tokenizer(path: str) -> tokenizer_lib.Tokenizer:
  return tokenizer_lib.Tokenizer(path)


def check_output(output: epath.Path, sha256: str | None, counts: dict[str, int]) -> None:
  """Refuses to mix shards of another preparation (other inputs, format or tokenizer) into output;
  sha256: the tokenizer model's of pre-tokenized shards, None for text shards."""
  stamp = output / records.TOKENIZED_BY
  for split, n in counts.items():
    others = [p.name for p in output.glob(f"{split}.array_record-*") if not p.name.endswith(f"-of-{n:05d}")]
    if others:
      raise ValueError(f"{output} holds {others[0]}, from a preparation with another number of "
                       f"'{split}' files; use an empty --output directory")
  if stamp.exists():
    if sha256 is None:
      raise ValueError(f"{output} holds pre-tokenized shards; add --pretokenize --tokenizer=... "
                       f"or use an empty --output directory")
    if json.loads(stamp.read_text())["sha256"] != sha256:
      raise ValueError(f"{output} was pre-tokenized with another tokenizer ({stamp}); use an empty "
                       f"--output directory")
  elif sha256 is not None and list(output.glob("*.array_record-*")):
    raise ValueError(f"{output} holds text shards; pre-tokenize into an empty --output directory")


def prepare(splits: dict[str, list[epath.Path]], output: epath.Path, *, tokenizer: str = "",
            pretokenize: bool = False, workers: int = 1, progress: bool = True) -> dict[str, dict]:
  """Converts every split's files into shards in output; returns per-split totals."""
  if pretokenize and not tokenizer:
    raise ValueError("--pretokenize needs --tokenizer=MODEL (a SentencePiece .model file)")
  tok = tokenizer_lib.Tokenizer(tokenizer) if pretokenize else None
  output.mkdir(parents=True, exist_ok=True)
  (output / "stats").mkdir(exist_ok=True)
  check_output(output, tok.sha256 if tok else None, {s: len(files) for s, files in splits.items()})
  if tok is not None:
    storage.write_bytes(output / records.TOKENIZED_BY, json.dumps(tok.fingerprint(), indent=1).encode())
  jobs = [(os.fspath(f), os.fspath(output / records.shard_name(split, i, len(files))), split)
          for split, files in splits.items()
          for i, f in enumerate(files)]
  _check_made_from(jobs)
  totals = {
      s: {
          "files": len(f),
          "documents": 0,
          "bytes": 0,
          "tokens": 0,
          "skipped": 0
      } for s, f in splits.items()
  }
  work = functools.partial(convert, tokenizer=tokenizer if pretokenize else "")
  return run_jobs(work, jobs, [shard for _, shard, _ in jobs], totals, workers=workers, progress=progress)


def run_jobs(work: Callable[[Any], dict], jobs: list, shards: list[str], totals: dict[str, dict], *,
             workers: int, progress: bool) -> dict[str, dict]:
  """work(job) for every job in a pool of spawned processes, each job writing the shard of the same
  index in `shards` and returning its stats, which are added to its split's totals."""
  try:
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
      bar = tqdm.tqdm(pool.imap_unordered(work, jobs), total=len(jobs), unit="shard", disable=not progress)
      for done in bar:
        if not done["documents"]:
          bar.write(f"warning: {done['source']} holds no documents")
        t = totals[done["split"]]
        t["skipped"] += done["skipped"]
        for k in ("documents", "bytes", "tokens"):
          t[k] += done[k]
        bar.set_postfix(documents=sum(t["documents"] for t in totals.values()))
  except BaseException:
    # The pool stopped its workers mid-shard: their partial files go (on a full disk, that space is
    # the user's); finished shards stay, and a rerun redoes the rest.
    for shard in shards:
      storage.discard_partial(shard)
    raise
  return totals
