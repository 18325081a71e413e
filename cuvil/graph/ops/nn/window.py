"""What the windowed operators (convolution, pooling, their NHWC and integer forms) read from their
attributes: strides, dilations, pads and ``auto_pad`` resolved into each spatial axis's begin pad and
output size; and the float check they share."""

from __future__ import annotations

from cuvil import dtype as dt
from cuvil.errors import DTypeError
from cuvil.graph.ops.base import NodeCtx


def attr_ints(ctx: NodeCtx, name: str, n: int, default: int) -> list[int]:
    v = ctx.attr(name)
    return [int(x) for x in v] if v is not None else [default] * n


def auto_pad(ctx: NodeCtx) -> str:
    a = ctx.attr("auto_pad", "NOTSET")
    return a.decode() if isinstance(a, bytes) else a


def window(ctx: NodeCtx, spatial: tuple[int, ...], kernel: list[int], ceil_mode: bool = False
            ) -> tuple[list[int], list[int], list[int], list[int]]:
    """Strides, dilations, begin pads and output sizes of a sliding window over ``spatial``."""
    n = len(spatial)
    strides = attr_ints(ctx, "strides", n, 1)
    dil = attr_ints(ctx, "dilations", n, 1)
    pads = attr_ints(ctx, "pads", 2 * n, 0)
    mode = auto_pad(ctx)
    begin, out = [], []
    for d in range(n):
        span = dil[d] * (kernel[d] - 1) + 1
        if mode in ("SAME_UPPER", "SAME_LOWER"):
            sp = -(-spatial[d] // strides[d])
            total = max((sp - 1) * strides[d] + span - spatial[d], 0)
            pb = total // 2 if mode == "SAME_UPPER" else total - total // 2
            begin.append(pb)
            out.append(sp)
            continue
        pb, pe = (0, 0) if mode == "VALID" else (pads[d], pads[d + n])
        full = spatial[d] + pb + pe - span
        if full < 0:
            raise ctx.error(f"the window ({span}) is larger than the padded input ({spatial[d] + pb + pe})")
        sp = (-(-full // strides[d]) if ceil_mode else full // strides[d]) + 1
        if ceil_mode and (sp - 1) * strides[d] >= spatial[d] + pb:
            sp -= 1
        begin.append(pb)
        out.append(sp)
    return strides, dil, begin, out


def float_input(ctx: NodeCtx) -> None:
    if not dt.is_float(ctx.dtype(0)):
        raise DTypeError(f"{ctx.node}: input 0 is {ctx.dtype(0)}; this operator needs a float tensor")
