"""Resolves the `data` config section into record shards and a tokenizer."""

import dataclasses

import grain
import ml_collections
from data_pipelines import corpus, records
from data_pipelines.tokenizer import Tokenizer, model_path

SOURCES = ("shakespeare", "array_record")


@dataclasses.dataclass
class Splits:
  train: list[str]
  validation: list[str]
  tokenizer: Tokenizer
  unigram_perplexity: float | None = None  # known for the embedded corpus only


def resolve(cfg: ml_collections.ConfigDict, vocab_size: int) -> Splits:
  """cfg: the `data` section; vocab_size: the model's V, which the tokenizer must match."""
  if cfg.source not in SOURCES:
    raise ValueError(f"unknown data.source {cfg.source!r}; choose one of: {', '.join(SOURCES)}")
  baseline = None
  if cfg.source == "shakespeare":
    baseline = corpus.prepare(cfg.dir, vocab_size)
  tokenizer = Tokenizer(cfg.tokenizer or model_path(cfg.dir, vocab_size))
  tokenizer.check_vocab(vocab_size)
  splits = {s: records.shard_paths(cfg.dir, s) for s in ("train", "validation")}
  for split, paths in splits.items():
    if not len(grain.sources.ArrayRecordDataSource(paths)):
      raise ValueError(f"the '{split}' split in {cfg.dir} has no records; prepare it again "
                       f"(see README, 'Data') or point data.dir at a non-empty directory")
  return Splits(splits["train"], splits["validation"], tokenizer, baseline)
