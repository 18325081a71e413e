"""A build for a CPU name LLVM does not know (LLVM itself would only warn, then abort the process).

raises: TargetError
says: LLVM does not know the processor 'banana' in target 'llvm -mcpu=banana'
"""

import cuvil
from cuvil import te

A = te.placeholder((4,), name="A")
C = te.compute((4,), lambda i: A[i] + 1, name="C")
cuvil.build(te.create_schedule(C), [A, C], target="llvm -mcpu=banana")
