"""Shared fixtures: a small generated corpus in C4's record format with its own tokenizer."""

import numpy as np
import pytest

from data_pipelines import records, tokenizer

WORDS = ("the quick brown fox jumps over a lazy dog while seven wise kings sing of "
         "green hills and silver rivers under an old moon").split()


def make_documents(n: int, seed: int) -> list[dict]:
  rng = np.random.default_rng(seed)
  docs = []
  for i in range(n):
    lines = [" ".join(rng.choice(WORDS, size=rng.integers(3, 12))) for _ in range(rng.integers(1, 30))]
    docs.append({"text": "\n".join(lines), "url": f"test://{seed}/{i}", "timestamp": ""})
  return docs


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
  """A data dir with 3 train shards, 2 validation shards and a 320-piece tokenizer."""
  root = tmp_path_factory.mktemp("corpus")
  for split, n_docs, n_shards, seed in (("train", 120, 3, 0), ("validation", 30, 2, 1)):
    docs = make_documents(n_docs, seed)
    for i in range(n_shards):
      records.write_shard(root / records.shard_name(split, i, n_shards), docs[i::n_shards])
  tokenizer.train(records.shard_paths(root, "train"), tokenizer.model_path(root, 320), 320)
  return root
