"""Token cross-entropy of a linear readout, with or without writing the logits.

nll_bt = logsumexp_v(s · x_btd @ w_dv) - s · (x_btd @ w_dv)[target]. The "xla" implementation forms the
[B, T, V] logits and reduces them. The "pallas" one (TPU) never writes them: a forward kernel walks the
vocabulary block by block keeping a running max, sum of exponentials and the target's logit per token,
and two backward kernels recompute each block's logits to form its gradient, one accumulating dx over
vocabulary blocks, one accumulating dw over token blocks. At V = 32,000 the logits of a v5e chip's
8,192 tokens are 1 GB in float32, read and written several times per step by the "xla" form; the
kernels trade that traffic for recomputing the readout's product twice in the backward pass. The
"fused" one (XLA, CPU's choice) walks the tokens in blocks and forms each block's gradient in the same
pass as its loss, for the weighted sum of the losses (readout_loss), whose gradient is that sum's.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from lm import sharding

IMPLS = ("auto", "xla", "pallas", "fused")
LANES = 128
# Block sizes (tokens; vocabulary: the largest multiple of 128 up to the maximum that divides V). The
# forward and dx kernels read all of w once per token block, the dw kernel all of x once per
# vocabulary block: large blocks on those axes, within VMEM (a [2048, 640] float32 tile is 5.2 MB).
BLOCK_TOKENS, MAX_BLOCK_VOCAB = 2048, 1024
BLOCK_TOKENS_DW, MAX_BLOCK_VOCAB_DW = 256, 4096
VMEM_LIMIT = 64 * 2**20
# Tokens per step of the fused form's loop: [512, V] float32 logits at a time.
FUSED_BLOCK = 512


class Readout(NamedTuple):
  """What the model gives a loss that forms its own logits: logits = scale · x_btd @ w_dv."""
  x_btd: jax.Array
  w_dv: jax.Array
  scale: float

  def logits(self) -> jax.Array:
    """[B, T, V] in the compute dtype, as the model's forward pass returns them (before float32)."""
    return self.x_btd @ self.w_dv * self.scale


