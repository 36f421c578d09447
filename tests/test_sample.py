"""lm-sample and incremental decoding: every variant's decoding cache gives the full forward pass's
logits at every position; sampling is deterministic where it should be; the context rule's messages;
lm-sample end to end on a checkpoint the real trainer wrote."""

import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from small import small_config

from eval import sample as eval_sample
from lm import attention, decode, model as model_lib, train

V, T, PROMPT = 64, 12, 5  # vocabulary, context, prompt tokens


def tiny(attention_field, **kw):
  L = len(attention_field.split(","))
  # The full forward pass by the core's definition: the other implementations have their own tests.
  return model_lib.ModelConfig(V=V, D=16, H=2, L=L, F=32, attention=attention_field,
                               attention_impl="reference", **kw)


def init(cfg, tokens_bt=None):
  """Tokens [2, T] and random parameters of the model's shapes (drawn by numpy: initialising by the
  model's own initialisers compiles much longer than the test runs)."""
  if tokens_bt is None:
    tokens_bt = jax.random.randint(jax.random.key(1), (2, T), 0, V)
  shapes = nn.meta.unbox(jax.eval_shape(model_lib.Transformer(cfg).init, jax.random.key(0), tokens_bt))
  rng = np.random.default_rng(0)
  return tokens_bt, jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape) * 0.5, s.dtype),
                                 shapes["params"])


def incremental(cfg, params, tokens_bt, prompt_len):
  """Logits from decoding: the first prompt_len tokens in one call, then one token per call; and the
  cache after each call."""
  decoder = decode.Decoder(cfg, tokens_bt.shape[1])
  apply = jax.jit(decoder.apply)
  cache = decoder.init_cache(params, tokens_bt.shape[0])
  logits, cache = apply(params, cache, tokens_bt[:, :prompt_len])
  steps, caches = [logits], [cache]
  for t in range(prompt_len, tokens_bt.shape[1]):
    logits, cache = apply(params, cache, tokens_bt[:, t:t + 1])
    steps.append(logits)
    caches.append(cache)
  return np.asarray(jnp.concatenate(steps, axis=1)), caches


# Every preset as one layer of a single model (fewer compilations than one model per preset): a layer
# whose decoding state is not exact changes the logits after it. It decodes token by token from the
# first; the smaller models take a prompt of several tokens in one call, through both kinds of state.
EVERY_PRESET = ",".join(attention.PRESETS)


@pytest.mark.slow
@pytest.mark.parametrize("attention_field,positions,prompt_len",
                         [(EVERY_PRESET, "rotary", 1), ("softmax,linear,hyla", "relative_bias", PROMPT),
                          ("linear,hyla,gla", "learned", PROMPT)])
def test_decoding_gives_the_full_forward_logits(attention_field, positions, prompt_len):
  cfg = tiny(attention_field, positions=positions)
  tokens_bt, params = init(cfg)
  full_btv = np.asarray(jax.jit(model_lib.Transformer(cfg).apply)({"params": params}, tokens_bt))
  incremental_btv, caches = incremental(cfg, params, tokens_bt, prompt_len)
  np.testing.assert_allclose(incremental_btv, full_btv, rtol=1e-5, atol=1e-5 * np.abs(full_btv).max())
  # Linear attention (and GLA) keeps its recurrent state unless a position bias makes it need every key.
  kinds = {
      name: "state" if name in ("linear", "gla") and positions != "relative_bias" else "kv"
      for name in attention.PRESETS
  }
  layers = attention_field.split(",")
  assert [next(iter(caches[-1][f"block_{i}"]["attn"])) for i in range(cfg.L)] == [kinds[n] for n in layers]
  assert int(caches[-1]["index"]) == T


def test_linear_state_does_not_grow_with_generated_tokens():
  cfg = tiny("linear,linear")
  tokens_bt = jax.random.randint(jax.random.key(1), (1, 52), 0, V)
  params = init(cfg, tokens_bt)[1]
  _, caches = incremental(cfg, params, tokens_bt, 2)
  after_10, after_50 = caches[10], caches[50]
  shapes = lambda cache: jax.tree.map(jnp.shape, cache)
  nbytes = lambda cache: sum(x.nbytes for x in jax.tree.leaves(cache))
  assert shapes(after_10) == shapes(after_50) and nbytes(after_10) == nbytes(after_50)
  assert shapes(after_50)["block_0"]["attn"]["state"]["s_bhkk"] == (1, 2, 8, 8)
  assert not np.array_equal(after_10["block_0"]["attn"]["state"]["s_bhkk"],
                            after_50["block_0"]["attn"]["state"]["s_bhkk"])


@pytest.fixture(scope="module")
def hybrid():
  cfg = tiny("hyla,softmax")
  return cfg, init(cfg)[1]


