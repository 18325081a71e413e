"""The CUDA driver, through cuda-python (``cuda.bindings.driver``) or, where only it is installed, pycuda.

Both give the same small interface (:class:`Device`): load PTX, allocate,
copy, launch, time with events.  Nothing is imported until a GPU is asked
for; without a driver or a GPU, :func:`device` raises TargetError saying why.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from cuvil.errors import TargetError

_DEVICE: Device | None = None


class Device:
    """One GPU's primary context."""

    backend = "none"

    def load(self, ptx: str, names: list[str]) -> dict[str, Any]:
        raise NotImplementedError

    def alloc(self, nbytes: int) -> int:
        raise NotImplementedError

    def free(self, ptr: int) -> None:
        raise NotImplementedError

    def to_device(self, ptr: int, a: np.ndarray) -> None:
        raise NotImplementedError

    def to_host(self, a: np.ndarray, ptr: int) -> None:
        raise NotImplementedError

    def launch(self, fn: Any, grid: tuple[int, int, int], block: tuple[int, int, int], args: list[Any]) -> None:
        """``args``: ctypes values (c_uint64 device pointers, c_longlong sizes)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError

    def timer(self) -> tuple[Any, Any]:
        """``(start, stop)``: call ``start()`` then ``stop()``, which returns the milliseconds between them."""
        raise NotImplementedError


def _ok(result: Any, what: str) -> Any:
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise TargetError(f"CUDA driver call {what} failed: {err!r}")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


class _CudaPython(Device):
    backend = "cuda-python"

    def __init__(self) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        try:
            _ok(cu.cuInit(0), "cuInit")
        except RuntimeError as exc:  # the driver library is missing: no GPU here
            raise TargetError(f"no CUDA driver on this machine ({exc})") from None
        count = _ok(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if count < 1:
            raise TargetError("the CUDA driver sees no GPU on this machine")
        self.dev = _ok(cu.cuDeviceGet(0), "cuDeviceGet")
        self.ctx = _ok(cu.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        _ok(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def load(self, ptx: str, names: list[str]) -> dict[str, Any]:
        cu = self.cu
        mod = _ok(cu.cuModuleLoadData(ptx.encode() + b"\0"), "cuModuleLoadData")
        return {n: _ok(cu.cuModuleGetFunction(mod, n.encode()), f"cuModuleGetFunction({n})") for n in names}

    def alloc(self, nbytes: int) -> int:
        return int(_ok(self.cu.cuMemAlloc(max(1, nbytes)), "cuMemAlloc"))

    def free(self, ptr: int) -> None:
        self.cu.cuMemFree(self.cu.CUdeviceptr(ptr))

    def to_device(self, ptr: int, a: np.ndarray) -> None:
        if a.nbytes:
            _ok(self.cu.cuMemcpyHtoD(self.cu.CUdeviceptr(ptr), a.ctypes.data, a.nbytes), "cuMemcpyHtoD")

    def to_host(self, a: np.ndarray, ptr: int) -> None:
        if a.nbytes:
            _ok(self.cu.cuMemcpyDtoH(a.ctypes.data, self.cu.CUdeviceptr(ptr), a.nbytes), "cuMemcpyDtoH")

    def launch(self, fn: Any, grid: tuple[int, int, int], block: tuple[int, int, int], args: list[Any]) -> None:
        ptrs = (ctypes.c_void_p * max(1, len(args)))(*[ctypes.addressof(a) for a in args])
        _ok(self.cu.cuLaunchKernel(fn, *grid, *block, 0, self.cu.CUstream(0), ctypes.addressof(ptrs), 0),
            "cuLaunchKernel")

    def synchronize(self) -> None:
        _ok(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def timer(self) -> tuple[Any, Any]:
        cu = self.cu
        start = _ok(cu.cuEventCreate(0), "cuEventCreate")
        stop = _ok(cu.cuEventCreate(0), "cuEventCreate")

        def begin() -> None:
            _ok(cu.cuEventRecord(start, cu.CUstream(0)), "cuEventRecord")

        def end() -> float:
            _ok(cu.cuEventRecord(stop, cu.CUstream(0)), "cuEventRecord")
            _ok(cu.cuEventSynchronize(stop), "cuEventSynchronize")
            return float(_ok(cu.cuEventElapsedTime(start, stop), "cuEventElapsedTime"))

        return begin, end


class _PyCuda(Device):
    backend = "pycuda"

    def __init__(self) -> None:
        try:
            import pycuda.driver as drv
        except Exception as exc:  # ImportError, or libcuda missing
            raise TargetError(f"pycuda cannot reach a GPU here ({exc})") from None
        drv.init()
        if drv.Device.count() < 1:
            raise TargetError("the CUDA driver sees no GPU on this machine")
        self.drv = drv
        self.ctx = drv.Device(0).retain_primary_context()
        self.ctx.push()

    def load(self, ptx: str, names: list[str]) -> dict[str, Any]:
        mod = self.drv.module_from_buffer(ptx.encode())
        return {n: mod.get_function(n) for n in names}

    def alloc(self, nbytes: int) -> int:
        mem = self.drv.mem_alloc(max(1, nbytes))
        self._keep = getattr(self, "_keep", {})
        self._keep[int(mem)] = mem
        return int(mem)

    def free(self, ptr: int) -> None:
        mem = getattr(self, "_keep", {}).pop(ptr, None)
        if mem is not None:
            mem.free()

    def to_device(self, ptr: int, a: np.ndarray) -> None:
        if a.nbytes:
            self.drv.memcpy_htod(ptr, a)

    def to_host(self, a: np.ndarray, ptr: int) -> None:
        if a.nbytes:
            self.drv.memcpy_dtoh(a, ptr)

    def launch(self, fn: Any, grid: tuple[int, int, int], block: tuple[int, int, int], args: list[Any]) -> None:
        vals = [np.uint64(a.value) if isinstance(a, ctypes.c_uint64) else np.int64(a.value) for a in args]
        fn(*vals, block=block, grid=grid)

    def synchronize(self) -> None:
        self.drv.Context.synchronize()

    def timer(self) -> tuple[Any, Any]:
        start, stop = self.drv.Event(), self.drv.Event()

        def end() -> float:
            stop.record()
            stop.synchronize()
            return float(start.time_till(stop))

        return start.record, end


def device() -> Device:
    """The first GPU, through cuda-python, else pycuda; TargetError (with the reason) when there is none."""
    global _DEVICE
    if _DEVICE is None:
        try:
            import cuda.bindings.driver  # noqa: F401
        except ImportError:
            try:
                import pycuda  # noqa: F401
            except ImportError:
                raise TargetError('running CUDA modules needs cuda-python (pip install "cuvil[cuda]") or pycuda, '
                                  "and an NVIDIA GPU with its driver") from None
            _DEVICE = _PyCuda()
        else:
            _DEVICE = _CudaPython()
    return _DEVICE


def gpu_available() -> tuple[bool, str]:
    """``(True, "")`` when a GPU can run cuvil's CUDA modules here, else ``(False, why)``."""
    try:
        device()
    except TargetError as exc:
        return False, str(exc)
    return True, ""


__all__ = ["Device", "device", "gpu_available"]
