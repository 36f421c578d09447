"""configs/sraven.py and configs/fuzzy_logic.py against the paper's code (smonsays/hypernetwork-attention,
run.py, configs/raven.py, configs/logic.py): every hyperparameter pinned, the width flag as lm-train
parses it, its schedule, its relative-position bucketing, its per-run held-out split, its eval sizes.
A failure here means a config no longer reproduces what the paper ran: restore the value named."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl import flags
from ml_collections import config_flags

from configs import fuzzy_logic as fuzzy_config, sraven as sraven_config
from lm import model as model_lib, optimizer, tasks_compositional as tc

# The paper code's values; (model, train, data, eval) fields of our configs.
SRAVEN = {
    "model.L": 4,
    "model.D": 128,
    "model.H": 16,
    "model.qkv_dim": 64,
    "model.F": 256,
    "model.causal": False,
    "model.attention_dropout": 0.1,
    "model.positions": "relative_bias",
    "model.relative_buckets": 36,
    "model.relative_max_distance": 36,
    "model.relative_bidirectional": False,
    "model.relative_bias_per_layer": True,
    "model.projection_bias": True,
    "model.residual_init": "fan_in",
    "model.relative_bias_std": 36**-0.5,
    "train.batch_size": 128,
    "train.lr": 1e-3,
    "train.warmup_steps": 1000,
    "train.steps": 156_250,
    "train.schedule": "cosine_paper_code",
    "train.end_lr_frac": 0.1,
    "train.b1": 0.9,
    "train.b2": 0.999,
    "train.eps": 1e-8,
    "train.weight_decay": 0.1,
    "train.grad_clip": 0.0,
    "data.frac_ood": 0.25,
    "data.permute_features": True,
    "data.split_seed": -1,
}
FUZZY = {
    "model.L": 2,
    "model.D": 128,
    "model.H": 8,
    "model.qkv_dim": 16,
    "model.F": 256,
    "model.causal": False,
    "model.attention_dropout": 0.1,
    "model.positions": "relative_bias",
    "model.relative_buckets": 32,
    "model.relative_max_distance": 32,
    "model.relative_bidirectional": False,
    "model.relative_bias_per_layer": True,
    "model.projection_bias": True,
    "model.residual_init": "fan_in",
    "model.relative_bias_std": 32**-0.5,
    "train.batch_size": 128,
    "train.lr": 1e-3,
    "train.warmup_steps": 100,
    "train.steps": 50_000,
    "train.schedule": "cosine_paper_code",
    "train.end_lr_frac": 0.1,
    "train.b1": 0.9,
    "train.b2": 0.999,
    "train.eps": 1e-8,
    "train.weight_decay": 0.1,
    "train.grad_clip": 0.0,
    "data.num_vars": 4,
    "data.num_terms": 2,
    "data.seq_len": 32,
    "data.frac_test": 0.7,
    "data.frac_unknown": 0.25,
    "data.split_seed": -1,
}


def parse(config_file: str, *overrides: str):
  """The config as lm-train's absl flags build it from the command line."""
  argv = ["lm-train", f"--config={config_file}", *overrides]
  values = flags.FlagValues()
  # Override flags are defined from the command line, as lm-train's are from sys.argv.
  config_flags.DEFINE_config_file("config", None, "", flag_values=values, sys_argv=argv)
  values(argv)
  return values.config


@pytest.mark.parametrize("module,paper", [(sraven_config, SRAVEN), (fuzzy_config, FUZZY)],
                         ids=["sraven", "fuzzy_logic"])
def test_every_paper_hyperparameter_is_pinned(module, paper):
  c = module.get_config()
  for field, value in paper.items():
    section, name = field.split(".")
    assert c[section][name] == value, (
        f"{module.__name__}: {field} is {c[section][name]!r}; the paper's code uses {value!r}")
  total = {"sraven": 51_200, "fuzzy_logic": 16_000}[c.task]
  assert c.eval.batch_size * c.eval.final_batches == total, f"the paper evaluates on {total:,} instances"


