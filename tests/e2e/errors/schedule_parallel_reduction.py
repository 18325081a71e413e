"""A reduction axis run in parallel: isl finds the flow dependence the loop carries.

raises: ScheduleError
says: C.parallel('k'): loop k of C cannot be parallel: it carries a flow dependence
says: S1_C_update[i, k] -> S1_C_update[i' = i, k' = 1 + k]
says: a reduction axis needs rfactor first
"""

from cuvil import te

n = 16
A = te.placeholder((n, n), name="A")
k = te.reduce_axis((0, n), name="k")
C = te.compute((n,), lambda i: te.sum(A[i, k], axis=k), name="C")
s = te.create_schedule(C)
s[C].parallel(k)
