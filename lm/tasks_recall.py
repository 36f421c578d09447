"""Multi-query associative recall (data_pipelines/mqar.py) as a trainer task: a causal language model
over the row, whose loss and accuracy count only the query positions, where the target is the queried
key's value.

The training set is examples 0 .. data.train_examples - 1 of data.train_seed, reshuffled every epoch
by the run's seed; logical shard j of n takes every n-th example of that stream from the j-th, so the
grain iterator's state (its next index) is all a checkpoint needs. The test set is data.test_examples
examples of data.test_seed, which must differ from data.train_seed.
"""

import math

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from data_pipelines import mqar
from lm import cross_entropy, stats


def distance_buckets(seq_len: int) -> list[int]:
  """First key-to-query distance of each accuracy bucket: 0, 1, 2, 4, 8, ... (powers of two)."""
  return [0] + [2**k for k in range((seq_len - 1).bit_length())]


def _at_queries(x_btx: jax.Array, query_positions_bn: jax.Array) -> jax.Array:
  """The rows of x [B, T, ...] at each example's query positions: [B, n, ...]."""
  index = query_positions_bn.reshape(query_positions_bn.shape + (1,) * (x_btx.ndim - 2))
  return jnp.take_along_axis(x_btx, index, axis=1)


class Mqar:
  """MQAR: inputs token ids [B, T]; per query (one per pair): its position, target value and distance."""
  name = "mqar"
  # The loss forms logits at the query positions only: a fraction of the row's readout.
  loss_takes_readout = True
  readout_last = 0

  def __init__(self, config: ml_collections.ConfigDict, vocab_size: int):
    d = config.data
    if vocab_size != d.vocab_size:
      raise ValueError(
          f"MQAR needs model.V = data.vocab_size, got V={vocab_size}, vocab_size={d.vocab_size}; "
          f"start from configs/mqar.py, whose V follows data.vocab_size")
    if not config.model.causal:
      raise ValueError("MQAR is next-token prediction over the row: set model.causal=True")
    if d.train_seed == d.test_seed:
      raise ValueError(f"data.train_seed and data.test_seed are both {d.train_seed}: the test set must come "
                       f"from another seed")
    for field in ("train_examples", "test_examples"):
      if d[field] < 1:
        raise ValueError(f"data.{field} must be at least 1, got {d[field]}")
    self.settings = dict(vocab_size=d.vocab_size, seq_len=d.seq_len, num_kv_pairs=d.num_kv_pairs,
                         power_a=d.power_a, random_filler=d.random_filler)
    mqar.check(**{k: v for k, v in self.settings.items() if k != "random_filler"})
    self.config = config
    self.seq_len = d.seq_len

  def batch(self, seed: int, indices: np.ndarray, real: int | None = None) -> dict[str, np.ndarray]:
    """Examples `indices` of `seed`; rows from `real` on are padding (weight 0)."""
    b = mqar.sample_batch(seed, indices, **self.settings)
    weights_bn = np.ones(b["targets_bn"].shape, np.float32)
    if real is not None:
      weights_bn[real:] = 0.0
    return {
        "inputs": b["inputs_bt"],
        "query_positions": b["query_positions_bn"],
        "targets": b["targets_bn"],
        "distances": b["distances_bn"],
        "weights": weights_bn
    }

  def example(self):
    return self.batch(self.config.data.train_seed, np.zeros(1, np.int64))

  def train_iterator(self, shard, rows):
    d = self.config.data
    order = grain.MapDataset.range(d.train_examples).shuffle(seed=self.config.seed).repeat()
    ds = order[shard.index::shard.count].batch(rows).map(lambda idx: self.batch(d.train_seed, idx))
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)))

  def eval_sets(self, shard, rows, final=False):
    del final  # the whole test set every time
    d = self.config.data
    mine = np.arange(d.test_examples)[shard.index::shard.count]

    def batches():
      for start in range(0, len(mine), rows):
        part = mine[start:start + rows]
        # The last batch is filled up to `rows` with weight-0 copies: every batch has one shape.
        yield self.batch(d.test_seed, np.resize(part, rows), real=len(part))

    return {"test": batches}

  def loss(self, outputs, batch):
    x_btd, w_dv, scale = outputs
    weights_bn = batch["weights"]
    total = cross_entropy.readout_loss(_at_queries(x_btd,
                                                   batch["query_positions"]), w_dv, scale, batch["targets"],
                                       weights_bn, impl=self.config.train.cross_entropy_impl)
    count = weights_bn.sum()
    return total / jnp.maximum(count, 1.0), count

  def eval_sums(self, outputs, batch):
    logits_bnv = _at_queries(outputs, batch["query_positions"])
    targets_bn, weights_bn = batch["targets"], batch["weights"]
    nll_bn = cross_entropy.token_nll(logits_bnv, targets_bn)
    right_bn = (jnp.argmax(logits_bnv, axis=-1) == targets_bn).astype(jnp.float32)
    # Bucket k holds distances [2^(k-1), 2^k): its index is the distance's bit length.
    bucket_bn = 32 - jax.lax.clz(batch["distances"].astype(jnp.int32))
    in_bucket_bnk = jax.nn.one_hot(bucket_bn, len(distance_buckets(self.seq_len))) * weights_bn[..., None]
    return {
        "nll": stats.Moments.of(nll_bn, weights_bn, xp=jnp),
        "correct": stats.Moments.of(right_bn, weights_bn, xp=jnp),
        "correct_by_distance": stats.Moments.of(right_bn[..., None], in_bucket_bnk, axis=(0, 1), xp=jnp)
    }

  def summarize(self, sums):
    nll, correct, by_distance = sums["nll"], sums["correct"], sums["correct_by_distance"]
    p, n = float(correct.mean), float(correct.count)
    return {
        "accuracy": p,
        # Over queries as if independent (the queries of one row share its pairs).
        "accuracy_stderr": math.sqrt(p * (1 - p) / max(n, 1.0)),
        "loss": float(nll.mean),
        "loss_stderr": float(nll.stderr),
        "queries": int(n),
        "accuracy_by_distance": {
            "first_distance": distance_buckets(self.seq_len),
            "accuracy": [float(m) if c else None for m, c in zip(by_distance.mean, by_distance.count)],
            "queries": by_distance.count.astype(int).tolist()
        }
    }
