"""Token cross-entropy of a linear readout, with or without writing the logits.

nll_bt = logsumexp_v(s · x_btd @ w_dv) - s · (x_btd @ w_dv)[target]. The "xla" implementation forms the
[B, T, V] logits and reduces them. The "pallas" one (TPU) never writes them: a forward kernel walks the
vocabulary block by block keeping a running max, sum of exponentials and the target's logit per token,
and a backward kernel recomputes each block's logits once to form both gradients, accumulating dw over
token blocks and dx over vocabulary blocks (dx for a chunk of tokens held on chip): the "xla" form
reads and writes the float32 logits several times a step, the kernels recompute the readout's product
once more instead. "pallas_keep_logits" writes the logits once, in float32, from the forward kernel and
reads them once in the backward kernel: the same numbers up to float32's rounding of the product, one
product fewer, 4 bytes per token and word of memory ("auto" keeps them on TPU up to KEEP_LOGITS_BYTES
per device). The "fused" one (XLA, CPU's choice) walks the tokens in blocks and forms each block's
gradient in the same pass as its loss, for the weighted sum of the losses (readout_loss), whose gradient
is that sum's:
"auto" takes it on CPU and GPU (cuda, rocm), where it holds [512, V] logits at a time, never all.
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

IMPLS = ("auto", "xla", "pallas", "pallas_keep_logits", "fused")
KERNELS = ("pallas", "pallas_keep_logits")
LANES = 128
# Block sizes (tokens; vocabulary: the largest multiple of 128 up to the maximum that divides V). The
# forward kernel reads all of w once per token block, the backward kernel all of x once per vocabulary
# block: large blocks on those axes, within VMEM (a [2048, 3200] float32 tile of logits is 26 MB).
# Backward token blocks of 512, faster than 256 for c4_50m on v5e (docs/results/compile_v5e.md). A
# forward kernel that keeps the logits writes a [1024, 3200] float32 block a step (2,048 tokens overflow
# its VMEM).
BLOCK_TOKENS, BLOCK_TOKENS_BWD, BLOCK_TOKENS_KEEP = 2048, 512, 1024
# Vocabulary blocks of at most MAX_BLOCK_VOCAB words (a [2048, 4096] float32 tile of logits) and
# BLOCK_VOCAB_ELEMENTS elements of w (so that wider models fit VMEM too; 3,200 words of c4_50m's 32,000
# at width 512): the larger the block, the faster the forward kernel (docs/results/compile_v5e.md).
MAX_BLOCK_VOCAB, BLOCK_VOCAB_ELEMENTS = 4096, 512 * 4096
# The backward kernel holds dx in float32 for a chunk of tokens while it walks the vocabulary: at most
# this much VMEM (one chunk for a v5e chip's 8,192 tokens of width 512); more chunks each give a partial
# dw, which XLA sums.
DX_CHUNK_BYTES = 16 * 2**20
VMEM_LIMIT = 64 * 2**20
# "auto" on TPU keeps a device's float32 logits from the forward kernel for the backward one (which
# then forms two products of the readout's size instead of three) up to this size: c4_50m's are 1.0 GiB
# per v5e chip, 8,192 tokens x 32,000 words (docs/results/compile_v5e.md).
KEEP_LOGITS_BYTES = 2 * 2**30
FORWARD, BACKWARD = "cross_entropy_fwd", "cross_entropy_bwd"  # the kernels' pallas_call names
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
  rather than a gather (optax's form) so that XLA fuses it into the log-sum-exp's pass over the logits,
  saving a pass over them (docs/results/compile_v5e.md)."""
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
  sum's gradient in its forward pass; "auto" takes it on CPU and GPU (on TPU readout_nll's "auto")."""
  check_impl(impl)
  plain = lambda x, w, t, wt, impl="auto": (readout_nll(x, w, scale, t, impl=impl, batch_axes=batch_axes,
                                                        interpret=interpret) * wt).sum()
  if impl == "xla" or impl in KERNELS:
    return plain(x_btd, w_dv, targets_bt, weights_bt, impl)
  rows = _mesh_rows(batch_axes)[0]
  # One partial sum per device, summed outside: each device's gradient then scales by its own cotangent.
  per_device = _per_device(lambda x, w, t, wt: _fused_sum(x, w, t, wt, scale=scale)[None], rows,
                           in_specs=(P(rows), P(), P(rows), P(rows)), out_specs=P(rows))
  fused = lambda *args: per_device(*args).sum()
  if impl == "fused":
    return fused(x_btd, w_dv, targets_bt, weights_bt)
  return jax.lax.platform_dependent(x_btd, w_dv, targets_bt, weights_bt, cpu=fused, cuda=fused, rocm=fused,
                                    default=plain)


def readout_nll(x_btd: jax.Array, w_dv: jax.Array, scale: float, targets_bt: jax.Array, *, impl: str = "auto",
                batch_axes: tuple[str, ...] = sharding.BATCH, interpret: bool = False) -> jax.Array:
  """token_nll(scale · x_btd @ w_dv, targets_bt), float32 [B, T]; x and w in the compute dtype. "xla"
  rounds the logits to the compute dtype as the model's forward pass does; the kernels form them in
  float32. "auto" takes the kernels when lowering for TPU and the shapes tile (keeping the logits when
  they fit KEEP_LOGITS_BYTES), "xla" otherwise. Under a
  mesh the kernels run on each device's rows (shard_map over the mesh axes in `batch_axes`; w whole on
  every device)."""
  check_impl(impl)
  if impl == "fused":
    raise ValueError("train.cross_entropy_impl 'fused' gives the weighted sum of the losses (readout_loss), "
                     "not each token's")
  rows, shards = _mesh_rows(batch_axes)
  problem = pallas_problem(targets_bt.size // shards, w_dv.shape[1])
  if impl in KERNELS and problem:
    raise ValueError(f"train.cross_entropy_impl {impl!r}: {problem}; use 'auto' or 'xla'")
  xla = lambda x, w, t: token_nll(Readout(x, w, scale).logits(), t)
  if impl == "xla" or problem:
    return xla(x_btd, w_dv, targets_bt)

  def kernels(keep: bool):
    nll = functools.partial(_pallas_nll, scale=scale, keep=keep, interpret=interpret)
    return _per_device(nll, rows, in_specs=(P(rows), P(), P(rows)), out_specs=P(rows))

  on_tpu = kernels(tpu_kernels(impl, targets_bt.size // shards, w_dv.shape[1]) == "pallas_keep_logits")
  if impl in KERNELS:
    return on_tpu(x_btd, w_dv, targets_bt)
  # The platform being lowered for decides, so a step compiled for TPU on a CPU host gets the kernels.
  return jax.lax.platform_dependent(x_btd, w_dv, targets_bt, tpu=on_tpu, default=xla)


def tpu_kernels(impl: str, tokens: int, V: int) -> str:
  """Which kernels `impl` runs on TPU for `tokens` rows per device of a V-word readout: "pallas" or
  "pallas_keep_logits" ("auto" keeps the logits up to KEEP_LOGITS_BYTES)."""
  if impl in KERNELS:
    return impl
  return "pallas_keep_logits" if 4 * tokens * V <= KEEP_LOGITS_BYTES else "pallas"


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


def _pallas_nll(x_btd, w_dv, targets_bt, *, scale, keep, interpret):
  B, T, D = x_btd.shape
  return _nll(x_btd.reshape(B * T, D), w_dv, targets_bt.reshape(B * T), scale, keep, interpret).reshape(B, T)


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


def _forward_kernel(x_ref, w_ref, rows_ref, out_ref, *refs, scale, keep):
  """out[:, 0] = nll, out[:, 1] = log-sum-exp; running max, sum and target logit over vocabulary blocks j.
  With `keep`, each block's logits are written too, for the backward kernel to read."""
  logits_ref, (m_ref, l_ref, t_ref) = (refs[0], refs[1:]) if keep else (None, refs)
  j, bn, bv = pl.program_id(1), x_ref.shape[0], w_ref.shape[1]

  @pl.when(j == 0)
  def _():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    t_ref[...] = jnp.zeros(t_ref.shape, jnp.float32)

  logits = _logits(x_ref, w_ref, scale)
  if keep:
    logits_ref[...] = logits
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


