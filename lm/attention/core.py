"""The attention core's definition: masks, scores, normalisations, value networks, dropout.

q, k, v: [batch, seq, heads, head_dim] → out like q, in three steps (docs/reference/paper.md):
  1. scores  s_bhqk = q·k / sqrt(d) + bias, masked by causality and packed-document segments; gated
     (GLA), each key dimension decays by the gates of the steps between key and query:
     s_bhqk = Σ_d q_qd k_kd Π_{k<r≤q} α_rd / sqrt(d), from log α [batch, seq, heads, head_dim];
  2. normalisation σ: softmax over keys, none, or rms_head (RMS over the head axis per (q, k));
     attention dropout then zeroes whole (q, k) pairs, one mask shared over batch and heads;
  3. value network: linear, out_bqhd = Σ_k a_bhqk v_bkhd; or hypernetwork,
     z_bkqd = Σ_h a_bhqk v_bkhd, out_bqhd = Σ_k a_bhqk φ(z_bkqd).

`reference` is this definition written out with einsums; `per_device` runs a Pallas kernel on each
device's shard of a mesh. The kernels (blocked.py, hypernetwork.py, linear.py, softmax.py beside this
file) build on these functions and import nothing else of ours; lm/attention/__init__.py says which of
them computes what.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.extend.random as jax_random
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

NORMALIZATIONS = ("softmax", "none", "rms_head")
# Each value network with its matmul products per (query, key) pair and head dimension besides the score
# q·k: linear a·v; hypernetwork z = Σ_h a·v and a·φ(z). lm/flops.py counts the core's work from this.
VALUE_NETWORKS = {"linear": 1, "hypernetwork": 2}
NONLINEARITIES: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "identity": lambda x: x,
}
# Whether the scores decay by a data-dependent gate (step 1): False for the paper's variants, True for
# gated linear attention, whose model layer makes log α from its input (lm/model.py).
GATED = (False, True)
RMS_HEAD_EPS = 1e-6
# Explicit (query positions [q], key positions [k]): causality among them when the queries are not the
# first q of the keys (incremental decoding attends new queries to a cache of keys).
Positions = tuple[jax.Array, jax.Array]


@dataclasses.dataclass(frozen=True)
class Knobs:
  """One setting of the core: step 2's normalisation, step 3's value network and its φ; `gated`: step 1's
  scores decay by a gate the caller passes (log_gate)."""
  normalization: str
  value_network: str
  nonlinearity: str = "relu"
  gated: bool = False

  def __post_init__(self):
    if self.gated not in GATED:
      raise ValueError(f"attention gated must be True or False, got {self.gated!r}")
    for what, value, valid in (("normalization", self.normalization,
                                NORMALIZATIONS), ("value_network", self.value_network, tuple(VALUE_NETWORKS)),
                               ("nonlinearity", self.nonlinearity, tuple(NONLINEARITIES))):
      if value not in valid:
        raise ValueError(f"unknown attention {what} {value!r}; choose one of: {', '.join(valid)}")


def pair_flops(knobs: Knobs, width: int) -> int:
  """Forward FLOPs of one (query, key) pair over heads of total width `width`: a multiply-add per
  dimension for the score and for each of the value network's products, and a gate's decay multiply
  per dimension."""
  return 2 * width * (1 + VALUE_NETWORKS[knobs.value_network]) + width * knobs.gated


def pair_mask(q_pos_q: jax.Array, k_pos_k: jax.Array, *, causal: bool,
              q_segment_ids_bq: jax.Array | None = None,
              k_segment_ids_bk: jax.Array | None = None) -> jax.Array | None:
  """Boolean [batch or 1, 1, q, k] mask of allowed pairs among the given positions, or None when
  everything is allowed."""
  mask = None
  if causal:
    mask = (q_pos_q[:, None] >= k_pos_k[None, :])[None, None]
  if q_segment_ids_bq is not None:
    same_bqk = q_segment_ids_bq[:, :, None] == k_segment_ids_bk[:, None, :]
    mask = same_bqk[:, None] if mask is None else mask & same_bqk[:, None]
  return mask


def pair_positions(q_len: int, k_len: int, positions: Positions | None) -> Positions:
  """The (query, key) positions of a call: the given ones, or the first q_len and k_len."""
  return positions if positions is not None else (jnp.arange(q_len), jnp.arange(k_len))


def attention_mask(q_len: int, k_len: int, *, causal: bool, segment_ids: jax.Array | None,
                   positions: Positions | None = None) -> jax.Array | None:
  """Boolean [batch or 1, 1, q, k] mask of allowed pairs, or None when everything is allowed."""
  q_pos_q, k_pos_k = pair_positions(q_len, k_len, positions)
  return pair_mask(q_pos_q, k_pos_k, causal=causal, q_segment_ids_bq=segment_ids,
                   k_segment_ids_bk=segment_ids)


def masked_scores(q_bqhd: jax.Array, k_bkhd: jax.Array, bias: jax.Array | None, mask: jax.Array | None,
                  decay_bhqkd: jax.Array | None = None) -> jax.Array:
  """Step 1: s_bhqk = q·k / sqrt(d) + bias in float32, masked entries 0; with `decay_bhqkd`
  (gate_decay) each dimension's product decays by it."""
  scale = q_bqhd.shape[-1]**-0.5
  if decay_bhqkd is None:
    s_bhqk = jnp.einsum("bqhd,bkhd->bhqk", q_bqhd, k_bkhd, preferred_element_type=jnp.float32) * scale
  else:
    s_bhqk = jnp.einsum("bqhd,bkhd,bhqkd->bhqk", q_bqhd.astype(jnp.float32), k_bkhd.astype(jnp.float32),
                        decay_bhqkd) * scale
  if bias is not None:
    s_bhqk = _add_bias(s_bhqk, bias)
  if mask is not None:
    # Zeroing before σ is what keeps masked entries out of the RMS over heads as well.
    s_bhqk = jnp.where(mask, s_bhqk, 0.0)
  return s_bhqk


