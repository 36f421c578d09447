"""Text and JSON(.gz) files → ArrayRecord shards that `data.source=array_record` reads (the library
of `lm-prepare`, whose command line is launch/prepare.py).

Inputs: `.json`/`.jsonl` files of one JSON object with a "text" field per line (C4's own format,
{"text", "url", "timestamp"}), `.txt` files that are one document each; any of them gzipped (`.gz`).
Globs may be local or gs://. Every input file becomes one output shard, written by a pool of worker
processes; a shard counts as done once its stats file (documents, UTF-8 bytes, tokens) exists, so a
run that was interrupted picks up where it stopped when started again with the same arguments.
With --pretokenize a record holds the document's token ids (as the training pipeline would make them)
and DIR/tokenized_by.json records the tokenizer, which training then insists on.
"""

import functools
import gzip
import io
import itertools
import json
import multiprocessing
import os
from typing import Iterator

import tqdm
from etils import epath

from data_pipelines import records, storage, tokenizer as tokenizer_lib

GROUP = 256  # documents per SentencePiece call when pre-tokenizing


def expand(patterns: str) -> list[epath.Path]:
  """Comma-separated globs (local or gs://; wildcards in the file name) → sorted files."""
  files = []
  for pattern in filter(None, patterns.split(",")):
    path = epath.Path(pattern)
    files += path.parent.glob(path.name) if any(c in path.name for c in "*?[") else [path]
  return sorted(set(f for f in files if f.exists()))


def documents(path: epath.Path) -> Iterator[str]:
  """The texts of one input file."""
  name = path.name.removesuffix(".gz")
  with path.open("rb") as raw:
    f = gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw
    if name.endswith(".txt"):
      yield f.read().decode("utf-8")
    elif name.endswith((".json", ".jsonl")):
      for n, line in enumerate(io.TextIOWrapper(f, encoding="utf-8"), 1):
        if line.strip():
          try:
            yield json.loads(line)["text"]
          except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}, line {n}: not a JSON object with a \"text\" field") from e
    else:
      raise ValueError(f"{path}: unknown input format; expected .txt, .json or .jsonl (optionally .gz)")


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
  stats = {"source": os.fspath(source), "documents": 0, "bytes": 0, "tokens": 0}
  texts = _stats_of(documents(source), stats)
  if tokenizer:
    records.write_shard(shard, _tokenized(texts, _worker_tokenizer(tokenizer), stats), records.to_ids)
  else:
    records.write_shard(shard, ({"text": t} for t in texts))
  records.write_stats(shard, stats)  # last: the shard is done only once its stats exist
  return {"split": split, "skipped": False, **stats}


@functools.cache
def _worker_tokenizer(path: str) -> tokenizer_lib.Tokenizer:
  return tokenizer_lib.Tokenizer(path)


def _check_output(output: epath.Path, tok: tokenizer_lib.Tokenizer | None,
                  counts: dict[str, int]) -> None:
  """Refuses to mix shards of another preparation (other inputs, format or tokenizer) into output."""
  stamp = output / records.TOKENIZED_BY
  for split, n in counts.items():
    others = [p.name for p in output.glob(f"{split}.array_record-*")
              if not p.name.endswith(f"-of-{n:05d}")]
    if others:
      raise ValueError(f"{output} holds {others[0]}, from a preparation with another number of "
                       f"'{split}' files; use an empty --output directory")
  if stamp.exists():
    if tok is None:
      raise ValueError(f"{output} holds pre-tokenized shards; add --pretokenize --tokenizer=... "
                       f"or use an empty --output directory")
    if json.loads(stamp.read_text())["sha256"] != tok.sha256:
      raise ValueError(f"{output} was pre-tokenized with another tokenizer ({stamp}); use an empty "
                       f"--output directory")
  elif tok is not None and list(output.glob("*.array_record-*")):
    raise ValueError(f"{output} holds text shards; pre-tokenize into an empty --output directory")


def prepare(splits: dict[str, list[epath.Path]], output: epath.Path, *, tokenizer: str = "",
            pretokenize: bool = False, workers: int = 1, progress: bool = True) -> dict[str, dict]:
  """Converts every split's files into shards in output; returns per-split totals."""
  if pretokenize and not tokenizer:
    raise ValueError("--pretokenize needs --tokenizer=MODEL (a SentencePiece .model file)")
  tok = tokenizer_lib.Tokenizer(tokenizer) if pretokenize else None
  output.mkdir(parents=True, exist_ok=True)
  (output / "stats").mkdir(exist_ok=True)
  _check_output(output, tok, {s: len(files) for s, files in splits.items()})
  if tok is not None:
    storage.write_bytes(output / records.TOKENIZED_BY, json.dumps(tok.fingerprint(), indent=1).encode())
  jobs = [(os.fspath(f), os.fspath(output / records.shard_name(split, i, len(files))), split)
          for split, files in splits.items() for i, f in enumerate(files)]
  totals = {s: {"files": len(f), "documents": 0, "bytes": 0, "tokens": 0, "skipped": 0}
            for s, f in splits.items()}
  work = functools.partial(convert, tokenizer=tokenizer if pretokenize else "")
  with multiprocessing.get_context("spawn").Pool(workers) as pool:
    bar = tqdm.tqdm(pool.imap_unordered(work, jobs), total=len(jobs), unit="file",
                    disable=not progress)
    for done in bar:
      t = totals[done["split"]]
      t["skipped"] += done["skipped"]
      for k in ("documents", "bytes", "tokens"):
        t[k] += done[k]
      bar.set_postfix(documents=sum(t["documents"] for t in totals.values()))
  return totals
