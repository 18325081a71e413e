"""A build for a target kind cuvil does not have.

raises: TargetError
says: unknown target kind 'fpga' in 'fpga'; known kinds: llvm, cuda
"""

import cuvil
from cuvil import te

A = te.placeholder((4,), name="A")
C = te.compute((4,), lambda i: A[i] + 1, name="C")
cuvil.build(te.create_schedule(C), [A, C], target="fpga")
