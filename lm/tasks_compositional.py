"""The paper's compositional-generalisation tasks as trainer tasks (docs/reference/paper.md sections 3-4).

Both feed continuous token vectors to a bidirectional model (`model.input_dim`, `model.causal=False`)
and read the answer off the last positions: SRAVEN's four 8-way classifications of the missing
panel's features at the 4 query tokens, fuzzy logic's regression of f at the query token.

Batches are a deterministic function of (seed, step): the training stream of logical shard j of n is
generator step `i * n + j` for its i-th batch, so the grain iterator's state (the next index) is all
a checkpoint needs. Evaluation batches use generator steps from EVAL_STEP0 on, which the training
stream never reaches.
"""

import math

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from data_pipelines import fuzzy_logic, pipeline, sraven
from lm import stats

EVAL_STEP0 = 2**40
R2_MIN_VAR = 1e-6  # sequences whose targets barely vary would dominate the mean R²; floor their variance


def generated(sample, shard: pipeline.Shard, rows: int) -> grain.DatasetIterator:
  """An endless grain iterator of `sample(step, rows)` over this shard's steps."""
  ds = grain.MapDataset.range(2**62).map(lambda i: sample(i * shard.count + shard.index, rows))
  return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)))


def eval_batches(sample, shard: pipeline.Shard, rows: int, num_batches: int):
  return lambda: (sample(EVAL_STEP0 + i * shard.count + shard.index, rows) for i in range(num_batches))


def num_eval_batches(config: ml_collections.ConfigDict, final: bool) -> int:
  """eval.batches per set; the final evaluation takes eval.final_batches (the paper's sizes) if set."""
  return (final and config.eval.get("final_batches", 0)) or config.eval.batches


def split_seed(config: ml_collections.ConfigDict) -> int:
  """The seed of the held-out task split: data.split_seed, or the run's seed when it is -1 (as the
  paper's code does, so that seeds also vary which tasks are held out)."""
  return config.seed if config.data.split_seed < 0 else config.data.split_seed


def sraven_sums(logits_bfv: jax.Array, targets_bf: jax.Array) -> dict[str, jax.Array]:
  """Sums over a batch: instances, mean cross-entropy over features, all-4-correct, correct features."""
  nll_bf = optax.losses.softmax_cross_entropy_with_integer_labels(logits_bfv.astype(jnp.float32), targets_bf)
  right_bf = jnp.argmax(logits_bfv, axis=-1) == targets_bf
  return {
      "examples": jnp.float32(targets_bf.shape[0]),
      "nll": nll_bf.mean(-1).sum(),
      "correct": right_bf.all(-1).sum().astype(jnp.float32),
      "features_correct": right_bf.mean(-1).sum()
  }


def fuzzy_sums(pred_b: jax.Array, targets_b: jax.Array, target_var_b: jax.Array) -> dict[str, jax.Array]:
  """Sums over a batch: sequences, squared error, R² = 1 - err² / var(targets of the sequence)."""
  err2_b = (pred_b.astype(jnp.float32) - targets_b)**2
  r2_b = 1.0 - err2_b / jnp.maximum(target_var_b, R2_MIN_VAR)
  return {
      "examples": jnp.float32(targets_b.shape[0]),
      "sq_err": err2_b.sum(),
      "r2": r2_b.sum(),
      "r2_sq": (r2_b**2).sum()
  }


