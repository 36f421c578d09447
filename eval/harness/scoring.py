"""Scoring token sequences with a checkpoint's model: packed, fixed-shape batches and greedy decoding.

A request is a token sequence (the prefix token, its context, its continuation) whose last `scored`
tokens are scored, each predicted from everything before it. Requests are packed first-fit into rows of
the trained context with segment ids and positions that restart at 0 (the attention core masks other
segments, as in training), so a request scores as it would alone. Every batch has the same shape
[rows, seq_len], so the scoring step compiles once; it returns each request's summed log-probability
and whether every scored token was the greedy (argmax) choice.

On several processes every step must run on all of them with the same inputs: process 0 decides the
steps (the harness runs there alone) and `Lockstep` broadcasts each one's inputs to the others, which
`follow` until process 0 says stop.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from lm import decode, sharding
from lm.experiment import Experiment


@dataclasses.dataclass(frozen=True)
class Request:
  """tokens: [prefix, context..., continuation...]; the last `scored` of them are scored."""
  tokens: tuple[int, ...]
  scored: int


def request(context: list[int], continuation: list[int], seq_len: int) -> Request:
  """context starts with the prefix token (BOS, or EOS for a tokenizer without one). A sequence longer
  than the context the model was trained on loses its oldest tokens; at most seq_len are scored."""
  tokens = (list(context) + list(continuation))[-(seq_len + 1):]
  return Request(tuple(int(t) for t in tokens), min(len(continuation), len(tokens) - 1))


def pack(requests: list[Request], seq_len: int) -> list[list[tuple[int, int]]]:
  """Rows of (request index, offset): first-fit over the requests longest first. A request of n
  tokens takes n - 1 input positions."""
  rows, free = [], []
  for i in sorted(range(len(requests)), key=lambda i: -len(requests[i].tokens)):
    need = len(requests[i].tokens) - 1
    row = next((r for r, f in enumerate(free) if f >= need), None)
    if row is None:
      rows.append([])
      free.append(seq_len)
      row = len(rows) - 1
    rows[row].append((i, seq_len - free[row]))
    free[row] -= need
  return rows


def batches(requests: list[Request], seq_len: int, rows: int):
  """(request indices, batch [5, rows, seq_len] of inputs, targets, positions, segment ids and each
  position's slot: the batch-local index of the request it scores, or rows * seq_len where nothing
  is scored)."""
  packed = pack(requests, seq_len)
  for start in range(0, len(packed), rows):
    batch = np.zeros((5, rows, seq_len), np.int32)
    batch[4] = rows * seq_len
    order = []
    for r, row in enumerate(packed[start:start + rows]):
      for segment, (i, offset) in enumerate(row, 1):
        tokens, n = np.asarray(requests[i].tokens, np.int32), len(requests[i].tokens) - 1
        at = slice(offset, offset + n)
        batch[0, r, at], batch[1, r, at] = tokens[:-1], tokens[1:]
        batch[2, r, at], batch[3, r, at] = np.arange(n), segment
        batch[4, r, offset + n - requests[i].scored:offset + n] = len(order)
        order.append(i)
    yield order, batch


# Operations process 0 broadcasts to the others (Lockstep).
STOP, SCORE, DECODE_START, DECODE_STEP = range(4)


class Scorer:
  """A restored model's scoring and decoding steps. params: as checkpointing.load restores them for
  exp.abstract_sharded_state(); rows: batch rows (a multiple of the mesh's batch shards)."""

  def __init__(self, exp: Experiment, params, rows: int):
    self.exp, self.params, self.rows = exp, params, rows
    self.seq_len = exp.config.data.seq_len
    shards = math.prod(exp.mesh.shape[a] for a in sharding.BATCH)
    if rows < 1 or rows % shards:
      raise ValueError(f"--batch_size={rows} does not split over the {shards} batch shards of the mesh "
                       f"(data x fsdp); choose a multiple of {shards}")
    self.lockstep = Lockstep()
    self.replicated = NamedSharding(exp.mesh, P())
    self.batch_sharding = NamedSharding(exp.mesh, P(None, *exp.batch_sharding.spec))
    self._decoder, self._cache, self._init_caches = None, None, {}

  def _global(self, data: np.ndarray, sharding_: NamedSharding) -> jax.Array:
    """A host array every process holds whole, as one global array."""
    return jax.make_array_from_callback(data.shape, sharding_, lambda index: data[index])

  @functools.cached_property
  def _score(self):
    R = self.rows * self.seq_len

    def score(params, batch):
      inputs, targets, positions, segments, slots = batch
      logits_btv = self.exp.model.apply({"params": params}, inputs, positions_bt=positions,
                                        segment_ids_bt=segments)
      logp_bt = jnp.take_along_axis(jax.nn.log_softmax(logits_btv), targets[..., None], -1)[..., 0]
      greedy_bt = (jnp.argmax(logits_btv, -1) == targets).astype(jnp.int32)
      # Slot R collects the positions nothing is scored at; every scored slot has at least one.
      logp = jax.ops.segment_sum(logp_bt.ravel(), slots.ravel(), num_segments=R + 1)[:R]
      greedy = jax.ops.segment_min(greedy_bt.ravel(), slots.ravel(), num_segments=R + 1)[:R]
      return logp, greedy

    return jax.jit(score, in_shardings=(jax.tree.map(lambda a: a.sharding, self.params), self.batch_sharding),
                   out_shardings=self.replicated, compiler_options=self.exp.compiler_options)

  def score_batch(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Summed log-probability and greedy flag of each slot of a batch from `batches`."""
    with jax.set_mesh(self.exp.mesh):
      logp, greedy = self._score(self.params, self._global(batch, self.batch_sharding))
    return np.asarray(jax.device_get(logp)), np.asarray(jax.device_get(greedy)).astype(bool)

  def score(self, requests: list[Request]) -> list[tuple[float, bool]]:
    """(summed log-probability of the scored tokens, whether each was the greedy choice) per request.
    A request with nothing scored has (0.0, True)."""
    out = [(0.0, True)] * len(requests)
    todo = [i for i, r in enumerate(requests) if r.scored > 0]
    for order, batch in batches([requests[i] for i in todo], self.seq_len, self.rows):
      logp, greedy = self.lockstep.run(self, SCORE, batch)
      for slot, i in enumerate(order):
        out[todo[i]] = (float(logp[slot]), bool(greedy[slot]))
    return out

  def decode_start(self, length: int, prompt: np.ndarray) -> int:
    """Starts greedy decoding of one prompt [P] in a decoder of `length` positions; returns the first
    new token."""
    self._decoder = decoder = decode.Decoder(self.exp.model_cfg, length)
    if length not in self._init_caches:  # one compiled zero state per decoder length
      self._init_caches[length] = jax.jit(lambda params: decoder.init_cache(params, 1),
                                          out_shardings=self.replicated)
    with jax.set_mesh(self.exp.mesh):
      self._cache = self._init_caches[length](self.params)
    return self._step(prompt[None])

  def decode_step(self, token: int) -> int:
    return self._step(np.asarray([[token]], np.int32))

  def _step(self, tokens_bt: np.ndarray) -> int:
    with jax.set_mesh(self.exp.mesh):
      token_b, self._cache = self._decoder.step(self.params, self._cache,
                                                self._global(tokens_bt, self.replicated),
                                                decode.Sampling(temperature=0.0), jax.random.key(0))
    return int(jax.device_get(token_b)[0])

  def generate(self, prompt: list[int], max_new_tokens: int, stop) -> list[int]:
    """Greedy continuation of prompt (lm-sample's tokens at temperature 0), at most max_new_tokens,
    until stop(new tokens) says so. The decoder spans prompt and continuation, as lm-sample's does."""
    decode.check_context(len(prompt), max_new_tokens, self.seq_len)
    start = np.asarray([[len(prompt) + max_new_tokens, *prompt]], np.int32)
    new = [self.lockstep.run(self, DECODE_START, start)]
    while len(new) < max_new_tokens and not stop(new):
      new.append(self.lockstep.run(self, DECODE_STEP, np.asarray([[new[-1]]], np.int32)))
    return new

  def execute(self, op: int, data: np.ndarray):
    """One operation (run here and, through Lockstep, on every process)."""
    if op == SCORE:
      return self.score_batch(data)
    if op == DECODE_START:
      return self.decode_start(int(data[0, 0]), data[0, 1:])
    if op == DECODE_STEP:
      return self.decode_step(int(data[0, 0]))
    raise ValueError(f"unknown operation {op}")


class Lockstep:
  """Process 0 decides every step; with several processes it broadcasts each one's operation and
  int32 input to the others, which `follow` until STOP. One process: steps run directly."""
  HEADER = 4  # operation and up to three dimensions

  def __init__(self):
    self.processes, self.leader = jax.process_count(), jax.process_index() == 0

  def _broadcast(self, op: int, data: np.ndarray | None) -> tuple[int, np.ndarray | None]:
    header = np.zeros(self.HEADER, np.int32)
    if self.leader:
      header[0], header[1:1 + data.ndim] = op, data.shape
      header[1 + data.ndim:] = -1
    header = np.asarray(multihost_utils.broadcast_one_to_all(header, is_source=self.leader))
    if header[0] == STOP:
      return STOP, None
    shape = tuple(int(d) for d in header[1:] if d >= 0)
    data = data if self.leader else np.zeros(shape, np.int32)
    return int(header[0]), np.asarray(multihost_utils.broadcast_one_to_all(data, is_source=self.leader))

  def run(self, scorer: Scorer, op: int, data: np.ndarray):
    if self.processes > 1:
      op, data = self._broadcast(op, data)
    return scorer.execute(op, data)

  def follow(self, scorer: Scorer) -> None:
    """The other processes: run what process 0 broadcasts until it stops."""
    while True:
      op, data = self._broadcast(STOP, None)
      if op == STOP:
        return
      scorer.execute(op, data)

  def stop(self) -> None:
    if self.processes > 1 and self.leader:
      header = np.zeros(self.HEADER, np.int32)
      multihost_utils.broadcast_one_to_all(header, is_source=True)
