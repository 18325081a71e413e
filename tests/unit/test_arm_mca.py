"""cuvil.bench.mca and benchmarks/arm_mca.py on canned text: no llvm-mca, no qemu, no network."""

from __future__ import annotations

import importlib.util
import os

import pytest

from cuvil.bench import mca as bench_mca
from cuvil.bench.mca import Loop, McaError, Pipes

# llvm-mca-19 -mtriple=aarch64 -mcpu=neoverse-n1 -iterations=100 -bottleneck-analysis (the views this module reads)
REPORT = """\
Iterations:        100
Instructions:      500
Total Cycles:      410
Total uOps:        700

Dispatch Width:    8
uOps Per Cycle:    1.71
IPC:               1.22
Block RThroughput: 1.0


Cycles with backend pressure increase [ 23.90% ]
Throughput Bottlenecks:
  Resource Pressure       [ 0.00% ]
  Data Dependencies:      [ 23.90% ]
  - Register Dependencies [ 23.90% ]
  - Memory Dependencies   [ 0.00% ]

Critical sequence based on the simulation:

              Instruction                                 Dependency Information
 +----< 0.    ldp	q16, q17, [x2, #-32]
 |      1.    subs	x1, x1, #1
 |      2.    fmla	v6.4s, v17.4s, v19.s[0]
 +----> 3.    fmla	v2.4s, v16.4s, v19.s[0]           ## REGISTER dependency:  q16
        4.    b.ne	.LBB3_6


Instruction Info:
[1]: #uOps
[2]: Latency
[3]: RThroughput
[4]: MayLoad
[5]: MayStore
[6]: HasSideEffects (U)

[1]    [2]    [3]    [4]    [5]    [6]    Instructions:
 3      7     1.00    *                   ldp	q16, q17, [x2, #-32]
 1      1     0.33                        subs	x1, x1, #1
 1      4     0.50                        fmla	v6.4s, v17.4s, v19.s[0]
 1      4     0.50                        fmla	v2.4s, v16.4s, v19.s[0]
 1      1     1.00                        b.ne	.LBB3_6


Resources:
[0]   - N1UnitB
[1.0] - N1UnitD
[1.1] - N1UnitD
[2.0] - N1UnitL
[2.1] - N1UnitL
[3]   - N1UnitM
[4.0] - N1UnitS
[4.1] - N1UnitS
[5]   - N1UnitV0
[6]   - N1UnitV1


Resource pressure per iteration:
[0]    [1.0]  [1.1]  [2.0]  [2.1]  [3]    [4.0]  [4.1]  [5]    [6]
1.00    -      -     1.00   1.00   0.50   0.75   0.75   1.00   1.00

Resource pressure by instruction:
[0]    [1.0]  [1.1]  [2.0]  [2.1]  [3]    [4.0]  [4.1]  [5]    [6]    Instructions:
 -      -      -     1.00   1.00   0.50   0.25   0.25    -      -     ldp	q16, q17, [x2, #-32]
 -      -      -      -      -      -     0.50   0.50    -      -     subs	x1, x1, #1
 -      -      -      -      -      -      -      -      -     1.00   fmla	v6.4s, v17.4s, v19.s[0]
 -      -      -      -      -      -      -      -     1.00    -     fmla	v2.4s, v16.4s, v19.s[0]
1.00    -      -      -      -      -      -      -      -      -     b.ne	.LBB3_6
"""

# 16 independent fmla v.4s on the Cortex-A57 model llvm-mca 19 uses for cortex-a76 (summary and pressure only)
CALIBRATION_A57 = """\
Iterations:        100
Instructions:      1600
Total Cycles:      1611
Total uOps:        1600

Dispatch Width:    3
uOps Per Cycle:    0.99
IPC:               0.99
Block RThroughput: 16.0

Resources:
[0]   - A57UnitB
[1.0] - A57UnitI
[1.1] - A57UnitI
[2]   - A57UnitL
[3]   - A57UnitM
[4]   - A57UnitS
[5]   - A57UnitW
[6]   - A57UnitX


Resource pressure per iteration:
[0]    [1.0]  [1.1]  [2]    [3]    [4]    [5]    [6]
 -      -      -      -      -      -     16.00  16.00
"""

