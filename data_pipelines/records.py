"""ArrayRecord shards of JSON records shaped like C4's ({"text": ..., "url": ..., "timestamp": ...}).

Shards are named like TFDS's: `{split}.array_record-00000-of-00004` inside a data directory.
"""

import json
import os
from typing import Any, Iterable

from array_record.python import array_record_module
from etils import epath


def shard_name(split: str, index: int, count: int) -> str:
  return f"{split}.array_record-{index:05d}-of-{count:05d}"


def write_shard(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> int:
  """Writes records to one ArrayRecord file atomically (a crash never leaves a partial shard)."""
  path = epath.Path(path)
  tmp = path.parent / f".{path.name}.tmp"
  # group_size:1 keeps random access cheap: grain reads single records in shuffled order.
  writer = array_record_module.ArrayRecordWriter(os.fspath(tmp), "group_size:1")
  n = 0
  for record in records:
    writer.write(json.dumps(record, ensure_ascii=False).encode("utf-8"))
    n += 1
  writer.close()
  tmp.rename(path)
  return n


def shard_paths(data_dir: str | os.PathLike, split: str) -> list[str]:
  """The split's shards in order; a clear error when there are none."""
  data_dir = epath.Path(data_dir)
  paths = sorted(data_dir.glob(f"{split}.array_record-*-of-*"))
  if not paths:
    raise FileNotFoundError(
        f"no '{split}' shards ({split}.array_record-*-of-*) in {data_dir}; prepare the data with "
        f"`lm-prepare` (see README, 'Data') or point data.dir at a prepared directory")
  return [os.fspath(p) for p in paths]


def decode(record: bytes) -> dict[str, Any]:
  return json.loads(record)