def gate_decay(log_gate_bkhd: jax.Array, q_pos_q: jax.Array, k_pos_k: jax.Array) -> jax.Array:
  """Π_{k<r≤q} α_r per dimension, float32 [batch, heads, q, k, d], for keys at or before their query
  (0 after it); log_gate: log α ≤ 0 at every key position, queries at positions into the keys. The
  definition, [q, k, d] in full: the kernels never form it."""
  g_bkhd = jnp.cumsum(log_gate_bkhd.astype(jnp.float32), axis=1)
  g_bqhd = g_bkhd[:, q_pos_q]
  diff_bhqkd = jnp.einsum("bqhd->bhqd", g_bqhd)[:, :, :, None] - jnp.einsum("bkhd->bhkd", g_bkhd)[:, :, None]
  # Later keys would decay by a positive exponent: zeroed before exp, so no overflow reaches the gradient.
  before_qk = q_pos_q[:, None] >= k_pos_k[None, :]
  return jnp.where(before_qk[..., None], jnp.exp(jnp.where(before_qk[..., None], diff_bhqkd, 0.0)), 0.0)


@jax.custom_vjp
def _add_bias(s_bhqk: jax.Array, bias: jax.Array) -> jax.Array:
  return s_bhqk + bias.astype(s_bhqk.dtype)


def _add_bias_fwd(s_bhqk, bias):
  return _add_bias(s_bhqk, bias), bias


def _add_bias_bwd(bias, ds_bhqk):
  """The bias's gradient: ds summed over the axes the bias is broadcast along. The batch sum is a
  product with a vector of ones, because XLA's CPU library fusion (YNNPACK) reduces a leading axis
  far slower than it multiplies (docs/results/compositional_throughput.md)."""
  bias_4 = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
  ds = ds_bhqk
  if bias_4.shape[0] == 1 and ds.shape[0] > 1:
    ds = jnp.einsum("b,bhqk->hqk", jnp.ones(ds.shape[:1], ds.dtype), ds)[None]
  axes = tuple(i for i in range(4) if bias_4.shape[i] == 1 and ds.shape[i] > 1)
  return ds_bhqk, jnp.sum(ds, axes, keepdims=True).reshape(bias.shape).astype(bias.dtype)


_add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


def rms_head(s_bhqk: jax.Array) -> tuple[jax.Array, jax.Array]:
  """s divided by its root mean square over the heads of its (q, k) pair, and the reciprocal RMS
  r_b1qk (the blocked kernel's pullback reuses it)."""
  r_b1qk = jax.lax.rsqrt(jnp.mean(jnp.square(s_bhqk), axis=1, keepdims=True) + RMS_HEAD_EPS)
  return s_bhqk * r_b1qk, r_b1qk


def normalize(s_bhqk: jax.Array, mask: jax.Array | None, *, normalization: str,
              lse_bhq: jax.Array | None = None) -> jax.Array:
  """Step 2 on masked scores. Softmax over a slice of the keys takes the full row's log-sum-exp
  `lse_bhq` (as the blocked kernel does); without it, the softmax is over the keys given."""
  if normalization == "softmax":
    if lse_bhq is not None:
      # -inf (not a large negative) where masked: exp gives exactly 0 and a zero gradient.
      s_bhqk = s_bhqk - lse_bhq[..., None]
      return jnp.exp(s_bhqk if mask is None else jnp.where(mask, s_bhqk, -jnp.inf))
    if mask is not None:
      s_bhqk = jnp.where(mask, s_bhqk, jnp.finfo(jnp.float32).min)
    a_bhqk = jax.nn.softmax(s_bhqk, axis=-1)
  elif normalization == "none":
    a_bhqk = s_bhqk
  elif normalization == "rms_head":
    a_bhqk = rms_head(s_bhqk)[0]
  else:
    raise ValueError(f"unknown attention normalization {normalization!r}; "
                     f"choose one of: {', '.join(NORMALIZATIONS)}")
  if mask is not None:
    a_bhqk = jnp.where(mask, a_bhqk, 0.0)
  return a_bhqk


