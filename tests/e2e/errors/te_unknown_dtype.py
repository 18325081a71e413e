"""A placeholder of a dtype that does not exist.

raises: DTypeError
says: unknown dtype 'float13'; supported: float16, float32
"""

from cuvil import te

A = te.placeholder((4, 8), name="A", dtype="float13")