def _dlogits(logits, rows_ref, j, dtype):
  """d loss / d (x @ w) for one block of logits, in the compute dtype for the matrix unit."""
  bn, bv = logits.shape
  columns = _columns(rows_ref)
  p = jnp.exp(logits - columns[:, LSE:LSE + 1]) - _is_target(columns, j, bn, bv).astype(jnp.float32)
  return (p * columns[:, GRAD:GRAD + 1]).astype(dtype)


def _backward_kernel(x_ref, w_ref, rows_ref, *refs, scale, keep):
  """Both gradients from one block's logits (recomputed, or read as the forward kernel kept them): dw's
  vocabulary block j summed over the chunk's token blocks i (the inner axis), dx's rows summed over the
  vocabulary blocks in a chunk-long scratch."""
  logits_ref, (dx_ref, dw_ref, dx_acc, dw_acc) = (refs[0], refs[1:]) if keep else (None, refs)
  j, i, bn = pl.program_id(1), pl.program_id(2), x_ref.shape[0]
  rows = pl.ds(pl.multiple_of(i * bn, bn), bn)
  logits = logits_ref[...] if keep else _logits(x_ref, w_ref, scale)
  d = _dlogits(logits, rows_ref, j, x_ref.dtype)
  dx = jax.lax.dot_general(d, w_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  dw = jax.lax.dot_general(x_ref[...], d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

  @pl.when(j == 0)
  def _():
    dx_acc[rows, :] = dx

  @pl.when(j > 0)
  def _():
    dx_acc[rows, :] += dx

  @pl.when(i == 0)
  def _():
    dw_acc[...] = dw

  @pl.when(i > 0)
  def _():
    dw_acc[...] += dw

  @pl.when(i == pl.num_programs(2) - 1)
  def _():
    dw_ref[0] = dw_acc[...].astype(dw_ref.dtype)

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    dx_ref[...] = dx_acc[rows, :].astype(dx_ref.dtype)


def _blocks(D: int, V: int, itemsize: int, keep: bool) -> dict[str, tuple[int, int]]:
  """Per kernel, (token block, vocabulary block); the backward kernel's dx chunk is dx_chunk's."""
  bv = block_vocab(V, max(LANES, min(MAX_BLOCK_VOCAB, BLOCK_VOCAB_ELEMENTS // D)))
  # Reading kept float32 logits beside float32 x and w blocks overflows VMEM in blocks of 512 tokens.
  bn_bwd = BLOCK_TOKENS_BWD // 2 if keep and itemsize > 2 else BLOCK_TOKENS_BWD
  return {FORWARD: (BLOCK_TOKENS_KEEP if keep else BLOCK_TOKENS, bv), BACKWARD: (bn_bwd, bv)}


def dx_chunk(N: int, D: int, bn: int) -> int:
  """Tokens per chunk of the backward kernel: the most whole token blocks dividing N whose float32 dx
  fits DX_CHUNK_BYTES (one block at least)."""
  return max(c * bn
             for c in range(1, N // bn + 1)
             if N % (c * bn) == 0 and (c == 1 or c * bn * D * 4 <= DX_CHUNK_BYTES))


def grid_steps(N: int, D: int, V: int, itemsize: int, keep: bool) -> dict[str, int]:
  """Each kernel's grid steps for N tokens of a [D, V] readout (every step computes a block)."""
  return {name: (N // bn) * (V // bv) for name, (bn, bv) in _blocks(D, V, itemsize, keep).items()}


def kernel_costs(N: int, D: int, V: int, itemsize: int, keep: bool) -> dict[str, pl.CostEstimate]:
  """What each kernel declares to XLA's cost analysis: its products' FLOPs, one exponential per logit,
  and its HBM traffic (x, w and the per-token rows read once per block of the other side; the float32
  logits written and read once if kept)."""
  (bn, _), (bn_bwd, bv) = _blocks(D, V, itemsize, keep).values()
  x, w, rows = N * D * itemsize, D * V * itemsize, 8 * N * 4
  chunks = N // dx_chunk(N, D, bn_bwd)
  dw = D * V * (itemsize if chunks == 1 else 4 * chunks)
  cost = lambda flops, bytes_accessed: pl.CostEstimate(flops=flops, transcendentals=N * V, bytes_accessed=
                                                       bytes_accessed)
  logits = 4 * N * V * keep
  return {
      FORWARD: cost(2 * N * D * V, x + w * (N // bn) + rows + 4 * N * LANES + logits),
      BACKWARD: cost((4 if keep else 6) * N * D * V, (x + rows) * (V // bv) + w + x + dw + logits)
  }


def _params(N: int, D: int, V: int, itemsize: int, keep: bool, name: str, *semantics: str) -> dict:
  return dict(
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=VMEM_LIMIT),
      cost_estimate=kernel_costs(N, D, V, itemsize, keep)[name], name=name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _nll(x_nd, w_dv, targets_n, scale, keep, interpret):
  return _nll_fwd(x_nd, w_dv, targets_n, scale, keep, interpret)[0]


def _nll_fwd(x_nd, w_dv, targets_n, scale, keep, interpret):
  (N, D), V = x_nd.shape, w_dv.shape[1]
  rows_8n = jnp.zeros((8, N), jnp.float32).at[TARGET].set(targets_n)
  bn, bv = _blocks(D, V, x_nd.dtype.itemsize, keep)[FORWARD]
  in_specs = [
      pl.BlockSpec((bn, D), lambda i, j: (i, 0)),
      pl.BlockSpec((D, bv), lambda i, j: (0, j)),
      pl.BlockSpec((8, bn), lambda i, j: (0, i))
  ]
  out_specs = [pl.BlockSpec((bn, LANES), lambda i, j: (i, 0))]
  out_shape = [jax.ShapeDtypeStruct((N, LANES), jnp.float32)]
  if keep:
    out_specs.append(pl.BlockSpec((bn, bv), lambda i, j: (i, j)))
    out_shape.append(jax.ShapeDtypeStruct((N, V), jnp.float32))
  scratch = [pltpu.VMEM((bn, LANES), jnp.float32)] * 3  # running max, sum and target logit
  call = pl.pallas_call(functools.partial(_forward_kernel, scale=scale,
                                          keep=keep), grid=(N // bn, V // bv), in_specs=in_specs,
                        out_specs=out_specs, out_shape=out_shape, scratch_shapes=scratch, interpret=interpret,
                        **_params(N, D, V, x_nd.dtype.itemsize, keep, FORWARD, "parallel", "arbitrary"))
  out, *logits_nv = call(x_nd, w_dv, rows_8n)
  return out[:, 0], (x_nd, w_dv, rows_8n.at[LSE].set(out[:, 1]), *logits_nv)


def _nll_bwd(scale, keep, interpret, residuals, g_n):
  x_nd, w_dv, rows_8n, *logits_nv = residuals
  (N, D), V = x_nd.shape, w_dv.shape[1]
  rows_8n = rows_8n.at[GRAD].set(g_n.astype(jnp.float32) * scale)
  bn, bv = _blocks(D, V, x_nd.dtype.itemsize, keep)[BACKWARD]
  chunk = dx_chunk(N, D, bn)
  C, nv, ni = N // chunk, V // bv, chunk // bn
  # One chunk's dw is the gradient, in w's dtype; several give float32 partials to sum.
  dw_dtype = w_dv.dtype if C == 1 else jnp.float32
  token = lambda c, i: c * ni + i
  logits_spec = [pl.BlockSpec((bn, bv), lambda c, j, i: (token(c, i), j))] * keep
  dx, dw = pl.pallas_call(
      functools.partial(_backward_kernel, scale=scale, keep=keep),
      grid=(C, nv, ni),
      in_specs=[
          pl.BlockSpec((bn, D), lambda c, j, i: (token(c, i), 0)),
          pl.BlockSpec((D, bv), lambda c, j, i: (0, j)),
          pl.BlockSpec((8, bn), lambda c, j, i: (0, token(c, i))), *logits_spec
      ],
      # dx's block stays put until the last vocabulary block has written it, so each is stored once.
      out_specs=[
          pl.BlockSpec((bn, D), lambda c, j, i: (token(c, jnp.where(j == nv - 1, i, 0)), 0)),
          pl.BlockSpec((1, D, bv), lambda c, j, i: (c, 0, j))
      ],
      out_shape=[jax.ShapeDtypeStruct(x_nd.shape, x_nd.dtype),
                 jax.ShapeDtypeStruct((C, D, V), dw_dtype)],
      scratch_shapes=[pltpu.VMEM((chunk, D), jnp.float32),
                      pltpu.VMEM((D, bv), jnp.float32)],
      interpret=interpret,
      **_params(N, D, V, x_nd.dtype.itemsize, keep, BACKWARD, "parallel", "arbitrary",
                "arbitrary"))(x_nd, w_dv, rows_8n, *logits_nv)
  return dx, dw[0] if C == 1 else dw.sum(0).astype(w_dv.dtype), None


_nll.defvjp(_nll_fwd, _nll_bwd)
