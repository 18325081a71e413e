"""CUDA C -> PTX with NVRTC (cuda-python's ``cuda.bindings.nvrtc``), and PTX checks with ``ptxas``.

No GPU is needed for either.  Install the tools with ``pip install
"cuvil[cuda]"`` (cuda-bindings, nvidia-cuda-nvrtc and nvidia-cuda-nvcc, all
pinned to CUDA 13.0: NVRTC 13.x newer than the driver emits a PTX version the
driver rejects).  The bindings are imported here only, on first use.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile

from cuvil.errors import TargetError

INSTALL = 'pip install "cuvil[cuda]" (cuda-bindings, nvidia-cuda-nvrtc and nvidia-cuda-nvcc 13.0.*)'


def _nvrtc() -> object:
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise TargetError(f"compiling for CUDA needs NVRTC through cuda-python: {INSTALL} ({exc})") from None
    return nvrtc


def _check(result: tuple, what: str, log: str = "") -> tuple:
    err = result[0]
    if int(err) != 0:
        raise TargetError(f"NVRTC {what} failed ({err!r})" + (f":\n{log}" if log else ""))
    return result[1:]


def compile_ptx(source: str, arch: str, name: str = "kernel.cu") -> str:
    """PTX for ``arch`` ("sm_90") from CUDA C ``source``; a compile error raises TargetError with NVRTC's log."""
    nvrtc = _nvrtc()
    (prog,) = _check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture=compute_{arch[3:]}".encode(), b"--std=c++17", b"--fmad=true"]
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        if int(err) != 0:
            (size,) = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            numbered = "\n".join(f"{i + 1:4d}  {line}" for i, line in enumerate(source.splitlines()))
            raise TargetError(f"NVRTC could not compile the generated CUDA C (a cuvil bug):\n"
                              f"{log.decode(errors='replace').strip()}\n--- source ---\n{numbered}")
        (size,) = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        buf = b" " * size
        _check(nvrtc.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
        return buf.rstrip(b"\0").decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def find_ptxas() -> str | None:
    """ptxas from the nvidia-cuda-nvcc wheel, $CUDA_HOME, PATH or /usr/local/cuda (in that order)."""
    candidates = []
    for site in sys.path:
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "cu*", "bin", "ptxas")))
        candidates.append(os.path.join(site, "nvidia", "cuda_nvcc", "bin", "ptxas"))
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "ptxas"))
    which = shutil.which("ptxas")
    if which:
        candidates.append(which)
    candidates.append("/usr/local/cuda/bin/ptxas")
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def check_ptx(ptx: str, arch: str, ptxas: str | None = None) -> str:
    """Assemble ``ptx`` for ``arch`` with ptxas (-v); returns ptxas's report (registers, shared memory)."""
    ptxas = ptxas or find_ptxas()
    if ptxas is None:
        raise TargetError(f"ptxas not found: {INSTALL}, or put CUDA's bin directory on PATH")
    with tempfile.TemporaryDirectory(prefix="cuvil-ptx-") as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas, f"-arch={arch}", "-v", "-o", os.path.join(tmp, "k.cubin"), src],
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise TargetError(f"ptxas -arch={arch} rejected the PTX:\n{proc.stderr.strip()}")
    return proc.stderr


__all__ = ["INSTALL", "check_ptx", "compile_ptx", "find_ptxas"]
