"""A compute adds two tensors of different shapes: B is 8 x 4 but read as 4 x 8.

raises: ShapeError
says: compute C reads B[i, j] outside B (shape (8, 4)) in dimension 1
says: at i = 0, j = 4 the index is 4
"""

import cuvil
from cuvil import te

A = te.placeholder((4, 8), name="A")
B = te.placeholder((8, 4), name="B")
C = te.compute((4, 8), lambda i, j: A[i, j] + B[i, j], name="C")
cuvil.build(te.create_schedule(C), [A, B, C])