@pytest.mark.parametrize("width", [1, 2, 4])
def test_width_flag_scales_width_heads_qkv_and_mlp(width):
  c = parse("configs/sraven.py", f"--config.width={width}")
  m = model_lib.ModelConfig.from_dict(c.model.to_dict())
  assert (m.D, m.H, m.qkv_dim, m.F) == (128 * width, 16 * width, 64 * width, 256 * width)
  assert m.K == 4, "the paper's code keeps 4 dimensions per head at every width"


def test_overrides_of_derived_fields_change_only_themselves():
  c = parse("configs/sraven.py", "--config.width=2", "--config.model.H=1", "--config.seed=3")
  assert (c.model.H, c.model.D, c.width, c.data.split_seed) == (1, 256, 2, -1)
  c = parse("configs/fuzzy_logic.py", "--config.data.seq_len=64", "--config.model.relative_buckets=16")
  assert (c.model.relative_buckets, c.model.relative_max_distance, c.data.seq_len) == (16, 64, 64)


def test_held_out_split_follows_the_run_seed_unless_overridden():
  c = sraven_config.get_config()
  seeds = []
  for seed in (0, 1):
    c.seed = seed
    seeds.append(tc.split_seed(c))
  assert seeds == [0, 1]
  c.data.split_seed = 7
  assert tc.split_seed(c) == 7


def test_paper_code_schedule_ends_the_cosine_warmup_steps_early():
  c = sraven_config.get_config().train
  c.steps, c.warmup_steps = 1000, 100
  lr = optimizer.schedule(c)
  paper = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, decay_steps=900, end_value=1e-4)
  steps = np.arange(0, 1001, 50)
  np.testing.assert_allclose([lr(s) for s in steps], [paper(s) for s in steps], rtol=1e-6)
  assert float(lr(900)) == pytest.approx(1e-4) and float(lr(1000)) == pytest.approx(1e-4)
  c.schedule = "cosine"
  assert float(optimizer.schedule(c)(900)) > 1.01e-4
  c.schedule = "linear"
  with pytest.raises(ValueError, match="cosine_paper_code"):
    optimizer.schedule(c)


def test_no_gradient_clipping_when_grad_clip_is_zero():
  c = sraven_config.get_config().train.copy_and_resolve_references()
  params = {"w": jnp.zeros((2, 2))}
  assert len(optimizer.make(c).init(params)) == 1, "grad_clip=0: AdamW alone, no clipping transform"
  c.grad_clip = 1.0
  assert len(optimizer.make(c).init(params)) == 2


def test_one_sided_buckets_as_the_paper_code_builds_them():
  """buckets = max distance = 36 (SRAVEN), bidirectional=False: keys after the query share bucket 0;
  offsets 0..17 are exact, 18..35 logarithmic (T5: max_exact + log(n / max_exact) / log(2) * 18)."""
  rel = jnp.arange(-35, 36)  # key - query
  b = np.asarray(model_lib.relative_bucket(rel, bidirectional=False, num_buckets=36, max_distance=36))
  back = b[:36][::-1]  # offsets 0 .. 35 backwards
  assert np.all(b[35:] == 0), "keys after the query share the query's bucket 0"
  np.testing.assert_array_equal(back[:18], np.arange(18))
  expected = [18 + int(np.log(n / 18) / np.log(2) * 18) for n in range(18, 36)]
  np.testing.assert_array_equal(back[18:], expected)
  assert back[21] == 22 and back[31] == back[32] == 32 and back[35] == 35


