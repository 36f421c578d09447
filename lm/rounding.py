"""Which parameters a function uses only rounded to a lower precision, read from its program.

The step that gathers the parameters from their shards (`mesh.shard_state_over_data`) gathers these
already rounded, in half the bytes, and its numbers stay the whole state's bit for bit: a parameter
converted once to bfloat16, the result used once, gets the gradient of that one use, rounded or not. A
parameter used twice (a tied embedding: the lookup and the readout; a projection and its rotation
partner under `model.rope_by_product`) gets two gradients, which XLA adds in float32 for a float32
parameter and in bfloat16 for a rounded one; a parameter used as it is (a relative-position table added
to float32 scores, a layer norm's scale) is not rounded at all. Reading the program, not a list of
names, covers a parameter added later with no change here.
"""

import jax
from jax.extend import core as jcore

# Equations whose program runs once, with the equation's operands and results as its own: a use inside
# one is a use of the operand. Anything else (loops, whose gradient adds one per trip; conditionals;
# custom derivatives, whose rules are their own) is a use as it stands, so an unknown case is counted as
# not rounded: gathered in float32, exact and larger.
_CALLS = ("pjit", "jit", "closed_call", "core_call", "checkpoint", "remat2")

_Parents = tuple[tuple[jcore.JaxprEqn, jcore.Jaxpr], ...]


def _program(eqn: jcore.JaxprEqn) -> jcore.Jaxpr:
  program = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  return getattr(program, "jaxpr", program)


def _uses(jaxpr: jcore.Jaxpr, var: jcore.Var, parents: _Parents) -> list:
  """The equations that consume `var`, followed into and out of the programs of `_CALLS`: each as
  (equation, the program holding it, that program's callers); (None, ...) where it is an output of the
  whole function."""
  found = []
  for eqn in jaxpr.eqns:
    for i, operand in enumerate(eqn.invars):
      if operand is var:
        if eqn.primitive.name in _CALLS:
          inner = _program(eqn)
          found += _uses(inner, inner.invars[i], parents + ((eqn, jaxpr),))
        else:
          found.append((eqn, jaxpr, parents))
  for j, out in enumerate(jaxpr.outvars):
    if out is var:
      if parents:
        caller, outer = parents[-1]
        found += _uses(outer, caller.outvars[j], parents[:-1])
      else:
        found.append((None, jaxpr, parents))
  return found


def rounded_before_use(fn, dtype, params, *args):
  """Per leaf of `params`, whether `fn(params, *args)` uses it exactly once, as a conversion to `dtype`
  whose result it uses exactly once. `params` and `args` may be abstract (jax.ShapeDtypeStruct): the
  function is traced, not run."""
  jaxpr = jax.make_jaxpr(fn)(params, *args).jaxpr
  leaves, treedef = jax.tree.flatten(params)

  def once_rounded(var) -> bool:
    uses = _uses(jaxpr, var, ())
    if len(uses) != 1 or uses[0][0] is None:
      return False
    eqn, inner, parents = uses[0]
    return (eqn.primitive.name == "convert_element_type" and eqn.params["new_dtype"] == dtype and
            len(_uses(inner, eqn.outvars[0], parents)) == 1)

  return jax.tree.unflatten(treedef, [once_rounded(v) for v in jaxpr.invars[:len(leaves)]])
