"""A compute adds a float32 tensor and an int32 one (cuvil never converts silently).

raises: DTypeError
says: dtypes do not match in '+': float32 (A[i, j]) and int32 (B[i, j])
says: use te.cast(x, 'float32')
"""

from cuvil import te

A = te.placeholder((4, 8), name="A", dtype="float32")
B = te.placeholder((4, 8), name="B", dtype="int32")
C = te.compute((4, 8), lambda i, j: A[i, j] + B[i, j], name="C")
