"""A split by a factor of 0.

raises: ScheduleError
says: C.split(i): the factor must be a positive int, got 0
"""

from cuvil import te

A = te.placeholder((16,), name="A")
C = te.compute((16,), lambda i: A[i] * 2, name="C")
s = te.create_schedule(C)
s[C].split(C.op.axis[0], 0)
