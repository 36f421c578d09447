"""What the trainer trains on: batches, a loss, and evaluation statistics.

A task gives the training loop three things and nothing else:
  - `train_iterator(shard, rows)`: an endless grain iterator of host-local numpy batches whose
    state (`get_state`/`set_state`) goes into every checkpoint;
  - `loss(outputs, batch)`: the scalar minimised, and the number of examples or tokens it averages;
    `outputs` are the model's logits, or its readout (lm/cross_entropy.py) when `loss_takes_readout`;
  - evaluation: `eval_sets(shard, rows)` names finite batch streams, `eval_sums(outputs, batch)` reduces
    one batch to sums (on device), `summarize(sums)` turns the sums of a whole set into metrics;
  - `example()`: one row shaped like a training batch's, made without reading data, from which
    ahead-of-time compilation (lm-compile) takes the batch's fields, shapes and dtypes.
Model inputs come from `batch["inputs"]` and, when present, `batch["positions"]` and
`batch["segment_ids"]`.
"""

import functools
import math
from collections.abc import Callable, Iterator
from typing import Protocol

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from data_pipelines import pipeline, sources
from lm import cross_entropy, stats, tasks_compositional, tasks_recall

Batch = dict[str, np.ndarray]


class Task(Protocol):
  name: str
  seq_len: int  # positions per row: what throughput and token budgets count
  loss_takes_readout: bool  # the training loss gets the final hidden states and readout, not logits
  # >0: loss and metrics read only the outputs at the last readout_last positions, so the model forms
  # no others (lm/model.py, Transformer); 0: all positions.
  readout_last: int

  def train_iterator(self, shard: pipeline.Shard, rows: int) -> grain.DatasetIterator:
    ...

  def eval_sets(self, shard: pipeline.Shard, rows: int,
                final: bool = False) -> dict[str, Callable[[], Iterator[Batch]]]:
    ...

  def loss(self, outputs: jax.Array, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    ...

  def eval_sums(self, outputs: jax.Array, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    ...

  def summarize(self, sums: dict[str, float]) -> dict[str, float]:
    ...

  def example(self) -> Batch:
    ...


def position_buckets(seq_len: int) -> list[int]:
  """First position of each bucket of positions in the context: 0, 1, 2, 4, 8, ... (powers of two)."""
  return [0] + [2**k for k in range((seq_len - 1).bit_length())]


class LanguageModeling:
  """Next-token prediction on packed documents; evaluation is token-weighted over the whole split."""
  name = "lm"
  loss_takes_readout = True  # the cross-entropy may then skip writing the [B, T, V] logits
  readout_last = 0

  def __init__(self, config: ml_collections.ConfigDict, vocab_size: int):
    self.config = config
    self.seq_len = config.data.seq_len
    self.vocab_size = vocab_size

  @functools.cached_property
  def data(self) -> sources.Splits:
    # On first use, not in __init__: lm-compile builds the task on hosts that cannot read the data.
    return sources.resolve(self.config.data, self.vocab_size)

  def example(self):
    # The pipeline's own conversion of an all-padding packed row: the fields of every real batch.
    row = np.zeros((1, self.seq_len + 1), np.int32)
    return pipeline.to_model_batch({"inputs": row, "inputs_segment_ids": row, "inputs_positions": row})

  def train_iterator(self, shard, rows):
    d = self.config.data
    return iter(
        pipeline.train_dataset(self.data.train, self.data.tokenizer, seq_len=d.seq_len, batch_size=rows,
                               seed=self.config.seed, shard=shard, packing_bins=d.packing_bins,
                               threads=d.threads))

  @functools.cached_property
  def validation_bytes(self) -> int:
    return pipeline.split_bytes(self.data.validation)

  def eval_sets(self, shard, rows, final=False):
    del final  # the whole validation split every time
    d, data = self.config.data, self.data  # missing data fails here, not at the first evaluation
    return {
        "validation":
            lambda: iter(
                pipeline.eval_dataset(data.validation, data.tokenizer, seq_len=d.seq_len, batch_size=rows,
                                      shard=shard, packing_bins=d.packing_bins, threads=d.threads))
    }

  def loss(self, outputs, batch):
    weights_bt = batch["weights"]
    count = weights_bt.sum()
    total = cross_entropy.readout_loss(*outputs, batch["targets"], weights_bt,
                                       impl=self.config.train.cross_entropy_impl)
    return total / jnp.maximum(count, 1.0), count

  def eval_sums(self, outputs, batch):
    nll_bt, weights_bt = cross_entropy.token_nll(outputs, batch["targets"]), batch["weights"]
    # Bucket k holds positions [2^(k-1), 2^k): its index is the position's bit length.
    bucket_bt = 32 - jax.lax.clz(batch["positions"].astype(jnp.int32))
    in_bucket_btn = jax.nn.one_hot(bucket_bt, len(position_buckets(self.seq_len))) * weights_bt[..., None]
    return {
        "nll": stats.Moments.of(nll_bt, weights_bt, xp=jnp),
        "nll_by_position": stats.Moments.of(nll_bt[..., None], in_bucket_btn, axis=(0, 1), xp=jnp)
    }

  def summarize(self, sums):
    nll, by_position = sums["nll"], sums["nll_by_position"]
    n, mean = float(nll.count), float(nll.mean)
    result = {
        "loss": mean,
        "loss_stderr": float(nll.stderr),
        "perplexity": math.exp(mean),
        "bits_per_byte": mean * n / math.log(2) / self.validation_bytes,
        "tokens": int(n),
        "loss_by_position": {
            "first_position": position_buckets(self.seq_len),
            "loss": [float(m) if c else None for m, c in zip(by_position.mean, by_position.count)],
            "stderr": [float(s) if c > 1 else None for s, c in zip(by_position.stderr, by_position.count)],
            "tokens": by_position.count.astype(int).tolist()
        }
    }
    if self.data.unigram_perplexity is not None:
      result["unigram_perplexity"] = self.data.unigram_perplexity
    return result


TASKS = {
    "lm": LanguageModeling,
    "sraven": tasks_compositional.Sraven,
    "fuzzy_logic": tasks_compositional.FuzzyLogic,
    "mqar": tasks_recall.Mqar,
}


def build(config: ml_collections.ConfigDict, vocab_size: int) -> Task:
  if config.task not in TASKS:
    raise ValueError(f"unknown task {config.task!r}; choose one of: {', '.join(TASKS)}")
  return TASKS[config.task](config, vocab_size)