# the shape of a linked module's assembly: a kernel's body with a row loop around an unrolled reduction loop
# (the hot one), a tail loop with fewer fmla and a scalar loop; another kernel whose name extends this one's
ASM = """\
	.text
	.type	k3.body,@function
k3.body:
	stp	x29, x30, [sp, #-16]!
	mov	x8, xzr
.LBB5_1:                                // =>This Loop Header: Depth=1
	movi	v0.2d, #0000000000000000
	movi	v1.2d, #0000000000000000
	mov	w9, #64
	.p2align	4, , 16
.LBB5_2:                                //   Parent Loop BB5_1 Depth=1
                                        // =>  This Inner Loop Header: Depth=2
	ldp	q16, q17, [x2], #32
	ld1r	{ v18.4s }, [x3], #4
	subs	x9, x9, #1
	fmla	v0.4s, v16.4s, v18.4s
	fmla	v1.4s, v17.4s, v18.4s
	fmla	v2.4s, v16.4s, v19.s[0]
	cbz	x7, .LBB5_9             // an exit inside the loop
// %bb.3:
	fmla	v3.4s, v17.4s, v19.s[0]
	b.ne	.LBB5_2
// %bb.4:
	fadd	v0.4s, v0.4s, v20.4s
	stp	q0, q1, [x4], #32
	add	x8, x8, #1
	cmp	x8, #56
	b.ne	.LBB5_1
.LBB5_5:
	ldr	q16, [x2], #16
	ld1r	{ v18.4s }, [x3], #4
	fmla	v0.4s, v16.4s, v18.4s
	subs	x9, x9, #1
	b.ne	.LBB5_5
.LBB5_6:
	ldr	s0, [x2], #4
	fmadd	s1, s0, s2, s1
	fmul	s3, s0, s3
	tbnz	w9, #3, .LBB5_6
.LBB5_9:
	ldp	x29, x30, [sp], #16
	ret
.Lfunc_end5:
	.size	k3.body, .Lfunc_end5-k3.body

	.globl	k3_set_num_threads
k3_set_num_threads:
	ret
	.globl	k30
k30:
.LBB9_1:
	fmla	v0.4s, v1.4s, v2.4s
	fmla	v3.4s, v1.4s, v2.4s
	fmla	v4.4s, v1.4s, v2.4s
	fmla	v5.4s, v1.4s, v2.4s
	fmla	v6.4s, v1.4s, v2.4s
	b	.LBB9_1
"""


def _loop(*instructions: str) -> Loop:
    lines = (".LBB0_1:", *(f"\t{s}" for s in instructions), "\tb.ne\t.LBB0_1")
    return Loop("k0", ".LBB0_1", 0, len(lines) - 1, lines)


def test_report_summary_and_bottleneck_view():
    rep = bench_mca.parse_report(REPORT)
    assert (rep.iterations, rep.instructions, rep.total_cycles, rep.uops) == (100, 500, 410, 700)
    assert rep.block_rthroughput == 1.0 and rep.cycles_per_iteration == pytest.approx(4.1)
    assert rep.bottlenecks["Data Dependencies"] == 23.9 and rep.bottlenecks["Register Dependencies"] == 23.9
    assert rep.bottlenecks["Resource Pressure"] == 0.0


def test_report_resource_pressure():
    rep = bench_mca.parse_report(REPORT)
    assert len(rep.resources) == len(rep.pressure) == 10
    assert rep.resources[3] == ("2.0", "N1UnitL") and rep.resources[9] == ("6", "N1UnitV1")
    units = rep.unit_pressure()
    assert units["N1UnitL"] == 1.0 and units["N1UnitS"] == 0.75 and units["N1UnitD"] == 0.0
    assert units["N1UnitV0"] == units["N1UnitV1"] == 1.0 and units["N1UnitB"] == 1.0


def test_report_with_trailing_blanks():
    # llvm-mca pads its columns: the pressure header and values end in blanks
    padded = "\n".join(line + "    " for line in REPORT.splitlines())
    assert bench_mca.parse_report(padded) == bench_mca.parse_report(REPORT)


def test_report_without_summary_is_an_error():
    with pytest.raises(McaError, match="Total Cycles"):
        bench_mca.parse_report("Iterations: 100\nInstructions: 5\n")


