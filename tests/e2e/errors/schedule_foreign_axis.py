"""A primitive on one stage given another stage's axis.

raises: ScheduleError
says: D.split: axis i belongs to stage C, not D; use s[C].split(...)
"""

from cuvil import te

A = te.placeholder((16,), name="A")
C = te.compute((16,), lambda i: A[i] * 2, name="C")
D = te.compute((16,), lambda i: C[i] + 1, name="D")
s = te.create_schedule(D)
s[D].split(C.op.axis[0], 4)
