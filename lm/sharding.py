"""The sharding policy: a mesh (data, fsdp, tensor) and the mesh axis of each logical role.

Every parameter declares the logical role of each of its dimensions where it is created (lm/model.py,
`nn.with_logical_partitioning` at each initializer, as NanoDO's fsdp.py does); `shardings` maps the
roles to mesh axes and raises on a parameter that declares nothing, so nothing is replicated by
accident. Parameters and optimiser moments are split over `fsdp` along the model width and over `tensor`
along heads / MLP width / vocabulary; the batch is split over (data, fsdp). A dimension that a mesh axis
does not divide stays replicated on that axis rather than failing.
"""

import math

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")
LOGICAL_TO_MESH = {"embed": "fsdp", "heads": "tensor", "mlp": "tensor", "vocab": "tensor"}


def make_mesh(cfg: ml_collections.ConfigDict, devices=None) -> Mesh:
  """cfg: the `mesh` section, sizes per axis with at most one -1."""
  devices = jax.devices() if devices is None else devices
  sizes = [cfg[a] for a in AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got mesh {dict(zip(AXES, sizes))}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(f"mesh {dict(zip(AXES, sizes))} needs {math.prod(sizes)} devices but "
                     f"{len(devices)} are present; set --config.mesh.* so the product is {len(devices)}")
  return Mesh(np.asarray(devices).reshape(sizes), AXES)


def _spec(box: nn.Partitioned, mesh: Mesh) -> P:
  unknown = [role for role in box.names if role and role not in LOGICAL_TO_MESH]
  if unknown:
    raise ValueError(f"unknown logical axis {unknown[0]!r} of a parameter of shape {box.value.shape}; "
                     f"choose one of: {', '.join(LOGICAL_TO_MESH)}, or None (replicated)")
  axes = [LOGICAL_TO_MESH[role] if role else None for role in box.names]
  shape = box.value.shape
  return P(*(a if a and dim % mesh.shape[a] == 0 else None for a, dim in zip(axes, shape)))


def _is_box(x) -> bool:
  return isinstance(x, nn.Partitioned)


def shardings(abstract_tree, mesh: Mesh, *, params):
  """NamedShardings for `abstract_tree` unboxed (nn.meta.unbox): leaves that declare logical axes
  (parameters, and the optimiser state that mirrors them) get their mesh axes; the others (step,
  RNG, optimiser counters) are replicated. `params`, the parameters as the model created them, must
  declare every leaf."""
  undeclared = [
      jax.tree_util.keystr(path)
      for path, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)[0]
      if not _is_box(x)
  ]
  if undeclared:
    raise ValueError(f"parameter(s) {', '.join(undeclared)} declare no sharding; create each with an "
                     f"initializer wrapped in nn.with_logical_partitioning(init, roles), roles from "
                     f"{sorted(LOGICAL_TO_MESH)} or None (replicated), as lm/model.py does")
  return jax.tree.map(lambda x: NamedSharding(mesh,
                                              _spec(x, mesh)
                                              if _is_box(x) else P()), abstract_tree, is_leaf=_is_box)


def over_data(abstract_tree, mesh: Mesh):
  """Shardings for the state when `mesh.shard_state_over_data` (ZeRO style, on a mesh of data alone):
  each array split over the data axis along its first dimension that the axis divides, the others
  (scalars such as the optimiser's step count, indivisible shapes) whole on every device."""
  n = mesh.shape["data"]

  def split(x) -> NamedSharding:
    dim = next((i for i, m in enumerate(x.shape) if m % n == 0), None)
    return NamedSharding(mesh, P(*("data" if i == dim else None for i in range(x.ndim))))

  return jax.tree.map(split, abstract_tree)


def _data_dim(spec: P) -> int | None:
  return next((i for i, a in enumerate(spec) if a == "data"), None)


def gather_over_data(x: jax.Array, spec: P) -> jax.Array:
  """Inside a shard_map: the array whole, from this device's shard of it (`over_data`)."""
  dim = _data_dim(spec)
  return x if dim is None else jax.lax.all_gather(x, "data", axis=dim, tiled=True)


def scatter_over_data(x: jax.Array, spec: P) -> jax.Array:
  """Inside a shard_map: x summed over the devices, this device's shard of the sum (`over_data`)."""
  dim = _data_dim(spec)
  return jax.lax.psum(x, "data") if dim is None else jax.lax.psum_scatter(x, "data", scatter_dimension=dim,
                                                                          tiled=True)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH))


def partitioned_mesh():
  """The mesh that jit partitions the computation over, or None: no mesh is set, or this runs inside a
  shard_map, where every array is already one device's own."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty or mesh.manual_axes else mesh


def constrain_batch(x: jax.Array) -> jax.Array:
  """Pins an activation's leading (batch) axis to the batch mesh axes when a mesh is set, so
  parameters are gathered to the data rather than activations scattered to the parameters."""
  if partitioned_mesh() is None:
    return x
  return jax.lax.with_sharding_constraint(x, P(BATCH, *([None] * (x.ndim - 1))))
