"""Sharding declared where parameters are created: every parameter has a layout, none is guessed."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh, PartitionSpec as P

from lm import model as model_lib, optimizer, sharding


def _mesh():
  return Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), sharding.AXES)


def _specs(tree, params):
  return jax.tree.map(lambda s: s.spec, sharding.shardings(tree, _mesh(), params=params))


@pytest.mark.parametrize(
    "fields",
    [dict(positions="relative_bias"),
     dict(positions="learned", tied_embeddings=True),
     dict(input_dim=3)])
def test_every_model_parameter_declares_its_layout_and_the_optimiser_follows(fields):
  cfg = model_lib.ModelConfig(V=8, D=8, H=2, L=1, F=16, **fields)
  inputs = jnp.zeros((1, 4, 3)) if cfg.input_dim else jnp.zeros((1, 4), jnp.int32)
  opt = optimizer.make(
      ml_collections.ConfigDict(
          dict(grad_clip=1.0, lr=1e-3, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1, steps=10, warmup_steps=1,
               end_lr_frac=0.1, schedule="cosine")))

  def init(rng):
    params = model_lib.Transformer(cfg).init(rng, inputs)["params"]
    return params, opt.init(params)

  params, opt_state = jax.eval_shape(init, jax.random.key(0))
  specs = _specs((params, opt_state), params)  # raises if any parameter declares nothing
  param_specs, (_, (adam, *_)) = specs
  attn = param_specs["block_0"]["attn"]
  assert attn["wq"] == P("fsdp", "tensor", None) and attn["wo"] == P("tensor", None, "fsdp")
  assert param_specs["block_0"]["mlp"]["wi"] == P("fsdp", "tensor")
  assert param_specs["ln_final"]["scale"] == P(None)
  assert adam.mu == param_specs and adam.nu == param_specs and adam.count == P()


def test_a_parameter_without_a_declared_layout_is_an_error():
  params = jax.eval_shape(nn.Dense(3).init, jax.random.key(0), jnp.zeros((1, 4)))["params"]
  with pytest.raises(ValueError, match=r"\['bias'\], \['kernel'\] declare no sharding; create each with"):
    sharding.shardings(params, _mesh(), params=params)


def test_an_unknown_logical_axis_is_an_error():
  init = nn.with_logical_partitioning(nn.initializers.zeros, ("embd", None))
  params = jax.eval_shape(lambda: {"w": init(jax.random.key(0), (4, 2))})
  with pytest.raises(ValueError, match="unknown logical axis 'embd'.*choose one of: embed, heads"):
    sharding.shardings(params, _mesh(), params=params)


def test_a_dimension_the_mesh_axis_does_not_divide_stays_replicated():
  mesh = AbstractMesh((1, 2, 1), sharding.AXES)
  init = nn.with_logical_partitioning(nn.initializers.zeros, ("embed", None))
  params = jax.eval_shape(lambda: {
      "odd": init(jax.random.key(0), (3, 2)),
      "even": init(jax.random.key(0), (4, 2))
  })
  specs = jax.tree.map(lambda s: s.spec, sharding.shardings(params, mesh, params=params))
  assert specs == {"odd": P(None, None), "even": P("fsdp", None)}