def test_latency_bound_loop_is_named_latency():
    rep = bench_mca.parse_report(REPORT)
    pipes = Pipes(2.0, ("N1UnitV0", "N1UnitV1"))
    # 4.1 cycles an iteration where no resource is busy more than 1: the dependence on the ldp sets the pace
    assert bench_mca.bottleneck(rep, pipes).startswith("latency (")
    est = bench_mca.estimate(_loop("ldp q16, q17, [x2, #-32]", "subs x1, x1, #1", "fmla v6.4s, v17.4s, v19.s[0]",
                                   "fmla v2.4s, v16.4s, v19.s[0]"), rep, pipes)
    assert (est.fp_ops, est.fmla, est.instructions, est.bound) == (2, 2, 5, 1.0)
    assert est.efficiency == pytest.approx(1.0 / 4.1)


def test_fp_pipes_are_one_group_in_the_bottleneck():
    text = REPORT.replace("Total Cycles:      410", "Total Cycles:      100")
    rep = bench_mca.parse_report(text)
    assert bench_mca.bottleneck(rep, Pipes(2.0, ("N1UnitV0", "N1UnitV1"))) == "FP(V0+V1) 1.0"


def test_fma_pipes_from_the_calibration_block(monkeypatch):
    seen = []

    def fake(block: str, cpu: str, triple: str = "aarch64", iterations: int = 100):
        seen.append((block, cpu))
        return bench_mca.parse_report(CALIBRATION_A57)

    monkeypatch.setattr(bench_mca, "run_mca", fake)
    pipes = bench_mca.fma_pipes.__wrapped__("cortex-a76")
    assert pipes == Pipes(1.0, ("A57UnitW", "A57UnitX"))  # llvm-mca 19's model: one q-form fmla per cycle
    block, cpu = seen[0]
    assert cpu == "cortex-a76" and block.count("fmla") == 16 and "v15.4s, v30.4s, v31.4s" in block


def test_functions_of_a_listing():
    fns = bench_mca.functions(ASM)
    assert list(fns) == ["k3.body", "k3_set_num_threads", "k30"]
    lines = ASM.splitlines()
    lo, hi = fns["k3.body"]
    assert lines[lo] == "k3.body:" and lines[hi] == "k3_set_num_threads:"  # up to the next function


def test_kernel_functions_do_not_take_a_longer_name():
    assert bench_mca.kernel_functions(ASM, "k3") == {"k3.body"}
    assert bench_mca.kernel_functions(ASM, "k30") == {"k30"}


def test_loops_by_backward_branch():
    loops = bench_mca.find_loops(ASM, {"k3.body"})
    assert [(x.label, x.function) for x in loops] == [(".LBB5_1", "k3.body"), (".LBB5_2", "k3.body"),
                                                      (".LBB5_5", "k3.body"), (".LBB5_6", "k3.body")]
    assert [x.label for x in bench_mca.innermost(loops)] == [".LBB5_2", ".LBB5_5", ".LBB5_6"]
    outer = loops[0]
    assert outer.lines[0].startswith(".LBB5_1:") and outer.lines[-1] == "\tb.ne\t.LBB5_1"
    # the forward branch to .LBB5_9 closes no loop; a branch to another function's label is none either
    assert all(x.label != ".LBB5_9" for x in loops)


def test_hot_loop_is_the_innermost_with_most_accumulating_fmla():
    loop = bench_mca.hot_loop(ASM, "k3")
    assert loop is not None and loop.label == ".LBB5_2"
    assert (loop.fp_ops, loop.fmla, loop.accumulating) == (4, 4, 4)
    # an epilogue loop with more fmla, none accumulating, does not take its place
    epilogue = "\n".join([".LBB5_7:", "\tldr\tq0, [x1], #16", "\tmov\tv3.16b, v20.16b",
                          *["\tfmla\tv3.4s, v0.4s, v21.4s"] * 6, "\tstr\tq3, [x2], #16", "\tb.ne\t.LBB5_7"])
    with_epilogue = ASM.replace(".LBB5_9:\n", epilogue + "\n.LBB5_9:\n")
    assert bench_mca.hot_loop(with_epilogue, "k3").label == ".LBB5_2"
    # alone (no loop accumulates), the loop with the most FP multiply/adds
    assert bench_mca.hot_loop("k5:\n" + epilogue + "\n.LBB5_8:\n\tfadd\tv1.4s, v1.4s, v2.4s\n\tb\t.LBB5_8\n",
                              "k5").label == ".LBB5_7"
    assert len(loop.instructions) == 9  # labels, the alignment directive and comment lines are not instructions
    # the whole listing: k30's unconditional loop has five
    assert bench_mca.hot_loop(ASM).label == ".LBB9_1"
    assert bench_mca.hot_loop(ASM, "k3_set_num_threads") is None


