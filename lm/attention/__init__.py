"""Attention: the named variants, the knobs, and the one table of implementations.

`attend(q, k, v, *, normalization, value_network, ...)` maps q, k, v [batch, seq, heads, head_dim] to
[batch, seq, heads, head_dim] by the core defined in lm/attention/core.py (scores, normalisation,
dropout, value network), through the implementation `impl` names. `IMPLS` below says what each
implementation supports; validation (`check`), the choice of `impl="auto"` (`choose_impl`) and dispatch
read it and nothing else. `impl="reference"` is the literal definition, the ground truth the others are
tested against; `auto` takes, per platform, the first row of the table that supports the call.
What runs on GPU: softmax through cuDNN's flash attention (`cudnn`) where it holds (bfloat16 or
float16, no packed-document segments, no bias), else jax's Pallas GPU flash attention (`pallas_gpu`,
which takes segment ids), XLA's [T, T] form (`dot_product`) only at short lengths; linear attention
`chunked`; every other setting `blocked`.

Where a change goes (docs/reference/attention.md has the full checklist):
  - a normalisation: core.NORMALIZATIONS and core.normalize, its numpy version in tests/test_attention.py;
    one that couples keys as softmax does also needs its row statistics in the blocked kernel.
  - a value network: core.VALUE_NETWORKS (its products per pair, which lm/flops.py counts) and
    core.apply_value_network, with a test in tests/test_attention.py. A new φ: core.NONLINEARITIES.
  - a named variant: a row of PRESETS (the model config's `attention` names one).
  - a gated variant (scores decayed by a gate made from the layer's input, `gated=True`): the gate's
    parameters in lm/model.py (`_log_gate`), its decoding state in lm/attention/decode_cache.py; only
    the rows with `gate` take its log α (lm/attention/gated.py: the recurrence and its chunked form).
  - an implementation: a module lm/attention/<name>.py that imports only core.py, a row of IMPLS, and
    its comparison with the reference (values and gradients) in tests/test_attention_fast.py.
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax

from lm import sharding
from lm.attention import (
    blocked,
    core,
    gated,
    hypernetwork,
    linear,
    softmax,
)
from lm.attention.core import NONLINEARITIES, NORMALIZATIONS, VALUE_NETWORKS, Knobs, normalized_scores  # noqa: F401  (public)

# Paper section 2: the three main variants and the ablations, each a full setting of the knobs; then
# the baselines from outside the paper.
PRESETS: dict[str, dict[str, str | bool]] = {
    "softmax":
        dict(normalization="softmax", value_network="linear"),
    "linear":
        dict(normalization="none", value_network="linear"),
    "hyla":
        dict(normalization="rms_head", value_network="hypernetwork", nonlinearity="relu"),
    "linear_rms_head":
        dict(normalization="rms_head", value_network="linear"),
    "hyla_no_rms_head":
        dict(normalization="none", value_network="hypernetwork", nonlinearity="relu"),
    "hyla_no_nonlinearity":
        dict(normalization="rms_head", value_network="hypernetwork", nonlinearity="identity"),
    "hyla_softmax":
        dict(normalization="softmax", value_network="hypernetwork", nonlinearity="relu"),
    **{
        f"hyla_{phi}": dict(normalization="rms_head", value_network="hypernetwork", nonlinearity=phi) for phi in ("gelu", "silu", "sigmoid", "tanh")
    },
    # Gated linear attention (Yang et al. 2024): linear attention whose state decays by a gate made
    # from the layer's input (lm/model.py); its projections, feature maps and normalisation are ours.
    "gla":
        dict(normalization="none", value_network="linear", gated=True),
}


def preset(name: str) -> dict[str, str | bool]:
  """The knob settings of a named variant; unknown names fail listing the valid ones."""
  if name not in PRESETS:
    raise ValueError(f"unknown attention {name!r}; choose one of: {', '.join(PRESETS)}")
  return {"nonlinearity": "relu", **PRESETS[name]}


class Impl(NamedTuple):
  """An implementation and what it supports. `fn(q, k, v, *, segment_ids, ...)` takes exactly what
  its row supports: `knobs` unless it computes one preset's setting, `causal` when it is bidirectional
  too, `bias`, `dropout_rate` with `dropout_rng`, and `log_gate` (`gate`)."""
  fn: Callable[..., jax.Array]
  auto: dict[str, int | None]  # platform → the longest length `auto` takes it for (None: any)
  # The presets whose normalisation and value network it computes (any φ); empty: every setting.
  computes: tuple[str, ...] = ()
  bidirectional: bool = True
  bias: bool = True
  dropout: bool = True
  cross: bool = False  # query and key lengths may differ, at explicit positions (`positions`)
  tile: int = 1  # lengths must be multiples of this
  memory_linear: bool = True  # training memory linear in the sequence length
  segments: bool = True  # takes packed-document segment ids
  dtypes: tuple[str, ...] = ()  # the input dtypes it takes; empty: any
  head_dims: tuple[int, int] = (1, 2**31)  # head widths it takes: (a multiple of, at most)
  gate: bool = False  # takes a gated call's log α (`log_gate`); without one it computes α = 1


# Platforms `auto` chooses for; "gpu" is lax.platform_dependent's default branch (cuda, rocm).
PLATFORMS = ("cpu", "tpu", "gpu")
ANYWHERE = {p: None for p in PLATFORMS}
# On CPU, XLA's softmax attention beats the blocked kernel below this length and loses from it on
# (benchmarks/attention.py).
CPU_BLOCKED_FROM = 1024
# On TPU, auto has HYLA's kernels keep z for the backward pass up to this length (see the table).
KEEP_Z_UP_TO = 512
# On GPU, XLA's softmax attention ([T, T] scores in memory) only where no fused kernel serves the call
# and the scores stay small.
GPU_DOT_PRODUCT_UP_TO = 512

# Table order is auto's preference.
IMPLS: dict[str, Impl] = {
    # The Pallas TPU splash-attention kernel (lm/attention/softmax.py), in a shard_map over the mesh.
    "splash":
        Impl(functools.partial(softmax.attend_splash, batch_axes=sharding.BATCH), computes=("softmax",),
             bias=False, dropout=False, tile=softmax.PALLAS_BLOCK, auto={"tpu": None}),
    # The Pallas TPU flash-attention kernel (lm/attention/softmax.py), in a shard_map over the mesh.
    "pallas":
        Impl(functools.partial(softmax.attend_pallas, batch_axes=sharding.BATCH), computes=("softmax",),
             dropout=False, tile=softmax.PALLAS_BLOCK, auto={"tpu": None}),
    # The Pallas TPU kernels of the hypernetwork value network (lm/attention/hypernetwork.py), the
    # forward pass keeping each tile's z for the backward: a third fewer of the backward kernel's
    # vector multiply-adds, for memory that grows with the square of the length (20 MiB a row and
    # layer at 512 tokens in bfloat16), so auto takes it up to 512 tokens only.
    "pallas_hypernetwork_keep_z":
        Impl(
            functools.partial(hypernetwork.attend_pallas_hypernetwork, batch_axes=sharding.BATCH,
                              keep_z=True), computes=("hyla", "hyla_no_rms_head"), bias=False, dropout=False,
            tile=hypernetwork.BLOCK_K, memory_linear=False, auto={"tpu": KEEP_Z_UP_TO}),
    # The same kernels recomputing z in the backward pass: memory linear in the length.
    "pallas_hypernetwork":
        Impl(functools.partial(hypernetwork.attend_pallas_hypernetwork,
                               batch_axes=sharding.BATCH), computes=("hyla", "hyla_no_rms_head"), bias=False,
             dropout=False, tile=hypernetwork.BLOCK_K, auto={"tpu": None}),
    # Linear attention in Pallas TPU kernels, quadratic as flash attention (lm/attention/linear.py): on
    # TPU faster than the chunks below, whose XLA form writes their intermediates to HBM.
    "pallas_linear":
        Impl(functools.partial(linear.attend_pallas_linear, batch_axes=sharding.BATCH), computes=("linear",),
             bias=False, dropout=False, tile=linear.BLOCKS[-1], auto={"tpu": None}),
    # Causal linear attention in O(t·d²) (lm/attention/linear.py).
    "chunked":
        Impl(linear.attend_chunked, computes=("linear",), bidirectional=False, bias=False, dropout=False,
             auto=ANYWHERE),
    # Gated linear attention in chunks, O(t·C·d + t·d²) (lm/attention/gated.py); after "chunked", which
    # takes ungated linear attention.
    "gla_chunked":
        Impl(gated.attend_chunked, computes=("gla",), bidirectional=False, bias=False, dropout=False,
             gate=True, auto=ANYWHERE),
    # Its recurrence, one token per step (lm/attention/gated.py): the ground truth of the chunks; never
    # auto's choice (a sequential scan over the length).
    "gla_recurrent":
        Impl(gated.attend_recurrent, computes=("gla",), bidirectional=False, bias=False, dropout=False,
             gate=True, auto={}),
    # cuDNN's flash attention (jax.nn.dot_product_attention, implementation="cudnn"), GPU only:
    # bfloat16 or float16, head widths a multiple of 8 up to 128, causal or not, as many keys as
    # queries; no segments (jax passes a mask as a [T, T] bias), bias or dropout.
    "cudnn":
        Impl(softmax.attend_cudnn, computes=("softmax",), bias=False, dropout=False, segments=False,
             dtypes=softmax.CUDNN_DTYPES, head_dims=(softmax.CUDNN_HEAD_MULTIPLE, softmax.CUDNN_MAX_HEAD),
             auto={"gpu": None}),
    # jax's Pallas GPU (Triton) flash attention (lm/attention/softmax.py), in a shard_map over the
    # mesh: segment ids, any float dtype, lengths a multiple of 128; no bias or dropout.
    "pallas_gpu":
        Impl(functools.partial(softmax.attend_pallas_gpu, batch_axes=sharding.BATCH), computes=("softmax",),
             bias=False, dropout=False, tile=softmax.PALLAS_BLOCK, auto={"gpu": None}),
    # jax.nn.dot_product_attention as XLA forms it on every platform: the [T, T] scores in memory.
    "dot_product":
        Impl(softmax.attend_dot_product, computes=("softmax",), dropout=False, memory_linear=False, auto={
            "cpu": CPU_BLOCKED_FROM - 1,
            "gpu": GPU_DOT_PRODUCT_UP_TO
        }),
    # Every setting, tiled over query and key blocks (lm/attention/blocked.py).
    "blocked":
        Impl(blocked.attend_blocked, auto=ANYWHERE),
    # The definition itself (lm/attention/core.py); auto's last resort, for cross-attention.
    "reference":
        Impl(core.reference, cross=True, memory_linear=False, gate=True, auto=ANYWHERE),
}


@functools.cache
def gpu_backend() -> bool:
  """Whether this process has a GPU backend (a CUDA or ROCm plugin with devices)."""
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


class Call(NamedTuple):
  """What a call asks of an implementation besides the knobs; lengths None when not yet known."""
  q_len: int | None
  k_len: int | None
  causal: bool
  bias: bool
  dropout: bool
  positions: bool = False  # explicit query and key positions (a decoding cache)
  # Packed-document segment ids, the inputs' dtype name and head width; None when not yet known.
  segments: bool | None = None
  dtype: str | None = None
  head_dim: int | None = None


def keeps_z(name: str) -> bool:
  """Whether implementation `name` keeps the hypernetwork's z from the forward pass (memory that grows
  with the square of the length)."""
  fn = IMPLS[name].fn
  return isinstance(fn, functools.partial) and fn.keywords.get("keep_z", False)


def unsupported(name: str, knobs: Knobs, call: Call) -> str | None:
  """Why implementation `name` cannot serve this call (with the fix), or None when it can."""
  impl = IMPLS[name]
  settings = [(preset(p)["normalization"], preset(p)["value_network"]) for p in impl.computes]
  if settings and (knobs.normalization, knobs.value_network) not in settings:
    listed = " or ".join(f"{n}/{v}" for n, v in settings)
    return (f"computes {' and '.join(impl.computes)} attention only (normalization/value_network {listed}), "
            f"not {knobs.normalization}/{knobs.value_network}; use impl 'auto' or 'blocked'")
  if not call.causal and not impl.bidirectional:
    return "computes causal attention only; for bidirectional attention use impl 'auto' or 'blocked'"
  if knobs.gated and not impl.gate:
    return "takes no gate; use impl 'auto', 'gla_chunked' or 'reference'"
  if call.bias and not impl.bias:
    return ("takes no position bias; use model.positions rotary, learned or none, or impl 'auto' or "
            "'blocked'")
  if call.dropout and not impl.dropout:
    return "applies no attention dropout; use impl 'auto' or 'blocked', or attention_dropout 0"
  if call.positions and not impl.cross:
    return "takes no explicit query and key positions; use impl 'auto' or 'reference'"
  if call.segments and not impl.segments:
    return "takes no packed-document segment ids; use impl 'auto' or 'pallas_gpu'"
  if impl.dtypes and call.dtype is not None and call.dtype not in impl.dtypes:
    return (f"takes {' or '.join(impl.dtypes)} inputs, got {call.dtype}; set model.dtype=bfloat16 or use "
            f"impl 'auto'")
  multiple, most = impl.head_dims
  if call.head_dim is not None and (call.head_dim % multiple or call.head_dim > most):
    return (f"takes head widths that are a multiple of {multiple} up to {most}, got {call.head_dim}; use "
            f"impl 'auto'")
  if call.q_len is None:
    return None
  if call.q_len != call.k_len and not impl.cross:
    return (f"needs as many keys as queries, got {call.q_len} and {call.k_len}; use impl 'auto' or "
            f"'reference' for cross-attention")
  if call.q_len % impl.tile or call.k_len % impl.tile:
    return (f"tiles sequences in blocks of {impl.tile}, got lengths {call.q_len} and {call.k_len}; use a "
            f"multiple of {impl.tile} or impl 'auto'")
  return None


def check(impl: str, knobs: Knobs, call: Call) -> None:
  """Raises a ValueError naming the fix when `impl` cannot serve the call."""
  if impl != "auto" and impl not in IMPLS:
    raise ValueError(f"unknown attention impl {impl!r}; choose one of: auto, {', '.join(IMPLS)}")
  if knobs.gated and (not call.causal or call.bias or call.dropout):
    # A gate decays the past; its recurrent decoding state is exact only without a position bias; and
    # its chunks never form the (query, key) pairs that dropout would drop.
    raise ValueError("gated attention is causal and takes no position bias or attention dropout; set "
                     "model.causal=True, model.positions to rotary, learned or none, and "
                     "model.attention_dropout=0")
  reason = None if impl == "auto" else unsupported(impl, knobs, call)
  if reason:
    raise ValueError(f"attention impl {impl!r} {reason}")


def choose_impl(knobs: Knobs, call: Call) -> dict[str, str]:
  """What impl="auto" runs on each platform: the first row of IMPLS that supports the call and that
  auto may take there at this length."""

  def first(platform):
    for name, impl in IMPLS.items():
      if platform not in impl.auto:
        continue
      limit = impl.auto[platform]
      if (limit is None or call.q_len is None or call.q_len <= limit) and \
          unsupported(name, knobs, call) is None:
        return name
    raise AssertionError("the reference serves every call")

  return {platform: first(platform) for platform in PLATFORMS}


def _run(name: str, q, k, v, *, knobs, causal, segment_ids, bias, dropout_rate, dropout_rng, positions,
         log_gate):
  """Implementation `name` given the arguments its row says it takes."""
  impl, kw = IMPLS[name], {}
  if impl.segments:
    kw["segment_ids"] = segment_ids
  if impl.gate:
    kw["log_gate"] = log_gate
  if impl.cross:
    kw["positions"] = positions
  if len(impl.computes) != 1:
    kw["knobs"] = knobs
  if impl.bidirectional:
    kw["causal"] = causal
  if impl.bias:
    kw["bias"] = bias
  if impl.dropout:
    kw.update(dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  return impl.fn(q, k, v, **kw)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, normalization: str, value_network: str,
           nonlinearity: str = "relu", causal: bool = True, segment_ids: jax.Array | None = None,
           bias: jax.Array | None = None, impl: str = "reference", dropout_rate: float = 0.0,
           dropout_rng: jax.Array | None = None, positions: core.Positions | None = None,
           log_gate: jax.Array | None = None) -> jax.Array:
  """Maps q, k, v [batch, seq, heads, head_dim] to [batch, seq, heads, head_dim].

  segment_ids [batch, seq]: tokens attend only within their own segment (packed documents).
  bias: additive, broadcastable to [batch, heads, q, k] (e.g. relative position bias).
  dropout_rate, dropout_rng: attention dropout of the normalised scores, one [q, k] mask shared over
  batch and heads, drawn from dropout_rng; every implementation that drops draws the same mask.
  positions: (query positions [q], key positions [k]) when the queries are not the first q of the keys,
  as when new tokens attend to a decoding cache; causality compares these.
  log_gate [batch, k, heads, head_dim]: log α ≤ 0 of a gated variant (GLA); each key dimension's
  score decays by the gates after the key up to the query. Causal only, no bias.
  """
  knobs = Knobs(normalization, value_network, nonlinearity, gated=log_gate is not None)
  if log_gate is not None and log_gate.shape != k.shape:
    raise ValueError(f"attention log_gate must be shaped like k {k.shape}, got {log_gate.shape}")
  if not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"attention dropout_rate must be in [0, 1), got {dropout_rate}")
  if dropout_rate and dropout_rng is None:
    raise ValueError("attention dropout needs dropout_rng (a jax.random key)")
  call = Call(q.shape[1], k.shape[1], causal, bias is not None, dropout_rate > 0, positions is not None,
              segment_ids is not None, q.dtype.name, q.shape[-1])
  check(impl, knobs, call)
  chosen = choose_impl(knobs, call) if impl == "auto" else dict.fromkeys(PLATFORMS, impl)
  if impl == "auto" and not gpu_backend():
    # platform_dependent traces every branch, and cuDNN's wrapper refuses to trace without cuDNN;
    # a process with no GPU never lowers the GPU branch, so it gets the CPU's choice.
    chosen["gpu"] = chosen["cpu"]
  run = {
      name:
          functools.partial(_run, name, knobs=knobs, causal=causal, segment_ids=segment_ids, bias=bias,
                            dropout_rate=dropout_rate, dropout_rng=dropout_rng, positions=positions,
                            log_gate=log_gate) for name in set(chosen.values())
  }
  if len(run) == 1:
    return run[chosen["cpu"]](q, k, v)
  # The platform being lowered for decides, so a step compiled for TPU on a CPU host gets TPU kernels.
  return jax.lax.platform_dependent(q, k, v, cpu=run[chosen["cpu"]], tpu=run[chosen["tpu"]],
                                    default=run[chosen["gpu"]])
