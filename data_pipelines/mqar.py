"""Multi-query associative recall (MQAR; Zoology, Arora et al. 2023, arXiv 2312.04927), example by example.

A row of T tokens over a vocabulary of V: the first V/2 ids (but 0) are keys, the others values. The row
opens with num_kv_pairs pairs k_1 v_1 k_2 v_2 ... (distinct keys, distinct values); after them every key
is asked once more, at an even offset 2g from the end of the pairs. The gaps g are drawn without
replacement from 0 .. (T - 2 n) / 2 - 1 with probability ∝ (g + 1)^(power_a - 1), a power law that puts
most queries soon after the pairs (Zoology's power_a = 0.01; 1 is uniform). At a query the model must
predict its key's value (the value never follows it in the row); every other position is filler: token
0, or with random_filler a uniform random token (Zoology's random_non_queries).

An example is a deterministic function of (seed, index): a fixed training set is indices
0 .. train_examples - 1 of one seed, the test set those of another.

Dimension letters: b example, t position, n query (one per pair).
"""

import functools

import numpy as np


def check(*, vocab_size: int, seq_len: int, num_kv_pairs: int, power_a: float) -> None:
  """Raises a ValueError naming the fix when the settings make no MQAR row."""
  if num_kv_pairs < 1 or 4 * num_kv_pairs > seq_len:
    raise ValueError(f"MQAR needs 1 <= data.num_kv_pairs <= data.seq_len / 4 (room for the pairs and as many "
                     f"query slots), got {num_kv_pairs} pairs in {seq_len} tokens")
  if seq_len % 2:
    raise ValueError(f"MQAR's queries sit at even offsets: data.seq_len must be even, got {seq_len}")
  if vocab_size // 2 - 1 < num_kv_pairs:
    raise ValueError(f"data.vocab_size={vocab_size} has {vocab_size // 2 - 1} keys, fewer than "
                     f"data.num_kv_pairs={num_kv_pairs}; raise the vocabulary")
  if power_a <= 0:
    raise ValueError(f"data.power_a must be > 0 (1: uniform gaps), got {power_a}")


@functools.cache
def gap_probabilities(slots: int, power_a: float) -> np.ndarray:
  """p(g) ∝ (g + 1)^(power_a - 1) over the query slots g = 0 .. slots - 1."""
  p = np.arange(1, slots + 1, dtype=np.float64)**(power_a - 1)
  p = p / p.sum()
  p.setflags(write=False)
  return p


def example(seed: int, index: int, *, vocab_size: int, seq_len: int, num_kv_pairs: int, power_a: float,
            random_filler: bool = False) -> dict[str, np.ndarray]:
  """One row: inputs_t, and per pair (in the order the pairs open the row) its query's position,
  the value it asks for and how far back its key is."""
  n = num_kv_pairs
  rng = np.random.default_rng([seed, index])
  keys_n = 1 + rng.choice(vocab_size // 2 - 1, n, replace=False)
  values_n = vocab_size // 2 + rng.choice(vocab_size - vocab_size // 2, n, replace=False)
  slots = (seq_len - 2 * n) // 2
  gaps_n = rng.choice(slots, n, replace=False, p=gap_probabilities(slots, power_a))
  inputs_t = rng.integers(0, vocab_size, seq_len) if random_filler else np.zeros(seq_len, np.int64)
  inputs_t[0:2 * n:2], inputs_t[1:2 * n:2] = keys_n, values_n
  query_n = 2 * n + 2 * gaps_n
  inputs_t[query_n] = keys_n
  return {
      "inputs_t": inputs_t.astype(np.int32),
      "query_positions_n": query_n.astype(np.int32),
      "targets_n": values_n.astype(np.int32),
      "distances_n": (query_n - 2 * np.arange(n)).astype(np.int32),
  }


def sample_batch(seed: int, indices, **settings) -> dict[str, np.ndarray]:
  """Examples `indices` of `seed`, stacked: inputs_bt, query_positions_bn, targets_bn, distances_bn."""
  rows = [example(seed, int(i), **settings) for i in indices]
  return {f"{k.rsplit('_', 1)[0]}_b{k.rsplit('_', 1)[1]}": np.stack([r[k] for r in rows]) for k in rows[0]}
