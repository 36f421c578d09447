"""The sharding policy: a mesh (data, fsdp, tensor) and one rule per parameter role.

Parameters and optimiser moments are split over `fsdp` along the model width and over `tensor`
along heads / MLP width / vocabulary; the batch is split over (data, fsdp). A dimension that a mesh
axis does not divide stays replicated on that axis rather than failing.
"""

import math

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")

# (parent module, parameter name) → logical role of each dimension; matched on the path's tail.
ROLES = {
    ("attn", "wq"): ("embed", "heads", None), ("attn", "wk"): ("embed", "heads", None),
    ("attn", "wv"): ("embed", "heads", None), ("attn", "wo"): ("heads", None, "embed"),
    ("mlp", "wi"): ("embed", "mlp"), ("mlp", "wo"): ("mlp", "embed"),
    (None, "embed"): ("vocab", "embed"), (None, "unembed"): ("embed", "vocab"),
    (None, "pos_embed"): (None, "embed"), (None, "input_proj"): (None, "embed"),
}
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


def _spec(path, shape, mesh: Mesh) -> P:
  names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  roles = ROLES.get((names[-2] if len(names) > 1 else None, names[-1])) or ROLES.get((None, names[-1]))
  if roles is None or len(roles) != len(shape):
    return P()
  axes = [LOGICAL_TO_MESH.get(r) if r else None for r in roles]
  return P(*(a if a and dim % mesh.shape[a] == 0 else None for a, dim in zip(axes, shape)))


def shardings(abstract_tree, mesh: Mesh):
  """NamedShardings for a tree of arrays (parameters, optimiser state, train state)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, _spec(path, getattr(x, "shape", ()), mesh)), abstract_tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH))


def constrain_batch(x: jax.Array) -> jax.Array:
  """Pins an activation's leading (batch) axis to the batch mesh axes when a mesh is set, so
  parameters are gathered to the data rather than activations scattered to the parameters."""
  if jax.sharding.get_abstract_mesh().empty:
    return x
  return jax.lax.with_sharding_constraint(x, P(BATCH, *([None] * (x.ndim - 1))))
