"""lm/rounding.py: which parameters a function uses only once, rounded, read from its program."""

import jax
import jax.numpy as jnp
import pytest

from lm import rounding

bf16 = jnp.bfloat16


@jax.custom_vjp
def _custom(w_dk, x_nd):
  return x_nd @ w_dk.astype(bf16)


_custom.defvjp(lambda w, x: (_custom(w, x), (w, x)), lambda res, g: (res[1].T @ g, g @ res[0].T))


def _scan(w_dk, x_nd):
  return jax.lax.scan(lambda c, _: (c + x_nd @ w_dk.astype(bf16), None), jnp.zeros((4, 3), bf16), None,
                      length=2)[0]


def _rounded_in_jit_used_twice(w_dk, x_nd):
  w = jax.jit(lambda w: w.astype(bf16))(w_dk)
  return x_nd @ w + x_nd @ w


# fn(w_dk, x_nd) -> [n, k], and whether w counts as used once, rounded to bfloat16.
CASES = {
    "one product": (lambda w, x: x @ w.astype(bf16), True),
    "inside jit": (jax.jit(lambda w, x: x @ w.astype(bf16)), True),
    "inside jit inside checkpoint": (jax.checkpoint(jax.jit(lambda w, x: x @ w.astype(bf16))), True),
    "used as it is": (lambda w, x: (x @ w).astype(bf16), False),
    "rounded to another dtype": (lambda w, x: x @ w.astype(jnp.float16), False),
    "rounded twice": (lambda w, x: x @ w.astype(bf16) + x @ w.astype(bf16), False),
    "rounded once, used twice": (lambda w, x: (lambda r: x @ r + (x @ r) * 2)(w.astype(bf16)), False),
    "rounded in a jit, used twice after it": (_rounded_in_jit_used_twice, False),
    "in a loop, once a trip": (_scan, False),
    "in a custom derivative": (_custom, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_parameter_is_marked_only_when_used_once_rounded(case):
  fn, marked = CASES[case]
  params = {"w": jnp.ones((5, 3)), "scale": jnp.ones((3,))}
  x_nd = jax.ShapeDtypeStruct((4, 5), bf16)
  got = rounding.rounded_before_use(lambda p, x: fn(p["w"], x) * p["scale"].astype(bf16), bf16, params, x_nd)
  assert got == {"w": marked, "scale": True}
