"""A built module called with an array of another shape than it was built for.

raises: ShapeError
says: main: 'A' (argument 0) dimension 0 must be 4, got 5 (shape (5,))
"""

import numpy as np

import cuvil
from cuvil import te

A = te.placeholder((4,), name="A")
C = te.compute((4,), lambda i: A[i] + 1, name="C")
f = cuvil.build(te.create_schedule(C), [A, C])
f(np.zeros(5, "float32"), np.zeros(4, "float32"))