@pytest.mark.slow
def test_greedy_is_deterministic_and_seeds_reproduce(hybrid):
  cfg, params = hybrid
  prompt = np.array([3, 1, 4, 1, 5])
  run = lambda sampling, seed=0: decode.generate(cfg, params, prompt, max_new_tokens=6, context=T, sampling=
                                                 sampling, seed=seed, num_samples=3)
  greedy = run(decode.Sampling(temperature=0), seed=0)
  assert greedy.shape == (3, 6)
  np.testing.assert_array_equal(greedy, run(decode.Sampling(temperature=0), seed=1))
  assert (greedy == greedy[0]).all(), "greedy rows of one batch decode the same prompt alike"
  sampled = decode.Sampling(temperature=1.5, top_k=40, top_p=0.95)
  np.testing.assert_array_equal(run(sampled, seed=7), run(sampled, seed=7))
  assert not np.array_equal(run(sampled, seed=7), run(sampled, seed=8))


def test_top_k_and_top_p_keep_the_likeliest_tokens():
  logits_bv = jnp.log(jnp.tile(jnp.array([0.5, 0.3, 0.15, 0.05]), (400, 1)))  # 400 draws at once
  draws = lambda sampling: set(np.asarray(decode.sample(logits_bv, jax.random.key(0), sampling)).tolist())
  assert draws(decode.Sampling(top_k=2)) == {0, 1}
  assert draws(decode.Sampling(top_p=0.8)) == {0, 1}  # 0.5 + 0.3 reach 0.8: the third is cut
  assert draws(decode.Sampling(top_p=0.81)) == {0, 1, 2}
  assert draws(decode.Sampling(temperature=0)) == {0}


@pytest.mark.parametrize("field, value", [("temperature", float("nan")), ("temperature", float("inf")),
                                          ("top_p", float("nan"))])
def test_non_finite_sampling_values_are_refused(field, value):
  """--temperature=nan printed the prompt with an empty continuation and exit 0."""
  with pytest.raises(ValueError, match=rf"^--{field} must be a finite number"):
    decode.Sampling(**{field: value})


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-8])
def test_a_tiny_temperature_decodes_greedily(temperature):
  """Logits divided by 1e-40 overflowed to inf and NaN: an empty continuation."""
  logits_bv = jax.random.normal(jax.random.key(0), (16, 50)) * 10
  got = decode.sample(logits_bv, jax.random.key(1), decode.Sampling(temperature=temperature, top_p=0.9))
  np.testing.assert_array_equal(got, jnp.argmax(logits_bv, axis=-1))


@pytest.mark.parametrize("prompt_len,new,message", [
    (0, 4, "no tokens .* give a non-empty --prompt"),
    (12, 4, "prompt has 12 tokens .* context is 12 .* shorten the prompt to at most 11 tokens"),
    (5, 8, r"exceed the model's context of 12 .* use --max_new_tokens=7"),
])
def test_context_rule_names_the_fix(prompt_len, new, message):
  with pytest.raises(ValueError, match=message):
    decode.check_context(prompt_len, new, T)


def test_bidirectional_checkpoints_do_not_sample():
  with pytest.raises(ValueError, match="does not generate text; sample from a causal language model"):
    decode.Decoder(tiny("hyla", causal=False), T)


@pytest.mark.slow
def test_lm_sample_on_a_trained_hybrid(small_corpus, tmp_path):
  c = small_config(small_corpus, attention="hyla,softmax")
  c.train.update(steps=4, log_every_steps=2)
  c.eval.every_steps = 4
  train.train_and_evaluate(c, str(tmp_path))
  result = subprocess.run([
      sys.executable, "-m", "eval.sample", f"--workdir={tmp_path}", "--prompt=the quick brown",
      "--max_new_tokens=8", "--num_samples=2", "--temperature=0"
  ], capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  samples = result.stdout.split("--- sample ")[1:]
  assert [s.split(" ---")[0] for s in samples] == ["0", "1"], result.stdout
  texts = [s.split("---\n", 1)[1] for s in samples]
  assert texts[0] == texts[1] and texts[0].startswith("the quick brown"), "greedy rows agree"
  with pytest.raises(ValueError, match="shorten the prompt to at most 31 tokens"):
    eval_sample.sample(str(tmp_path), "the quick brown fox " * 20, sampling=decode.Sampling())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["missing.txt", ".", "binary.bin"])
def test_a_prompt_file_that_cannot_be_read_is_one_line(tmp_path, name):
  """A directory given as --prompt_file was a traceback (IsADirectoryError), a binary file too
  (UnicodeDecodeError)."""
  prompt_file = tmp_path / name
  if name == "binary.bin":
    prompt_file.write_bytes(b"ok\xff\xfe\x00")
  result = subprocess.run(
      [sys.executable, "-m", "eval.sample", f"--workdir={tmp_path}", f"--prompt_file={prompt_file}"],
      capture_output=True, text=True, timeout=120)
  reason = {
      "missing.txt": "No such file or directory",
      ".": "Is a directory"
  }.get(name, "not UTF-8 text (byte 0xff at offset 2)")
  assert result.returncode == 1
  assert result.stderr == f"lm-sample: --prompt_file={prompt_file}: {reason}; give a text file\n"
