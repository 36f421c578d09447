"""grain pipelines from record shards to packed language-model batches.

A document becomes [BOS] ids [EOS], is cut into windows of at most T+1 tokens that overlap by one
token (so every next-token transition of the document is a target exactly once, however long the
document), and windows are packed first-fit into rows of T+1 with segment ids and positions. A row
gives inputs row[:-1] and targets row[1:]; a target counts (weight 1) only where it continues the
same segment, so nothing is predicted across documents and padding never counts.

Batches are host-local numpy dicts of [B, T] arrays: inputs, targets, weights, positions, segment_ids.
"""

import dataclasses
from typing import Sequence

import grain
import numpy as np

from data_pipelines import records
from data_pipelines.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Shard:
  """This process's share of a source: records index, index + count, index + 2*count, ..."""
  index: int = 0
  count: int = 1


class Tokenize(grain.transforms.Map):

  def __init__(self, tokenizer: Tokenizer):
    self.tokenizer = tokenizer

  def map(self, record: bytes) -> np.ndarray:
    return self.tokenizer.encode(records.decode(record)["text"])


class Windows(grain.experimental.FlatMapTransform):
  """Cuts a token sequence into windows of ≤ length tokens overlapping by one."""

  def __init__(self, length: int):
    self.length = length
    self.max_fan_out = 1 << 20  # only a hint for grain; documents have no length limit

  def flat_map(self, ids: np.ndarray) -> Sequence[dict[str, np.ndarray]]:
    step = self.length - 1
    starts = range(0, max(len(ids) - 1, 1), step)
    return [{"inputs": ids[s:s + self.length]} for s in starts]


def to_model_batch(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Packed rows [B, T+1] → shifted model inputs/targets [B, T] with target weights."""
  tokens, seg, pos = packed["inputs"], packed["inputs_segment_ids"], packed["inputs_positions"]
  return {
      "inputs": tokens[:, :-1].astype(np.int32),
      "targets": tokens[:, 1:].astype(np.int32),
      "weights": ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)).astype(np.float32),
      "positions": pos[:, :-1].astype(np.int32),
      "segment_ids": seg[:, :-1].astype(np.int32),
  }


def _packed(ds: grain.IterDataset, tokenizer: Tokenizer, seq_len: int, *, seed: int,
            shuffle: bool, packing_bins: int) -> grain.IterDataset:
  ds = ds.map(Tokenize(tokenizer))
  ds = grain.experimental.FlatMapIterDataset(ds, Windows(seq_len + 1))
  return grain.experimental.FirstFitPackIterDataset(
      ds, length_struct={"inputs": seq_len + 1}, num_packing_bins=packing_bins, seed=seed,
      shuffle_bins=shuffle)


def epochs(paths: Sequence[str], *, seed: int, shard: Shard = Shard()) -> grain.MapDataset:
  """This shard's records, endlessly, each epoch a fresh permutation of the shard: every record
  exactly once per epoch, and no record in two shards."""
  ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(list(paths)))
  return ds[shard.index::shard.count].shuffle(seed=seed).repeat(None)


def train_dataset(paths: Sequence[str], tokenizer: Tokenizer, *, seq_len: int, batch_size: int,
                  seed: int, shard: Shard = Shard(), packing_bins: int = 64,
                  threads: int = 2) -> grain.IterDataset:
  """Endless shuffled batches [batch_size, seq_len] of this shard; reshuffled every epoch."""
  ds = epochs(paths, seed=seed, shard=shard).to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=4 * batch_size))
  ds = _packed(ds, tokenizer, seq_len, seed=seed, shuffle=True, packing_bins=packing_bins)
  return ds.batch(batch_size, drop_remainder=True).map(to_model_batch)


def _pad_rows(batch: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
  missing = rows - len(batch["inputs"])
  return {k: np.pad(v, [(0, missing)] + [(0, 0)] * (v.ndim - 1)) for k, v in batch.items()}


def eval_dataset(paths: Sequence[str], tokenizer: Tokenizer, *, seq_len: int, batch_size: int,
                 shard: Shard = Shard(), packing_bins: int = 64) -> grain.IterDataset:
  """This shard's documents, in order, each target exactly once; the last batch padded with
  zero-weight rows so every batch has the same shape."""
  ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(list(paths)))
  ds = ds[shard.index::shard.count].to_iter_dataset()
  ds = _packed(ds, tokenizer, seq_len, seed=0, shuffle=False, packing_bins=packing_bins)
  return ds.batch(batch_size, drop_remainder=False).map(
      lambda b: to_model_batch(_pad_rows(b, batch_size)))


def split_bytes(paths: Sequence[str], shard: Shard = Shard()) -> int:
  """UTF-8 bytes of this shard's text: the denominator of bits per byte."""
  source = grain.sources.ArrayRecordDataSource(list(paths))
  return sum(len(records.decode(source[i])["text"].encode("utf-8"))
             for i in range(shard.index, len(source), shard.count))


def unigram_perplexity(train_paths: Sequence[str], eval_paths: Sequence[str],
                       tokenizer: Tokenizer) -> float:
  """Perplexity on the eval targets (every token but the first, EOS included) of token frequencies
  counted on the train split, add-one smoothed: the floor a language model must beat."""
  def counts(paths):
    total = np.zeros(tokenizer.vocab_size, np.int64)
    for record in grain.sources.ArrayRecordDataSource(list(paths)):
      ids = tokenizer.encode(records.decode(record)["text"])
      total += np.bincount(ids[1:], minlength=tokenizer.vocab_size)
    return total
  train_v, eval_v = counts(train_paths), counts(eval_paths)
  logp_v = np.log((train_v + 1) / (train_v.sum() + tokenizer.vocab_size))
  return float(np.exp(-(eval_v * logp_v).sum() / eval_v.sum()))