def test_scalar_fp_is_not_counted():
    loop = bench_mca.find_loops(ASM, {"k3.body"})[3]
    assert loop.label == ".LBB5_6" and loop.fp_ops == 0 and loop.fmla == 0


def test_vector_fp_kinds():
    loop = _loop("fmla v0.4s, v1.4s, v2.s[1]", "fmls v3.2d, v1.2d, v2.2d", "fadd v0.4s, v0.4s, v1.4s",
                 "fmul v4.8h, v5.8h, v6.8h", "fmla z0.s, p0/m, z1.s, z2.s", "fmadd s0, s1, s2, s0",
                 "fadd s0, s0, s1", "fmax v0.4s, v0.4s, v1.4s", "ld1r { v18.4s }, [x3], #4")
    assert (loop.fp_ops, loop.fmla) == (5, 3)


def test_accumulators_are_the_carried_fmla_destinations():
    tile = _loop("ldp q16, q17, [x2], #32", "ldr s19, [x0, #3072]", "fmla v6.4s, v17.4s, v19.s[0]",
                 "fmla v2.4s, v16.4s, v19.s[0]", "ldr s19, [x0, #3076]", "fmla v6.4s, v16.4s, v19.s[0]",
                 "ld1r { v18.4s }, [x3], #4", "fmla v1.4s, v16.4s, v18.4s")
    assert tile.accumulators == {6, 2, 1} and tile.accumulating == 4
    # a polynomial (an epilogue's erf): its fmla destinations are set in the iteration, or by other instructions
    poly = _loop("ldr q0, [x1], #16", "mov v3.16b, v20.16b", "fmla v3.4s, v0.4s, v21.4s", "mov v4.16b, v22.16b",
                 "fmla v4.4s, v3.4s, v0.4s", "fmla v5.4s, v4.4s, v0.4s", "fmul v5.4s, v5.4s, v0.4s",
                 "str q5, [x2], #16")
    assert poly.accumulators == frozenset() and poly.accumulating == 0 and poly.fmla == 3


def test_loop_text_is_mca_input():
    text = bench_mca.hot_loop(ASM, "k3").text()
    lines = text.splitlines()
    assert lines[0] == ".LBB5_2:" and lines[-1] == "\tb.ne\t.LBB5_2"
    assert ".p2align" not in text and "//" not in text and "Parent Loop" not in text
    assert "\tcbz\tx7, .LBB5_9" in lines and text.endswith("\n")


def _arm_mca():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "arm_mca.py")
    spec = importlib.util.spec_from_file_location("arm_mca", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_table_and_weighted_total():
    tool = _arm_mca()
    rows = [{"kernel": "k1", "label": "Conv a", "op": "Conv", "calls": 2, "flops": 300.0, "fp": 16, "fmla": 16,
             "acc": 8, "ld": 5, "ins": 25, "cyc": 10.0, "bound": 8.0, "eff": 0.8, "bottleneck": "FP(V0+V1) 8.5"},
            {"kernel": "k2", "label": "MatMul b", "op": "MatMul", "calls": 1, "flops": 100.0, "fp": 8, "fmla": 8,
             "acc": 4, "ld": 3, "ins": 12, "cyc": 8.0, "bound": 4.0, "eff": 0.5, "bottleneck": "latency"},
            {"kernel": "k3", "label": "Gemm c", "op": "Gemm", "calls": 1, "flops": 100.0}]
    eff, covered = tool.weighted(rows)
    assert eff == pytest.approx((300 * 0.8 + 100 * 0.5) / 400) and covered == pytest.approx(0.8)
    lines = tool.table(rows, top=2)
    assert lines[1].split()[:3] == ["k1", "60.0%", "2"] and "80.0%" in lines[1] and lines[1].endswith("Conv a")
    assert lines[-1].startswith("... 1 more contraction kernels (20.0%")
    assert "no loop with vector FP ops" in tool.table(rows, top=3)[3]