def dropout_keep(rng: jax.Array, q_pos_q: jax.Array, k_pos_k: jax.Array, rate: float) -> jax.Array:
  """Boolean [1, 1, q, k]: the (query, key) pairs attention dropout keeps among the given positions,
  one mask shared over batch and heads (as the paper's code). Counter-based, as flash attention's
  dropout: a pair's draw is the Threefry hash of its (query, key) positions under a key taken from
  `rng`, so a tile of any kernel draws exactly its part of the reference's [t, t] mask."""
  seed = jax.random.bits(rng, (2,), jnp.uint32)
  count_2qk = jnp.stack(jnp.broadcast_arrays(q_pos_q[:, None], k_pos_k[None, :])).astype(jnp.uint32)
  bits_qk = jax_random.threefry_2x32((seed[0], seed[1]), count_2qk)[0]
  return (bits_qk >= jnp.uint32(min(round(rate * 2**32), 2**32 - 1)))[None, None]


def drop(a_bhqk: jax.Array, keep_11qk: jax.Array, rate: float) -> jax.Array:
  """Dropout of normalised scores: kept pairs scaled by 1 / (1 - rate), the others 0."""
  return jnp.where(keep_11qk, a_bhqk / (1 - rate), 0.0)


def apply_value_network(a_bhqk: jax.Array, v_bkhd: jax.Array, *, value_network: str,
                        nonlinearity: str = "relu") -> jax.Array:
  """Step 3, on given scores: [batch, heads, q, k] × [batch, k, heads, d] → [batch, q, heads, d]."""
  a_bhqk = a_bhqk.astype(v_bkhd.dtype)
  if value_network == "linear":
    return jnp.einsum("bhqk,bkhd->bqhd", a_bhqk, v_bkhd)
  if value_network == "hypernetwork":
    # z is the generated first layer applied to x_k: one d-vector per (query, key) pair. Key-major,
    # as the contraction over heads is a matmul batched over keys: z is never transposed.
    z_bkqd = jnp.einsum("bhqk,bkhd->bkqd", a_bhqk, v_bkhd)
    return jnp.einsum("bhqk,bkqd->bqhd", a_bhqk, NONLINEARITIES[nonlinearity](z_bkqd))
  raise ValueError(f"unknown attention value_network {value_network!r}; "
                   f"choose one of: {', '.join(VALUE_NETWORKS)}")


def normalized_scores(q_bqhd: jax.Array, k_bkhd: jax.Array, *, normalization: str, causal: bool = True,
                      segment_ids: jax.Array | None = None, bias: jax.Array | None = None,
                      positions: Positions | None = None, log_gate: jax.Array | None = None) -> jax.Array:
  """Steps 1-2, for evaluation (the latent codes): a_bhqk in float32. For a (q, k) pair, a[:, :, q, k]
  across heads is the pair's latent code; masked entries are exactly 0 in every normalisation."""
  mask = attention_mask(q_bqhd.shape[1], k_bkhd.shape[1], causal=causal, segment_ids=segment_ids,
                        positions=positions)
  decay = None if log_gate is None else gate_decay(
      log_gate, *pair_positions(q_bqhd.shape[1], k_bkhd.shape[1], positions))
  return normalize(masked_scores(q_bqhd, k_bkhd, bias, mask, decay), mask, normalization=normalization)


def reference(q: jax.Array, k: jax.Array, v: jax.Array, *, knobs: Knobs, causal: bool,
              segment_ids: jax.Array | None, bias: jax.Array | None, dropout_rate: float,
              dropout_rng: jax.Array | None, positions: Positions | None = None,
              log_gate: jax.Array | None = None) -> jax.Array:
  """The definition with einsums: [b, h, t, t] scores and, for the hypernetwork, z as [b, t, t, d];
  gated, the decay as [b, h, t, t, d]."""
  a_bhqk = normalized_scores(q, k, normalization=knobs.normalization, causal=causal, segment_ids=segment_ids,
                             bias=bias, positions=positions, log_gate=log_gate)
  if dropout_rate:
    keep_11qk = dropout_keep(dropout_rng, *pair_positions(q.shape[1], k.shape[1], positions), dropout_rate)
    a_bhqk = drop(a_bhqk, keep_11qk, dropout_rate)
  return apply_value_network(a_bhqk, v, value_network=knobs.value_network,
                             nonlinearity=knobs.nonlinearity).astype(q.dtype)


