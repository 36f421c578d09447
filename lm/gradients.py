"""How a train step sums its gradients: over microbatches, over devices, of parameters gathered rounded.

Three strategies (`strategy`), the same numbers by each: jit partitions the step ("partitioned"); on CPU,
with every parameter whole on every device, each device takes the gradients of its own rows and the
step adds them up once, as one vector ("over_devices"); with the state split over the data axis
(mesh.shard_state_over_data), each device takes them against the parameters gathered whole, those the
model only uses rounded gathered already rounded (lm/rounding.py), and scatters the sums back to their
shards ("of_gathered"). Every strategy sums the weighted loss over the batch's microbatches first.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import flatten_util
from jax.sharding import PartitionSpec as P

from lm import rounding, sharding

# (params, batch, rng) -> (the task's mean loss times its weight, (mean, weight)).
WeightedLoss = Callable[[Any, dict[str, jax.Array], jax.Array], tuple[jax.Array, tuple[jax.Array, jax.Array]]]
# The weighted loss summed over a batch, the summed weight, and the gradients of that sum.
Sums = tuple[jax.Array, jax.Array, Any]
STRATEGIES = ("partitioned", "over_devices", "of_gathered")


def sums_on_devices(platform: str, shards: int, param_shardings: Any) -> bool:
  """Whether a step on CPU can sum its devices' gradients itself: more than one batch shard, and every
  parameter whole on every device."""
  return platform == "cpu" and shards > 1 and all(
      s.is_fully_replicated for s in jax.tree.leaves(param_shardings))


def strategy(state_over_data: bool, on_devices: bool) -> str:
  """One of STRATEGIES: the gathered parameters' when the state is split over the data axis, else the
  devices' own sum when `sums_on_devices`, else jit's partitioning."""
  return "of_gathered" if state_over_data else "over_devices" if on_devices else "partitioned"


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity, as jit and shard_map may hash it
class Summation:
  """A step's gradient sum: its weighted loss, microbatches and strategy, and for "of_gathered" the
  parameters' shardings, the model's compute dtype and the parameters' abstract shapes."""
  weighted_loss: WeightedLoss
  microbatches: int
  strategy: str
  param_shardings: Any = None  # a tree of NamedSharding like the parameters
  compute_dtype: Any = jnp.float32
  abstract_params: Any = None

  def __post_init__(self):
    if self.strategy not in STRATEGIES:
      raise ValueError(f"unknown gradient strategy {self.strategy!r}; choose one of: {', '.join(STRATEGIES)}")

  def mean(self, params: Any, batch: dict[str, jax.Array],
           rng: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
    """The batch's mean loss, its summed weight and the mean loss's gradients."""
    # check_vma off: the attention cores' custom gradients carry no per-axis variance types.
    if self.strategy == "of_gathered":
      specs = jax.tree.map(lambda s: s.spec, self.param_shardings)
      sums = functools.partial(self._sums_of_gathered, specs)
      total, weight, grads = jax.shard_map(sums, in_specs=(specs, P(sharding.BATCH), P()),
                                           out_specs=(P(), P(), specs), check_vma=False)(params, batch, rng)
    elif self.strategy == "over_devices":
      total, weight, grads = jax.shard_map(self._summed_over_devices, in_specs=(P(), P(sharding.BATCH), P()),
                                           out_specs=P(), check_vma=False)(params, batch, rng)
    else:
      total, weight, grads = self.sums(params, batch, rng)
    scale = 1.0 / jnp.maximum(weight, 1.0)
    return total * scale, weight, jax.tree.map(lambda g: g * scale, grads)

  def _summed_over_devices(self, params, batch, rng) -> Sums:
    """`sums` of this device's rows, added over the devices once per step, as one vector. XLA's CPU
    all-reduce synchronises the device threads once per operand, and the partitioned step all-reduces
    every gradient in every microbatch; one vector a step meets once
    (docs/results/compositional_throughput.md)."""
    flat, unflatten = flatten_util.ravel_pytree(self.sums(params, batch, rng))
    return unflatten(jax.lax.psum(flat, sharding.BATCH))

  def _sums_of_gathered(self, specs, params, batch, rng) -> Sums:
    """`sums` of this device's rows against the parameters gathered whole from their shards
    (mesh.shard_state_over_data), each gradient summed over the devices and scattered back to its
    shard, so that the optimiser's update reads and writes only each device's shard of the state
    (docs/results/compile_v5e.md). The parameters that the model only uses rounded to its compute dtype
    are rounded before they are gathered (lm/rounding.py), and their gradients come back in that dtype
    (summed over microbatches in float32, `sums`): the numbers are those of the state whole on every
    device, where XLA sums bfloat16 gradients too."""
    low = self.compute_dtype
    rounded = self.rounded_before_use(
        *jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (batch, rng)))
    whole = jax.tree.map(lambda p, spec, r: sharding.gather_over_data(p.astype(low) if r else p, spec),
                         params, specs, rounded)
    total, weight, grads = self.sums(whole, batch, rng)
    grads = jax.tree.map(lambda g, p, spec: sharding.scatter_over_data(g, spec).astype(p.dtype), grads,
                         params, specs)
    return jax.lax.psum(total, sharding.BATCH), jax.lax.psum(weight, sharding.BATCH), grads

  def rounded_before_use(self, batch: Any, rng: Any) -> dict:
    """Per parameter, whether the training loss on `batch` (arrays or their abstract shapes) uses it
    only rounded to the model's compute dtype, once (lm/rounding.py)."""
    return rounding.rounded_before_use(lambda p, b, r: self.weighted_loss(p, b, r)[0], self.compute_dtype,
                                       self.abstract_params, batch, rng)

  def sums(self, params: Any, batch: dict[str, jax.Array], rng: jax.Array) -> Sums:
    """The weighted loss summed over the batch's microbatches, the summed weight and the gradients of
    the sum."""
    grad_fn = jax.value_and_grad(self.weighted_loss, has_aux=True)
    k = self.microbatches
    if k == 1:
      (total, (_, weight)), grads = grad_fn(params, batch, rng)
    else:
      # Microbatch i takes rows i, i+k, i+2k, ...: every device holds its share of each microbatch.
      micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape((-1, k) + x.shape[1:]), 0, 1), batch)

      def body(carry, mb):
        mb = jax.tree.map(sharding.constrain_batch, mb)
        # Every microbatch takes the step's key: attention dropout's mask is one per step, shared over
        # the batch, so k parts train exactly what one batch would.
        (total, (_, weight)), grads = grad_fn(params, mb, rng)
        return jax.tree.map(lambda c, x: c + x.astype(c.dtype), carry, (total, weight, grads)), None

      # The gradients add up in float32 at least: a parameter gathered rounded to bfloat16
      # (mesh.shard_state_over_data) has bfloat16 gradients, which the state whole converts to float32
      # in every microbatch before the sum.
      accumulator = lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32))
      zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(accumulator, params))
      (total, weight, grads), _ = jax.lax.scan(body, zeros, micro)
    return total, weight, grads