class Sraven:
  """SRAVEN: inputs one-hot [B, 36, 8]; outputs [B, 36, 8], the last 4 positions are the answer."""
  name = "sraven"
  loss_takes_readout = False
  readout_last = sraven.NUM_FEATURES
  seq_len = sraven.SEQ_LEN

  def __init__(self, config: ml_collections.ConfigDict, vocab_size: int):
    m = config.model
    if vocab_size != sraven.NUM_VALUES or m.input_dim != sraven.NUM_VALUES:
      raise ValueError(f"SRAVEN needs model.V={sraven.NUM_VALUES} and model.input_dim={sraven.NUM_VALUES}, "
                       f"got V={vocab_size}, input_dim={m.input_dim}; start from configs/sraven.py")
    self.config = config
    sraven.task_split(split_seed(config), config.data.frac_ood)  # a bad fraction fails here

  def sample(self, seed: int, step: int, rows: int, split: str) -> dict[str, np.ndarray]:
    d = self.config.data
    b = sraven.sample_batch(seed, step, rows, split, split_seed=split_seed(self.config), frac_ood=d.frac_ood,
                            permute_features=d.permute_features)
    return {"inputs": b["inputs_btv"], "targets": b["targets_bf"]}

  def train_iterator(self, shard, rows):
    return generated(lambda step, n: self.sample(self.config.seed, step, n, "train"), shard, rows)

  def example(self):
    return self.sample(self.config.seed, 0, 1, "train")

  def eval_sets(self, shard, rows, final=False):
    # "test": fresh instances of the training tasks; "ood": the held-out tasks (the headline).
    return {
        split:
            eval_batches(lambda step, n, s=split: self.sample(self.config.seed, step, n, s), shard, rows,
                         num_eval_batches(self.config, final)) for split in ("test", "ood")
    }

  def loss(self, outputs, batch):
    sums = sraven_sums(outputs[:, -sraven.NUM_FEATURES:], batch["targets"])
    return sums["nll"] / sums["examples"], sums["examples"]

  def eval_sums(self, outputs, batch):
    return sraven_sums(outputs[:, -sraven.NUM_FEATURES:], batch["targets"])

  def summarize(self, sums):
    n, p = sums["examples"], sums["correct"] / max(sums["examples"], 1.0)
    return {
        "accuracy": p,
        "accuracy_stderr": math.sqrt(p * (1 - p) / max(n, 1.0)),
        "feature_accuracy": sums["features_correct"] / max(n, 1.0),
        "loss": sums["nll"] / max(n, 1.0),
        "examples": int(n)
    }


class FuzzyLogic:
  """Fuzzy-logic regression: inputs [B, N, L+1]; the first output at the last position is f(x_N)."""
  name = "fuzzy_logic"
  loss_takes_readout = False
  readout_last = 1

  def __init__(self, config: ml_collections.ConfigDict, vocab_size: int):
    d, m = config.data, config.model
    if vocab_size != 1 or m.input_dim != d.num_vars + 1:
      raise ValueError(f"fuzzy logic needs model.V=1 and model.input_dim=data.num_vars+1={d.num_vars + 1}, "
                       f"got V={vocab_size}, input_dim={m.input_dim}; start from configs/fuzzy_logic.py")
    self.config = config
    self.seq_len = d.seq_len
    for split in fuzzy_logic.SPLITS:  # an empty split fails here, not at the first evaluation
      self.sample(0, 0, 1, split)

  def sample(self, seed: int, step: int, rows: int, split: str) -> dict[str, np.ndarray]:
    d = self.config.data
    b = fuzzy_logic.sample_batch(seed, step, rows, split, num_vars=d.num_vars, num_terms=d.num_terms,
                                 seq_len=d.seq_len, frac_test=d.frac_test, split_seed=split_seed(self.config),
                                 frac_unknown=d.frac_unknown)
    return {"inputs": b["inputs_btv"], "targets": b["targets_b"], "target_var": b["target_var_b"]}

  def train_iterator(self, shard, rows):
    return generated(lambda step, n: self.sample(self.config.seed, step, n, "train"), shard, rows)

  def example(self):
    return self.sample(self.config.seed, 0, 1, "train")

  def eval_sets(self, shard, rows, final=False):
    # The generator's "test" split (held-out combinations of known terms) is the compositional OOD
    # set; "train" here means fresh sequences of the training tasks (in distribution).
    names = {"test": "train", "ood": "test", "unknown": "unknown"}
    return {
        name:
            eval_batches(lambda step, n, s=split: self.sample(self.config.seed, step, n, s), shard, rows,
                         num_eval_batches(self.config, final)) for name, split in names.items()
    }

  def loss(self, outputs, batch):
    err2_b = (outputs[:, -1, 0] - batch["targets"])**2
    return err2_b.mean(), jnp.float32(err2_b.shape[0])

  def eval_sums(self, outputs, batch):
    return fuzzy_sums(outputs[:, -1, 0], batch["targets"], batch["target_var"])

  def summarize(self, sums):
    n = sums["examples"]
    r2 = stats.Moments.from_sums(sums["r2"], sums["r2_sq"], n)
    return {
        "r2": r2.mean,
        "r2_stderr": float(r2.stderr),
        "mse": sums["sq_err"] / max(n, 1.0),
        "examples": int(n)
    }
