"""Bytes that a compiled program's operations move, read from its optimised HLO text.

XLA's cost analysis ("bytes accessed") adds up every operation's operands and result wherever they
live. On TPU, XLA keeps many of them in the chip's on-chip memory (VMEM, memory space S(1) in a
layout): `hbm_bytes` counts only what goes to or from HBM.
"""

import re
from collections.abc import Iterator

import numpy as np

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) (\w[\w\-]*)\((.*?)\)(, .*)?$")
_TYPES = "pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64"
_ARRAY = re.compile(rf"\b({_TYPES})\[([\d,]*)\](\{{[^}}]*\}})?")
_ITEMSIZE = dict(pred=1, s8=1, u8=1, s16=2, u16=2, bf16=2, f16=2, s32=4, u32=4, f32=4, s64=8, u64=8, f64=8)
# Ops that move no data of their own.
FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
    "replica-id"
}


def shape_bytes(shape: str, hbm_only: bool = False) -> int:
  """Bytes of an HLO shape (a tuple's elements summed); with hbm_only, only the arrays whose layout
  names no other memory space."""
  return sum(_ITEMSIZE[t] * int(np.prod([int(d)
                                         for d in dims.split(",")
                                         if d], dtype=np.int64))
             for t, dims, layout in _ARRAY.findall(shape)
             if not (hbm_only and "S(" in layout))


def entry_operations(hlo: str) -> Iterator[tuple[str, str, str, list[str], str]]:
  """(name, result shape, opcode, operands' shapes, the rest of the line) of every operation of the
  entry computation that moves data."""
  shapes, entry = {}, False
  for line in hlo.splitlines():
    if line.startswith("ENTRY"):
      entry = True
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      if entry and line.rstrip() == "}":  # the computation's end (kernels' attributes may span lines)
        entry = False
      continue
    name, shape, opcode, operands, rest = m.groups()
    shapes[name] = shape
    if entry and opcode not in FREE:
      yield name, shape, opcode, [shapes.get(o.strip().lstrip("%"), "") for o in operands.split(",")
                                 ], rest or ""


def hbm_bytes(hlo: str) -> int:
  """The HBM traffic of the entry computation's operations: the operands read and results written that
  live in HBM (an asynchronous operation's when it starts and when it is done), and the piece an
  asynchronous slice reads. What an operation reads from or writes to on-chip memory is left out."""
  total = 0
  for _, shape, opcode, operands, _ in entry_operations(hlo):
    if opcode == "slice-start":  # ((source), piece, index): the piece is what moves
      total += shape_bytes(list(_ARRAY.finditer(shape))[1].group(0))
    # An asynchronous operation's -start reads its operands; its -done, whose operand is the -start's
    # tuple, writes the result.
    elif opcode != "slice-done":
      reads = 0 if opcode.endswith("-done") else sum(shape_bytes(s, hbm_only=True) for s in operands)
      total += reads + (0 if opcode.endswith("-start") else shape_bytes(shape, hbm_only=True))
  return total