@pytest.mark.slow
def test_per_layer_bias_tables():
  cfg = model_lib.ModelConfig(V=8, D=8, H=2, L=3, F=8, input_dim=8, causal=False, positions="relative_bias",
                              relative_buckets=6, relative_max_distance=6, relative_bidirectional=False,
                              relative_bias_per_layer=True, attention="linear", attention_impl="reference")
  m = model_lib.Transformer(cfg)
  x = jax.random.normal(jax.random.key(0), (1, 6, 8))
  params = nn.meta.unbox(m.init(jax.random.key(1), x)["params"])
  assert sorted(k for k in params if k.startswith("relative_bias")) == [
      "relative_bias_0", "relative_bias_1", "relative_bias_2"
  ]
  assert params["relative_bias_0"].shape == (6, 2)
  shared = model_lib.Transformer(cfg.__class__(**{**cfg.__dict__, "relative_bias_per_layer": False}))
  assert "relative_bias" in shared.init(jax.random.key(1), x)["params"]
  # Layer 1's table changes the output: each layer reads its own.
  bumped = {**params, "relative_bias_1": params["relative_bias_1"] + 1.0}
  assert not np.allclose(m.apply({"params": params}, x), m.apply({"params": bumped}, x))
  with pytest.raises(ValueError, match="relative_max_distance"):
    model_lib.ModelConfig(V=8, positions="relative_bias", relative_buckets=36, relative_max_distance=20)


@pytest.mark.slow
def test_the_paper_codes_parametrisation_as_options():
  """projection_bias, residual_init="fan_in" and relative_bias_std set the paper code's biases and initial
  scales (measured in its fuzzy-logic model: output weights 0.25, MLP output 0.062, bias tables 0.18);
  the defaults add no parameter."""
  base = dict(V=1, D=128, H=8, L=2, F=256, qkv_dim=16, input_dim=5, causal=False, positions="relative_bias",
              relative_buckets=32, relative_max_distance=32, relative_bidirectional=False,
              relative_bias_per_layer=True, attention="hyla", attention_impl="reference")
  x = jax.random.uniform(jax.random.key(0), (4, 32, 5))
  init = lambda cfg: nn.meta.unbox(model_lib.Transformer(cfg).init(jax.random.key(1), x)["params"])
  plain = init(model_lib.ModelConfig(**base))
  cfg = model_lib.ModelConfig(**base, projection_bias=True, residual_init="fan_in",
                              relative_bias_std=32**-0.5)
  params = init(cfg)
  block = params["block_0"]
  assert "bk" not in plain["block_0"]["attn"] and "input_bias" not in plain
  assert block["attn"]["bk"].shape == (8, 2) and block["mlp"]["bi"].shape == (256,)
  biases = [params["input_bias"], block["mlp"]["bo"]] + [block["attn"][n] for n in ("bq", "bk", "bv", "bo")]
  assert all(not np.any(b) for b in biases), "the biases start at zero"
  np.testing.assert_allclose(np.std(block["attn"]["wo"]), 16**-0.5, rtol=0.05)
  np.testing.assert_allclose(np.std(block["mlp"]["wo"]), 256**-0.5, rtol=0.05)
  np.testing.assert_allclose(np.std(plain["block_0"]["mlp"]["wo"]), (256 * 4)**-0.5, rtol=0.05)
  np.testing.assert_allclose(np.std(params["relative_bias_0"]), 32**-0.5, rtol=0.15)

  # A key bias adds q·b_k to every key's score: softmax cancels it, HYLA's rms_head does not.
  def output(preset):
    m = model_lib.Transformer(model_lib.ModelConfig(**{**base, "attention": preset}, projection_bias=True))
    p = nn.meta.unbox(m.init(jax.random.key(1), x)["params"])
    bumped = jax.tree_util.tree_map(lambda a: a, p)
    bumped["block_0"]["attn"]["bk"] = jnp.ones_like(p["block_0"]["attn"]["bk"])
    return m.apply({"params": p}, x), m.apply({"params": bumped}, x)

  np.testing.assert_allclose(*output("softmax"), atol=1e-5)
  assert not np.allclose(*output("hyla"), atol=1e-3)
  with pytest.raises(ValueError, match="residual_init"):
    model_lib.ModelConfig(V=8, residual_init="xavier")
