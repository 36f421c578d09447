"""Record shards on disk: what a record holds, writing shards whole, opening a split.

Shards are named like TFDS's: `{split}.array_record-00000-of-00004` inside a data directory. A
record is either a JSON object shaped like C4's ({"text": ..., "url": ..., "timestamp": ...}) or,
in a pre-tokenized directory (one with TOKENIZED_BY), a document's token ids as little-endian int32.
Shards that `lm-prepare` wrote have a stats file (documents, UTF-8 bytes, tokens) under `stats/`.
"""

import bisect
import concurrent.futures
import dataclasses
import itertools
import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grain
import numpy as np
from array_record.python import array_record_module
from etils import epath

from data_pipelines import storage

TEXT, TFDS, TOKENS = "text", "tfds", "tokens"  # JSON text records; TFDS feature dicts; token ids
TOKENIZED_BY = "tokenized_by.json"


@dataclasses.dataclass(frozen=True)
class Documents:
  """One split: random-access records (len and [i]) and what they hold."""
  source: Sequence[Any]
  format: str  # TEXT, TFDS or TOKENS
  text_bytes: int | None = None  # UTF-8 bytes of the split's text when known without reading it

  def text(self, record) -> str:
    return decode(record)["text"] if self.format == TEXT else record["text"].decode("utf-8")


def shard_name(split: str, index: int, count: int) -> str:
  return f"{split}.array_record-{index:05d}-of-{count:05d}"


def stats_path(shard: epath.Path) -> epath.Path:
  return shard.parent / "stats" / f"{shard.name}.json"


def write_stats(shard: epath.Path, stats: dict[str, Any]) -> None:
  """Writes a shard's stats (documents, UTF-8 bytes, tokens) whole; lm-prepare writes them last,
  so their presence marks the shard as done."""
  storage.write_bytes(stats_path(shard), json.dumps(stats).encode())


def to_json(record: dict[str, Any]) -> bytes:
  return json.dumps(record, ensure_ascii=False).encode("utf-8")


def to_ids(ids: np.ndarray) -> bytes:
  return np.asarray(ids, "<i4").tobytes()


def write_shard(path: str | os.PathLike, records: Iterable[Any], encode: Callable[[Any],
                                                                                  bytes] = to_json) -> int:
  """Writes records to one ArrayRecord file whole (a crash never leaves a partial shard), local or
  on an object store (ArrayRecord writes local files only: the shard is uploaded when complete)."""
  n = 0
  with storage.written_whole(path) as local:
    # group_size:1 keeps random access cheap: grain reads single records in shuffled order.
    writer = array_record_module.ArrayRecordWriter(local, "group_size:1")
    for record in records:
      writer.write(encode(record))
      n += 1
    writer.close()
  return n


# What fixes a missing or damaged shard of a directory that lm-prepare wrote.
PREPARED_REMEDY = "run the same `lm-prepare` command again: it redoes only the missing shards"


def prepared_remedy(shard: str | os.PathLike, missing: bool) -> str:
  """What fixes a shard of a directory that lm-prepare wrote: missing (True) or damaged."""
  stats = stats_path(epath.Path(shard))
  if missing:
    return f"delete its stats file {stats}, if there is one, and {PREPARED_REMEDY}"
  return f"delete it and its stats file {stats} and {PREPARED_REMEDY}"


Remedy = Callable[[str, bool], str]


def missing_shards(paths: Sequence[str | os.PathLike], split: str, data_dir) -> tuple[str, int] | None:
  """(the first missing shard's path, the set's size) when `-of-N` shards of a set are missing; a
  FileNotFoundError when the shards belong to sets of different sizes."""
  sets: dict[int, set[int]] = {}
  for path in paths:
    name = os.fspath(path).rsplit("/", 1)[-1]
    index, _, count = name.rsplit("-", 3)[-3:] if name.count("-") >= 3 else ("", "", "")
    if index.isdigit() and count.isdigit():
      sets.setdefault(int(count), set()).add(int(index))
  if len(sets) > 1:
    a, b = sorted(sets)[:2]
    raise FileNotFoundError(f"the '{split}' split in {data_dir} holds shards of two sets: -of-{a:05d} and "
                            f"-of-{b:05d}; keep the files of one set only")
  for count, indices in sets.items():
    for i in range(count):
      if i not in indices:
        template = os.fspath(paths[0])
        head = template[:template.rindex("-", 0, template.rindex("-of-"))]
        return f"{head}-{i:05d}-of-{count:05d}", count
  return None