def token_nll(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
  """Negative log-likelihood of every target token, in float32: [B, T]. Log-sum-exp minus the target's
  logit, never writing the [B, T, V] log-probabilities. The target's logit is picked by a masked sum
  rather than a gather (optax's form) so that XLA fuses it into the log-sum-exp's pass over the logits:
  0.91 GB less HBM traffic per chip and step for configs/c4_50m.py on v5e (docs/compile_table.md)."""
  logits_btv = logits_btv.astype(jnp.float32)
  is_target_btv = jnp.arange(logits_btv.shape[-1]) == targets_bt[..., None]
  return jax.nn.logsumexp(logits_btv, axis=-1) - jnp.where(is_target_btv, logits_btv, 0.0).sum(-1)


def block_vocab(V: int, most: int) -> int | None:
  """The largest multiple of 128 up to `most` that divides V (None if there is none)."""
  return next((b for b in range(most - most % LANES, 0, -LANES) if V % b == 0), None)


def pallas_problem(tokens: int, V: int) -> str | None:
  """Why the pallas kernels cannot take `tokens` rows (per device) of a V-word readout (None if they can)."""
  if V % LANES:
    return f"the vocabulary ({V}) is not a multiple of {LANES}"
  if tokens % BLOCK_TOKENS:
    return f"the tokens per device ({tokens}) are not a multiple of {BLOCK_TOKENS}"
  if V > 2**24:
    return "target ids beyond float32's exact integers"
  return None


def readout_loss(x_btd: jax.Array, w_dv: jax.Array, scale: float, targets_bt: jax.Array,
                 weights_bt: jax.Array, *, impl: str = "auto", batch_axes: tuple[str, ...] = sharding.BATCH,
                 interpret: bool = False) -> jax.Array:
  """Σ_bt weights_bt · nll_bt, a float32 scalar, with nll_bt = readout_nll(...). "fused" computes the
  sum's gradient in its forward pass; "auto" takes it on CPU (the others as readout_nll's "auto")."""
  check_impl(impl)
  plain = lambda x, w, t, wt, impl="auto": (readout_nll(x, w, scale, t, impl=impl, batch_axes=batch_axes,
                                                        interpret=interpret) * wt).sum()
  if impl in ("xla", "pallas"):
    return plain(x_btd, w_dv, targets_bt, weights_bt, impl)
  rows = _mesh_rows(batch_axes)[0]
  # One partial sum per device, summed outside: each device's gradient then scales by its own cotangent.
  per_device = _per_device(lambda x, w, t, wt: _fused_sum(x, w, t, wt, scale=scale)[None], rows,
                           in_specs=(P(rows), P(), P(rows), P(rows)), out_specs=P(rows))
  fused = lambda *args: per_device(*args).sum()
  if impl == "fused":
    return fused(x_btd, w_dv, targets_bt, weights_bt)
  return jax.lax.platform_dependent(x_btd, w_dv, targets_bt, weights_bt, cpu=fused, default=plain)


def readout_nll(x_btd: jax.Array, w_dv: jax.Array, scale: float, targets_bt: jax.Array, *, impl: str = "auto",
                batch_axes: tuple[str, ...] = sharding.BATCH, interpret: bool = False) -> jax.Array:
  """token_nll(scale · x_btd @ w_dv, targets_bt), float32 [B, T]; x and w in the compute dtype. "xla"
  rounds the logits to the compute dtype as the model's forward pass does; the kernels keep them in
  float32. "auto" takes the kernels when lowering for TPU and the shapes tile, "xla" otherwise. Under a
  mesh the kernels run on each device's rows (shard_map over the mesh axes in `batch_axes`; w whole on
  every device)."""
  check_impl(impl)
  if impl == "fused":
    raise ValueError("train.cross_entropy_impl 'fused' gives the weighted sum of the losses (readout_loss), "
                     "not each token's")
  rows, shards = _mesh_rows(batch_axes)
  problem = pallas_problem(targets_bt.size // shards, w_dv.shape[1])
  if impl == "pallas" and problem:
    raise ValueError(f"train.cross_entropy_impl 'pallas': {problem}; use 'auto' or 'xla'")
  xla = lambda x, w, t: token_nll(Readout(x, w, scale).logits(), t)
  if impl == "xla" or problem:
    return xla(x_btd, w_dv, targets_bt)
  kernels = _per_device(functools.partial(_pallas_nll, scale=scale, interpret=interpret), rows,
                        in_specs=(P(rows), P(), P(rows)), out_specs=P(rows))
  if impl == "pallas":
    return kernels(x_btd, w_dv, targets_bt)
  # The platform being lowered for decides, so a step compiled for TPU on a CPU host gets the kernels.
  return jax.lax.platform_dependent(x_btd, w_dv, targets_bt, tpu=kernels, default=xla)


def check_impl(impl: str) -> None:
  if impl not in IMPLS:
    raise ValueError(f"unknown train.cross_entropy_impl {impl!r}; choose one of: {', '.join(IMPLS)}")


def _mesh_rows(batch_axes: tuple[str, ...]) -> tuple[tuple[str, ...], int]:
  """The mesh axes among `batch_axes` that split the rows, and how many shards they make (none inside
  a shard_map, such as the CPU train step's, where the rows are one device's already)."""
  mesh = sharding.partitioned_mesh()
  rows = () if mesh is None else tuple(a for a in batch_axes if a in mesh.axis_names)
  return rows, math.prod(mesh.shape[a] for a in rows)


def _per_device(fn, rows: tuple[str, ...], *, in_specs, out_specs):
  """fn on each device's rows when a mesh splits them (w, given as P(), whole on every device)."""
  if not rows:
    return fn
  # check_vma off: the kernels declare their outputs without per-axis variance annotations.
  return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _fused_sum(x_btd, w_dv, targets_bt, weights_bt, *, scale):
  """Σ weights · nll over one device's tokens, padded to whole blocks with tokens of weight 0."""
  N = targets_bt.size
  pad = -N % min(FUSED_BLOCK, N)
  flat = lambda a: jnp.pad(a.reshape(N, *a.shape[2:]), [(0, pad)] + [(0, 0)] * (a.ndim - 2))
  return _fused(flat(x_btd), w_dv, flat(targets_bt), flat(weights_bt).astype(jnp.float32), scale)


def _fused_pass(x_nd, w_dv, targets_n, weights_n, scale):
  """The weighted sum, each token's nll, and the sum's gradients dx and dw, block by block: each
  block's logits are formed once and give its loss and its gradient. Autodiff of the plain form on CPU
  writes the [N, V] logit gradient and transposes it for w's gradient; this form never holds more
  than a block of either."""
  (N, D), c = x_nd.shape, min(FUSED_BLOCK, x_nd.shape[0])
  blocks = (x_nd.reshape(N // c, c, D), targets_n.reshape(N // c, c), weights_n.reshape(N // c, c))

  def block(dw_dv, xs):
    x_cd, t_c, wt_c = xs
    logits_cv = Readout(x_cd, w_dv, scale).logits().astype(jnp.float32)
    lse_c = jax.nn.logsumexp(logits_cv, axis=-1)
    is_target_cv = jnp.arange(logits_cv.shape[-1]) == t_c[:, None]
    nll_c = lse_c - jnp.where(is_target_cv, logits_cv, 0.0).sum(-1)
    # d(Σ wt · nll) / d logits = wt · (softmax − one-hot), times the readout's scale for x and w.
    d_cv = ((jnp.exp(logits_cv - lse_c[:, None]) - is_target_cv) * (wt_c * scale)[:, None]).astype(x_nd.dtype)
    dx_cd = jnp.dot(d_cv, w_dv.T, preferred_element_type=jnp.float32).astype(x_nd.dtype)
    return dw_dv + jnp.dot(x_cd.T, d_cv, preferred_element_type=jnp.float32), (nll_c, dx_cd)

  dw_dv, (nll, dx) = jax.lax.scan(block, jnp.zeros(w_dv.shape, jnp.float32), blocks)
  nll_n = nll.reshape(N)
  return (nll_n * weights_n).sum(), nll_n, dx.reshape(N, D), dw_dv.astype(w_dv.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(x_nd, w_dv, targets_n, weights_n, scale):
  return _fused_pass(x_nd, w_dv, targets_n, weights_n, scale)[0]


def _fused_fwd(x_nd, w_dv, targets_n, weights_n, scale):
  total, nll_n, dx_nd, dw_dv = _fused_pass(x_nd, w_dv, targets_n, weights_n, scale)
  return total, (nll_n, dx_nd, dw_dv)


def _fused_bwd(scale, residuals, g):
  del scale
  nll_n, dx_nd, dw_dv = residuals
  return (g * dx_nd).astype(dx_nd.dtype), (g * dw_dv).astype(dw_dv.dtype), None, g * nll_n


_fused.defvjp(_fused_fwd, _fused_bwd)


def _pallas_nll(x_btd, w_dv, targets_bt, *, scale, interpret):
  B, T, D = x_btd.shape
  return _nll(x_btd.reshape(B * T, D), w_dv, targets_bt.reshape(B * T), scale, interpret).reshape(B, T)


# Per-token values travel as rows of one [8, N] float32 array (a token's values down a column: 8 x 4
# bytes per token in HBM, where an [N, 1] column would be padded to a 128-lane tile): the target id
# (exact in float32 below 2**24), the log-sum-exp, the loss's cotangent times the scale.
TARGET, LSE, GRAD = 0, 1, 2


def _columns(rows_ref):
  """The block's per-token values as [bn, 8] columns, to broadcast along the vocabulary."""
  return rows_ref[...].T


def _logits(x_ref, w_ref, scale):
  return jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32) * scale


def _is_target(columns, j, bn, bv):
  return (j * bv + jax.lax.broadcasted_iota(jnp.int32,
                                            (bn, bv), 1)) == columns[:, TARGET:TARGET + 1].astype(jnp.int32)


def _forward_kernel(x_ref, w_ref, rows_ref, out_ref, m_ref, l_ref, t_ref, *, scale):
  """out[:, 0] = nll, out[:, 1] = log-sum-exp; running max, sum and target logit over vocabulary blocks j."""
  j, bn, bv = pl.program_id(1), x_ref.shape[0], w_ref.shape[1]

  @pl.when(j == 0)
  def _():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    t_ref[...] = jnp.zeros(t_ref.shape, jnp.float32)

  logits = _logits(x_ref, w_ref, scale)
  m_old = m_ref[:, :1]
  m_new = jnp.maximum(m_old, logits.max(axis=1, keepdims=True))
  l_new = l_ref[:, :1] * jnp.exp(m_old - m_new) + jnp.exp(logits - m_new).sum(axis=1, keepdims=True)
  hit = _is_target(_columns(rows_ref), j, bn, bv)
  t_new = t_ref[:, :1] + jnp.where(hit, logits, 0.0).sum(axis=1, keepdims=True)
  m_ref[...], l_ref[...], t_ref[...] = (jnp.broadcast_to(a, m_ref.shape) for a in (m_new, l_new, t_new))

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    lse = m_ref[...] + jnp.log(l_ref[...])
    lane = jax.lax.broadcasted_iota(jnp.int32, out_ref.shape, 1)
    out_ref[...] = jnp.where(lane == 0, lse - t_ref[...], lse)


def _dlogits(x_ref, w_ref, rows_ref, j, scale):
  """d loss / d (x @ w) for one block, in the compute dtype for the matrix unit."""
  logits = _logits(x_ref, w_ref, scale)
  bn, bv = logits.shape
  columns = _columns(rows_ref)
  p = jnp.exp(logits - columns[:, LSE:LSE + 1]) - _is_target(columns, j, bn, bv).astype(jnp.float32)
  return (p * columns[:, GRAD:GRAD + 1]).astype(x_ref.dtype)


def _dx_kernel(x_ref, w_ref, rows_ref, dx_ref, acc_ref, *, scale):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _():
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  d = _dlogits(x_ref, w_ref, rows_ref, j, scale)
  acc_ref[...] += jax.lax.dot_general(d, w_ref[...], (((1,), (1,)), ((), ())),
                                      preferred_element_type=jnp.float32)

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    dx_ref[...] = acc_ref[...].astype(dx_ref.dtype)


def _dw_kernel(x_ref, w_ref, rows_ref, dw_ref, acc_ref, *, scale):
  j, i = pl.program_id(0), pl.program_id(1)

  @pl.when(i == 0)
  def _():
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  d = _dlogits(x_ref, w_ref, rows_ref, j, scale)
  acc_ref[...] += jax.lax.dot_general(x_ref[...], d, (((0,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32)

  @pl.when(i == pl.num_programs(1) - 1)
  def _():
    dw_ref[...] = acc_ref[...].astype(dw_ref.dtype)


def _call(kernel, x_nd, w_dv, rows_8n, *, bn, bv, tokens_first, out_specs, out_shape, scratch, flops,
          bytes_accessed, interpret, name, scale):
  """A kernel over token blocks i (bn rows) and vocabulary blocks j (bv columns) taking (x, w, rows):
  the grid walks j inside i (tokens_first) or i inside j; the inner axis is the one reduced over."""
  (N, D), V = x_nd.shape, w_dv.shape[1]
  ij = (lambda i, j: (i, j)) if tokens_first else (lambda j, i: (i, j))
  at = lambda f: (lambda *g: f(*ij(*g)))
  in_specs = [
      pl.BlockSpec((bn, D), at(lambda i, j: (i, 0))),
      pl.BlockSpec((D, bv), at(lambda i, j: (0, j))),
      pl.BlockSpec((8, bn), at(lambda i, j: (0, i)))
  ]
  return pl.pallas_call(
      functools.partial(kernel, scale=scale), grid=(N // bn, V // bv) if tokens_first else (V // bv, N // bn),
      in_specs=in_specs, out_specs=out_specs(at), out_shape=out_shape, scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                           vmem_limit_bytes=VMEM_LIMIT), interpret=interpret, name=name,
      cost_estimate=pl.CostEstimate(flops=flops, transcendentals=N * V,
                                    bytes_accessed=bytes_accessed))(x_nd, w_dv, rows_8n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _nll(x_nd, w_dv, targets_n, scale, interpret):
  return _nll_fwd(x_nd, w_dv, targets_n, scale, interpret)[0]


def _nll_fwd(x_nd, w_dv, targets_n, scale, interpret):
  (N, D), V = x_nd.shape, w_dv.shape[1]
  rows_8n = jnp.zeros((8, N), jnp.float32).at[TARGET].set(targets_n)
  bn, bv = BLOCK_TOKENS, block_vocab(V, MAX_BLOCK_VOCAB)
  out = _call(_forward_kernel, x_nd, w_dv, rows_8n, bn=bn, bv=bv, tokens_first=True,
              out_specs=lambda at: pl.BlockSpec(
                  (bn, LANES), at(lambda i, j: (i, 0))), out_shape=jax.ShapeDtypeStruct(
                      (N, LANES), jnp.float32), scratch=[pltpu.VMEM(
                          (bn, LANES), jnp.float32)] * 3, flops=2 * N * D * V,
              bytes_accessed=x_nd.nbytes + w_dv.nbytes * (N // bn) + rows_8n.nbytes + 4 * N * LANES,
              interpret=interpret, name="cross_entropy_fwd", scale=scale)
  return out[:, 0], (x_nd, w_dv, rows_8n.at[LSE].set(out[:, 1]))


def _nll_bwd(scale, interpret, residuals, g_n):
  x_nd, w_dv, rows_8n = residuals
  (N, D), V = x_nd.shape, w_dv.shape[1]
  rows_8n = rows_8n.at[GRAD].set(g_n.astype(jnp.float32) * scale)
  bn, bv = BLOCK_TOKENS, block_vocab(V, MAX_BLOCK_VOCAB)
  dx = _call(_dx_kernel, x_nd, w_dv, rows_8n, bn=bn, bv=bv, tokens_first=True,
             out_specs=lambda at: pl.BlockSpec(
                 (bn, D), at(lambda i, j: (i, 0))), out_shape=jax.ShapeDtypeStruct(x_nd.shape, x_nd.dtype),
             scratch=[pltpu.VMEM((bn, D), jnp.float32)], flops=4 * N * D * V,
             bytes_accessed=2 * x_nd.nbytes + w_dv.nbytes * (N // bn) + rows_8n.nbytes, interpret=interpret,
             name="cross_entropy_bwd_dx", scale=scale)
  # dw walks every token block once per vocabulary block: wide vocabulary blocks, narrow token blocks.
  bn, bv = BLOCK_TOKENS_DW, block_vocab(V, MAX_BLOCK_VOCAB_DW)
  dw = _call(_dw_kernel, x_nd, w_dv, rows_8n, bn=bn, bv=bv, tokens_first=False,
             out_specs=lambda at: pl.BlockSpec(
                 (D, bv), at(lambda i, j: (0, j))), out_shape=jax.ShapeDtypeStruct(w_dv.shape, w_dv.dtype),
             scratch=[pltpu.VMEM((D, bv), jnp.float32)], flops=4 * N * D * V,
             bytes_accessed=(x_nd.nbytes + rows_8n.nbytes) * (V // bv) + 2 * w_dv.nbytes, interpret=interpret,
             name="cross_entropy_bwd_dw", scale=scale)
  return dx, dw, None


_nll.defvjp(_nll_fwd, _nll_bwd)
