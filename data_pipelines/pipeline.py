"""grain pipelines from a split's records to packed language-model batches.

Records are read in groups of `TOKENIZE_GROUP` (in grain's read threads), a group's documents are
tokenized in one SentencePiece call (pre-tokenized records are only reinterpreted), and a document
becomes [BOS] ids [EOS], is cut into windows of at most T+1 tokens that overlap by one
token (so every next-token transition of the document is a target exactly once, however long the
document), and windows are packed first-fit into rows of T+1 with segment ids and positions. A row
gives inputs row[:-1] and targets row[1:]; a target counts (weight 1) only where it continues the
same segment, so nothing is predicted across documents and padding never counts.

Batches are host-local numpy dicts of [B, T] arrays: inputs, targets, weights, positions, segment_ids.
"""

import dataclasses
from collections.abc import Sequence

import grain
import numpy as np

from data_pipelines import records
from data_pipelines.records import Documents
from data_pipelines.tokenizer import Tokenizer

TOKENIZE_GROUP = 32  # records per SentencePiece call: amortises the per-call cost


@dataclasses.dataclass(frozen=True)
class Shard:
  """This process's share of a source: records index, index + count, index + 2*count, ..."""
  index: int = 0
  count: int = 1


class Tokenize(grain.transforms.Map):
  """A group of records → the token ids of each document."""

  def __init__(self, documents: Documents, tokenizer: Tokenizer):
    self.documents, self.tokenizer = documents, tokenizer

  def map(self, group: list) -> list[np.ndarray]:
    if self.documents.format == records.TOKENS:
      return [np.frombuffer(r, "<i4") for r in group]
    return self.tokenizer.encode_batch([self.documents.text(r) for r in group])


class Windows(grain.experimental.FlatMapTransform):
  """Cuts each token sequence of a group into windows of ≤ length tokens overlapping by one."""

  def __init__(self, length: int):
    self.length = length
    self.max_fan_out = 1 << 20  # only a hint for grain; documents have no length limit

  def flat_map(self, group: list[np.ndarray]) -> Sequence[dict[str, np.ndarray]]:
    step = self.length - 1
    return [{"inputs": ids[s:s + self.length]} for ids in group for s in range(0, max(len(ids) - 1, 1), step)]


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


def _tokenized(ds: grain.MapDataset, documents: Documents, tokenizer: Tokenizer,
               threads: int) -> grain.IterDataset:
  ds = ds.batch(TOKENIZE_GROUP, batch_fn=list).map(Tokenize(documents, tokenizer))
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=8 * threads))


def _packed(ds: grain.IterDataset, seq_len: int, *, seed: int, shuffle: bool,
            packing_bins: int) -> grain.IterDataset:
  ds = grain.experimental.FlatMapIterDataset(ds, Windows(seq_len + 1))
  return grain.experimental.FirstFitPackIterDataset(ds, length_struct={"inputs": seq_len + 1},
                                                    num_packing_bins=packing_bins, seed=seed,
                                                    shuffle_bins=shuffle)


def epochs(documents: Documents, *, seed: int, shard: Shard = Shard()) -> grain.MapDataset:
  """This shard's records, endlessly, each epoch a fresh permutation of the shard: every record
  exactly once per epoch, and no record in two shards."""
  ds = grain.MapDataset.source(documents.source)
  return ds[shard.index::shard.count].shuffle(seed=seed).repeat(None)


def train_dataset(documents: Documents, tokenizer: Tokenizer, *, seq_len: int, batch_size: int, seed: int,
                  shard: Shard = Shard(), packing_bins: int = 64, threads: int = 2) -> grain.IterDataset:
  """Endless shuffled batches [batch_size, seq_len] of this shard; reshuffled every epoch."""
  ds = _tokenized(epochs(documents, seed=seed, shard=shard), documents, tokenizer, threads)
  ds = _packed(ds, seq_len, seed=seed, shuffle=True, packing_bins=packing_bins)
  return ds.batch(batch_size, drop_remainder=True).map(to_model_batch)


def _pad_rows(batch: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
  missing = rows - len(batch["inputs"])
  return {k: np.pad(v, [(0, missing)] + [(0, 0)] * (v.ndim - 1)) for k, v in batch.items()}


def eval_dataset(documents: Documents, tokenizer: Tokenizer, *, seq_len: int, batch_size: int,
                 shard: Shard = Shard(), packing_bins: int = 64, threads: int = 2) -> grain.IterDataset:
  """This shard's documents, in order, each target exactly once; the last batch padded with
  zero-weight rows so every batch has the same shape. Rows are packed from this shard's documents
  only, and the packer flushes its bins at the end: nothing is packed across the end of the split."""
  ds = grain.MapDataset.source(documents.source)[shard.index::shard.count]
  ds = _tokenized(ds, documents, tokenizer, threads)
  ds = _packed(ds, seq_len, seed=0, shuffle=False, packing_bins=packing_bins)
  return ds.batch(batch_size, drop_remainder=False).map(lambda b: to_model_batch(_pad_rows(b, batch_size)))


def split_bytes(documents: Documents) -> int:
  """UTF-8 bytes of the split's text: the denominator of bits per byte."""
  if documents.text_bytes is not None:
    return documents.text_bytes
  return sum(len(documents.text(r).encode("utf-8")) for r in documents.source)


def unigram_perplexity(train: Documents, validation: Documents, tokenizer: Tokenizer) -> float:
  """Perplexity on the eval targets (every token but the first, EOS included) of token frequencies
  counted on the train split, add-one smoothed: the floor a language model must beat."""

  def counts(documents):
    total = np.zeros(tokenizer.vocab_size, np.int64)
    for ids in Tokenize(documents, tokenizer).map(list(documents.source)):
      total += np.bincount(ids[1:], minlength=tokenizer.vocab_size)
    return total

  train_v, eval_v = counts(train), counts(validation)
  logp_v = np.log((train_v + 1) / (train_v.sum() + tokenizer.vocab_size))
  return float(np.exp(-(eval_v * logp_v).sum() / eval_v.sum()))
