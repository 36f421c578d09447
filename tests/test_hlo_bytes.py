"""Bytes moved by a compiled program's operations: everything the compiler counts, and what of it goes
through HBM (an array whose layout names memory space S(1) is in a TPU chip's on-chip memory)."""

from launch.aot import hlo_bytes

# The shape of what XLA compiles for x @ w1 @ w2 on a v5e chip: x prefetched into on-chip memory, the
# [8192, 2048] hidden kept there, a piece of w2 sliced in asynchronously, the result written to HBM.
HLO = """
HloModule probe

%fused_computation (p0: bf16[8192,512], p1: bf16[512,2048]) -> bf16[8192,2048] {
  %p0 = bf16[8192,512]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %dot = bf16[8192,2048]{1,0:T(8,128)(2,1)} dot(%p0, %p1), lhs_contracting_dims={1}
}

ENTRY %main (x: bf16[8192,512], w1: bf16[512,2048], w2: bf16[2048,512]) -> bf16[8192,512] {
  %x = bf16[8192,512]{1,0:T(8,128)(2,1)} parameter(0)
  %w1 = bf16[512,2048]{1,0:T(8,128)(2,1)} parameter(1)
  %w2 = bf16[2048,512]{1,0:T(8,128)(2,1)} parameter(2)
  %copy-start = (bf16[8192,512]{1,0:T(8,128)(2,1)S(1)}, bf16[8192,512]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%x)
  %copy-done = bf16[8192,512]{1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start)
  %fusion.1 = bf16[8192,2048]{1,0:T(8,128)(2,1)S(1)} fusion(%copy-done, %w1), kind=kOutput, calls=%fused_computation
  %slice-start = ((bf16[2048,512]{1,0:T(8,128)(2,1)}), bf16[512,512]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%w2), slice={[0:512], [0:512]}
  %slice-done = bf16[512,512]{1,0:T(8,128)(2,1)S(1)} slice-done(%slice-start)
  ROOT %fusion.2 = bf16[8192,512]{1,0:T(8,128)(2,1)} fusion(%fusion.1, %slice-done), kind=kOutput, calls=%fused_computation
}
"""
MB = 2**20


def test_entry_operations_are_the_entry_computations_data_movers():
  ops = list(hlo_bytes.entry_operations(HLO))
  assert [(name, opcode) for name, _, opcode, _, _ in ops] == [("copy-start", "copy-start"),
                                                               ("copy-done", "copy-done"),
                                                               ("fusion.1", "fusion"),
                                                               ("slice-start", "slice-start"),
                                                               ("slice-done", "slice-done"),
                                                               ("fusion.2", "fusion")]
  _, shape, _, operands, _ = ops[2]
  assert hlo_bytes.shape_bytes(shape) == 32 * MB and list(map(hlo_bytes.shape_bytes,
                                                              operands)) == [8 * MB, 2 * MB]
  assert hlo_bytes.shape_bytes(shape, hbm_only=True) == 0  # the hidden lives in on-chip memory


def test_hbm_bytes_leave_out_what_lives_on_chip():
  """x read once by its prefetch, w1 read by the first product, the 0.5 MB piece of w2 read by the
  slice, the result written: 18.5 MB. The 32 MB hidden, written and read on chip, is not HBM traffic
  (everything counted wherever it lives would be 8 + 2 + 32 + 32 + 0.5 + 8 MB and the copies)."""
  assert hlo_bytes.hbm_bytes(HLO) == 8 * MB + 2 * MB + MB // 2 + 8 * MB