def shard_paths(data_dir: str | os.PathLike, split: str, remedy: Remedy = prepared_remedy) -> list[str]:
  """The split's shards in order; a clear error when there are none, or when some of the set are
  missing (remedy(shard, missing): what to do about one)."""
  data_dir = epath.Path(data_dir)
  paths = sorted(data_dir.glob(f"{split}.array_record-*-of-*"))
  if not paths:
    raise FileNotFoundError(
        f"no '{split}' shards ({split}.array_record-*-of-*) in {data_dir}; prepare the data with "
        f"`lm-prepare` (docs/guides/c4_tpu.md) or point data.dir at a prepared directory")
  if missing := missing_shards(paths, split, data_dir):
    shard, count = missing
    raise FileNotFoundError(f"{shard} is missing: the '{split}' split in {data_dir} has {len(paths)} of its "
                            f"{count} shards; {remedy(shard, True)}")
  return [os.fspath(p) for p in paths]


def open_split(data_dir: str | os.PathLike, split: str, remedy: Remedy = prepared_remedy) -> Documents:
  """A prepared directory's split, text or pre-tokenized; remedy(shard, missing): what fixes a
  missing or damaged shard of this directory."""
  paths = shard_paths(data_dir, split, remedy)
  try:
    source = Shards(paths, remedy)
  except Exception as e:  # array_record names no file, and often gives no reason
    raise ValueError(damaged(paths, remedy) or f"cannot open the '{split}' shards in {data_dir}: {e}") from e
  if not (epath.Path(data_dir) / TOKENIZED_BY).exists():
    return Documents(source, TEXT)
  # Token ids no longer hold the text, so its size comes from what lm-prepare counted.
  stats = [stats_path(epath.Path(p)) for p in paths]
  missing = [s for s in stats if not s.exists()]
  if missing:
    raise FileNotFoundError(f"{missing[0]} is missing: the pre-tokenized '{split}' split in "
                            f"{data_dir} is incomplete; run the same `lm-prepare` command again")
  return Documents(source, TOKENS, sum(json.loads(s.read_text())["bytes"] for s in stats))


@dataclasses.dataclass(frozen=True)
class _WholeShard:
  """All records of one shard, as array_record's public FileInstruction protocol describes them."""
  filename: str
  skip: int
  take: int
  examples_in_shard: int


class Shards(grain.sources.ArrayRecordDataSource):
  """grain's ArrayRecord source, whose read errors (a shard damaged after its index) name the shard
  and the fix; array_record's own name no file. They reach the training loop from grain's threads.

  array_record has no public way to find the shard of a record key, so the shards' record counts
  are taken here (in parallel, as array_record would) and handed to it as FileInstructions, which
  it then does not count again; `ends` maps a key to its shard."""

  def __init__(self, paths: Sequence[str], remedy: Remedy = prepared_remedy):
    self.remedy = remedy
    with concurrent.futures.ThreadPoolExecutor(min(len(paths), 64)) as pool:
      counts = list(pool.map(_num_records, paths))
    super().__init__([_WholeShard(p, 0, n, n) for p, n in zip(paths, counts)])
    self.ends = list(itertools.accumulate(counts))

  def __getitem__(self, key):
    try:
      return super().__getitem__(key)
    except RuntimeError as e:
      path = self.paths[bisect.bisect_right(self.ends, key.__index__())]
      raise ValueError(unreadable(path, str(e).splitlines()[0], self.remedy)) from e

  def __getitems__(self, keys):
    try:
      return super().__getitems__(keys)
    except RuntimeError:
      return [self[k] for k in keys]  # one at a time, to find the shard; raises naming it


def damaged(paths: list[str], remedy: Remedy = prepared_remedy) -> str | None:
  """Names the first shard that does not open as an ArrayRecord file, with the fix."""
  for path in paths:
    try:
      _num_records(path)
    except Exception as e:  # pylint: disable=broad-except
      return unreadable(path, str(e).splitlines()[0] if str(e) else "truncated", remedy)
  return None


def _num_records(path: str) -> int:
  reader = array_record_module.ArrayRecordReader(path)
  n = reader.num_records()
  reader.close()  # a truncated file (its index is at the end) fails here, without a reason
  return n


def unreadable(path: str, reason: str, remedy: Remedy = prepared_remedy) -> str:
  """A damaged shard's line: the shard, why it cannot be read, and what fixes it."""
  return f"{path} is not a readable ArrayRecord shard ({reason}); {remedy(path, False)}"


def decode(record: bytes) -> dict[str, Any]:
  return json.loads(record)