def per_device(local, q, k, v, segment_ids, bias, batch_axes, *, split_heads: bool = True):
  """local(q, k, v, segment_ids, bias) on each device's shard: Mosaic kernels are not partitioned
  automatically, so under a mesh it runs in a shard_map over the mesh axes in `batch_axes` and, when
  `split_heads` (the heads are independent, as in softmax attention), the head (tensor) axis. rms_head
  and the hypernetwork value network couple all heads of a (query, key) pair, so their kernels take
  every head: split_heads=False gathers them on each device of the tensor axis."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.manual_axes:  # no mesh, or inside a shard_map already (the train step's on CPU)
    return local(q, k, v, segment_ids, bias)
  batch = tuple(a for a in batch_axes if a in mesh.axis_names)
  if q.shape[0] % math.prod(mesh.shape[a] for a in batch):
    batch = ()  # fewer rows than shards (initialisation traces one row): every device takes them all
  split = split_heads and tensor_splits(q.shape[2], mesh)
  heads = "tensor" if split else None
  qkv_spec = P(batch, None, heads, None)
  bias_spec = None if bias is None else P(batch if bias.shape[0] > 1 else None,
                                          heads if bias.shape[1] > 1 else None, None, None)
  # check_vma off: the kernels declare their outputs without per-axis variance annotations.
  return jax.shard_map(
      local,
      in_specs=(qkv_spec, qkv_spec, qkv_spec, None if segment_ids is None else P(batch, None), bias_spec),
      out_specs=qkv_spec, check_vma=False)(q, k, v, segment_ids, bias)


def kernel_params(interpret: bool, semantics: tuple[str, ...], vmem_limit_bytes: int) -> dict:
  """pallas_call's arguments for a TPU kernel over a grid of these dimension semantics, with this much
  scoped VMEM; interpret: Pallas's interpreter (any backend)."""
  return dict(
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=vmem_limit_bytes),
      interpret=interpret)


def tensor_splits(heads: int, mesh) -> bool:
  """Whether `per_device` splits `heads` over the mesh's tensor axis (for kernels whose heads are
  independent): when there is one and it divides them."""
  return "tensor" in mesh.axis_names and heads % mesh.shape["tensor"] == 0


def block_visible(causal: bool, i, j, bq: int, bk: int):
  """Whether query block i (of bq queries) sees any key of key block j (of bk keys); i and j may be
  traced grid indices."""
  return True if not causal else j * bk <= i * bq + bq - 1


def visible_blocks(T: int, bq: int, bk: int, causal: bool) -> int:
  """How many (query block, key block) pairs of a length-T row see a key: what a tiled kernel that
  skips the rest computes."""
  return sum(bool(block_visible(causal, i, j, bq, bk)) for i in range(T // bq) for j in range(T // bk))


def last_key_block(causal: bool, i, j, bq: int, bk: int):
  """The key block a Pallas kernel fetches at grid step (query block i, key block j): past the
  diagonal, the last one i sees, so that Pallas (which skips a fetch of the block it already holds)
  reads nothing for the skipped tiles. (lax.div: Mosaic lowers `//` through sign, which asks the TPU's
  generation of the host compiling.)"""
  return jnp.minimum(j, jax.lax.div(i * bq + bq - 1, bk)) if causal else j


def first_query_block(causal: bool, i, j, bq: int, bk: int):
  """The query block a Pallas kernel that walks query blocks per key block fetches at grid step (key
  block j, query block i): before the diagonal, the first one that sees key block j."""
  return jnp.maximum(i, jax.lax.div(j * bk, bq)) if causal else i


def tile_mask(causal: bool, q0, k0, bq: int, bk: int, segq_q1: jax.Array | None,
              segk_1k: jax.Array | None) -> jax.Array | None:
  """Inside a Pallas kernel, the boolean [bq, bk] mask of the tile whose queries start at position q0
  and keys at k0 (2-D iotas, as Mosaic lowers them), with the tile's segment ids segq_q1 [bq, 1] and
  segk_1k [1, bk] (or None); None when every pair is allowed."""
  mask = None
  if causal:
    q_pos = q0 + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    k_pos = k0 + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    mask = q_pos >= k_pos
  if segq_q1 is not None:
    same = segq_q1 == segk_1k
    mask = same if mask is None else mask & same
  return mask


def segment_blocks(segment_ids_bt: jax.Array | None) -> tuple[jax.Array, ...]:
  """A Pallas kernel's segment-id operands: the queries' [B, T, 1] and the keys' [B, 1, T] (so that
  each tile's blocks are a column and a row), or none."""
  return () if segment_ids_bt is None else (segment_ids_bt[:, :, None], segment_ids_bt[:, None, :])
