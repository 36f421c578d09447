"""Generation: a prompt, then one token at a time through the model's decode mode (each layer keeps
the exact state of its variant, lm/attention/decode_cache.py), sampling each new token from the logits.

The context is the run's training length: positions past it were never trained, so a prompt and its
continuation must fit in it (`check_context`); nothing is extrapolated.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from lm import model as model_lib


@dataclasses.dataclass(frozen=True)
class Sampling:
  """temperature 0: greedy (argmax). top_k > 0 keeps the k likeliest tokens; top_p < 1 keeps the
  fewest likeliest tokens whose probabilities sum to at least top_p (nucleus sampling)."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    for name in ("temperature", "top_p"):
      if not math.isfinite(getattr(self, name)):
        raise ValueError(f"--{name} must be a finite number, got {getattr(self, name)}")
    if self.temperature < 0:
      raise ValueError(f"--temperature must be at least 0 (0: greedy), got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"--top_k must be at least 0 (0: every token), got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"--top_p must be in (0, 1] (1: every token), got {self.top_p}")


def sample(logits_bv: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """One token id per row [B] from float32 logits [B, V]."""
  if sampling.temperature == 0:
    return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
  # From the row's largest logit down: a temperature so small that the quotients overflow leaves the
  # largest at 0 and the others at -inf, which samples the argmax (greedy), not NaN.
  logits_bv = (logits_bv - jnp.max(logits_bv, axis=-1, keepdims=True)) / sampling.temperature
  if sampling.top_k and sampling.top_k < logits_bv.shape[-1]:
    kth_b1 = jax.lax.top_k(logits_bv, sampling.top_k)[0][:, -1:]
    logits_bv = jnp.where(logits_bv < kth_b1, -jnp.inf, logits_bv)
  if sampling.top_p < 1:
    sorted_bv = jnp.sort(logits_bv, axis=-1)[:, ::-1]
    # A token stays when the likelier tokens before it hold less than top_p: the likeliest always does.
    p_bv = jax.nn.softmax(sorted_bv, axis=-1)
    before_bv = jnp.cumsum(p_bv, axis=-1) - p_bv
    cutoff_b1 = jnp.min(jnp.where(before_bv < sampling.top_p, sorted_bv, jnp.inf), axis=-1, keepdims=True)
    logits_bv = jnp.where(logits_bv < cutoff_b1, -jnp.inf, logits_bv)
  return jax.random.categorical(key, logits_bv, axis=-1).astype(jnp.int32)


def check_context(prompt_len: int, max_new_tokens: int, context: int) -> None:
  """Refuses, naming the fix, a prompt and continuation that do not fit the trained context."""
  if prompt_len == 0:
    raise ValueError("the prompt has no tokens and the tokenizer has no BOS to start from; give a "
                     "non-empty --prompt")
  if prompt_len >= context:
    raise ValueError(f"the prompt has {prompt_len} tokens but the model's context is {context} "
                     f"(data.seq_len) and at least one new token must fit; shorten the prompt to at most "
                     f"{context - 1} tokens")
  if max_new_tokens < 1:
    raise ValueError(f"--max_new_tokens must be at least 1, got {max_new_tokens}")
  if prompt_len + max_new_tokens > context:
    raise ValueError(f"the prompt's {prompt_len} tokens and --max_new_tokens={max_new_tokens} exceed the "
                     f"model's context of {context} tokens (data.seq_len), which it was never trained "
                     f"past; use --max_new_tokens={context - prompt_len} or a shorter prompt")


@dataclasses.dataclass(frozen=True)
class Decoder:
  """A model in decode mode over `length` positions. Equal decoders share their compiled steps."""
  cfg: model_lib.ModelConfig
  length: int

  def __post_init__(self):
    if not self.cfg.causal or self.cfg.input_dim:
      raise ValueError("this checkpoint is a bidirectional or continuous-input model (a compositional "
                       "task), which does not generate text; sample from a causal language model "
                       "(task lm, model.causal=True)")

  @property
  def model(self) -> model_lib.Transformer:
    return model_lib.Transformer(self.cfg, decode_len=self.length)

  def init_cache(self, params, rows: int):
    """Every layer's state before the first token: all zeros (and index 0), shaped for `rows`."""
    shapes = jax.eval_shape(self.apply, params, None, jnp.zeros((rows, 1), jnp.int32))[1]
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

  def apply(self, params, cache, tokens_bt):
    """Logits [B, T, V] of tokens appended after the cache's, and the updated cache."""
    variables = {"params": params} if cache is None else {"params": params, "cache": cache}
    logits_btv, state = self.model.apply(variables, tokens_bt, mutable="cache")
    return logits_btv, state["cache"]

  @functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=2)
  def step(self, params, cache, tokens_bt, sampling: Sampling, key):
    """Appends tokens [B, T]; returns the next token [B] sampled from the last position's logits,
    and the updated cache."""
    logits_btv, cache = self.apply(params, cache, tokens_bt)
    return sample(logits_btv[:, -1], key, sampling), cache


def generate(cfg: model_lib.ModelConfig, params, prompt: np.ndarray, *, max_new_tokens: int, context: int,
             sampling: Sampling = Sampling(), seed: int = 0, num_samples: int = 1) -> np.ndarray:
  """`num_samples` continuations of the prompt's token ids, decoded as one batch: [num_samples,
  max_new_tokens]. The same seed gives the same tokens."""
  check_context(len(prompt), max_new_tokens, context)
  if num_samples < 1:
    raise ValueError(f"--num_samples must be at least 1, got {num_samples}")
  decoder = Decoder(cfg, len(prompt) + max_new_tokens)
  cache = decoder.init_cache(params, num_samples)
  key = jax.random.key(seed)
  token_b, cache = decoder.step(params, cache, jnp.tile(jnp.asarray(prompt, jnp.int32), (num_samples, 1)),
                                sampling, jax.random.fold_in(key, 0))
  tokens = [token_b]
  for i in range(1, max_new_tokens):
    token_b, cache = decoder.step(params, cache, token_b[:, None], sampling, jax.random.fold_in(key, i))
    tokens.append(token_b)
  return np.stack(jax.device_get(tokens), axis=1)
