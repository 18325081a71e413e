"""A reorder of the two loops of one reduction, which isl's dataflow analysis refuses: the sum would be
added up in another order (rfactor makes that explicit).

raises: ScheduleError
says: C.reorder('l', 'k') would change the results
says: S1_C_update[i = 0, k, l] -> S1_C_update[i' = 0, k' = 1 + k, l' = l]
says: keep the loops of one reduction in their order
"""

from cuvil import te

n = 16
A = te.placeholder((n, n), name="A")
k = te.reduce_axis((0, n), name="k")
l = te.reduce_axis((0, n), name="l")  # noqa: E741
C = te.compute((1,), lambda i: te.sum(A[k, l], axis=[k, l]), name="C")
s = te.create_schedule(C)
s[C].reorder(l, k)
