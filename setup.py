"""Build of zero_ext: the C core `zero_ext._C` always, the CUDA library `libzx_cuda.so` where it can.

`zero_ext._C` is plain C11 from csrc/ and its bindings in csrc/python/ (no torch headers, so no torch is
needed to build it).
`zero_ext/libzx_cuda.so` holds kernels/*.cu and csrc/comm_nccl.c; Python loads it with ctypes only
when CUDA tensors are used. ZERO_EXT_CUDA=0|1|auto (default auto) says whether to build it: auto builds
it where nvcc and NCCL are found, 1 fails with a message naming what is missing, 0 skips it.
ZERO_EXT_CUDA_ARCHS (e.g. "80;90") picks the GPU architectures.
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CUDA_SOURCES = ["csrc/comm_nccl.c"] + sorted(glob.glob("kernels/*.cu"))
# csrc/*.c: the C core (no Python); csrc/python/*.c: its bindings, the only code with Python.h
C_SOURCES = sorted(set(glob.glob("csrc/*.c")) - set(CUDA_SOURCES)) + sorted(glob.glob("csrc/python/*.c"))
C_FLAGS = ["-std=c11", "-O3", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fvisibility=hidden"]


class CudaLibrary(Extension):
    """A plain shared library (no Python API) built with nvcc and loaded through ctypes."""


def find_cuda():
    """(cuda_home, nccl_include, nccl_lib), or the list of what is missing.

    CUDA_HOME (or CUDA_PATH) and NCCL_HOME, when set, are the only places looked at: an explicit
    choice that is wrong should fail, not fall back to another toolkit.
    """
    missing = []
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        nvcc = os.path.join(home, "bin", "nvcc")
        if not os.path.exists(nvcc):
            missing.append(f"nvcc (not found in CUDA_HOME={home}/bin)")
    else:
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        if not os.path.exists(nvcc):
            missing.append("nvcc (install the CUDA toolkit, or set CUDA_HOME)")
        home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if os.environ.get("NCCL_HOME"):
        roots = [os.environ["NCCL_HOME"]]
    else:
        roots = [home, "/usr/local", "/usr"]
        try:  # the NCCL that torch's wheels bring (nvidia-nccl-cu*)
            import nvidia.nccl

            roots += list(nvidia.nccl.__path__)
        except ImportError:
            pass
    inc = next((os.path.join(r, "include") for r in roots if os.path.exists(os.path.join(r, "include", "nccl.h"))), None)
    libs = [os.path.join(r, sub) for r in roots for sub in ("lib", "lib64", "lib/x86_64-linux-gnu")]
    lib = next((d for d in libs if glob.glob(os.path.join(d, "libnccl.so*"))), None)
    where = f" in NCCL_HOME={os.environ['NCCL_HOME']}" if os.environ.get("NCCL_HOME") else " (install NCCL, or set NCCL_HOME)"
    if not inc:
        missing.append("nccl.h" + where)
    if not lib:
        missing.append("libnccl.so" + where)
    return missing or (home, inc, lib)


def cuda_wanted():
    mode = os.environ.get("ZERO_EXT_CUDA", "auto").strip().lower()
    if mode not in ("0", "1", "auto"):
        sys.exit(f"ZERO_EXT_CUDA must be 0, 1 or auto, not {mode!r}")
    if mode == "0":
        return None
    found = find_cuda()
    if isinstance(found, list):
        if mode == "1":
            sys.exit("ZERO_EXT_CUDA=1 but the CUDA library cannot be built; missing: " + "; ".join(found))
        print("zero_ext: building without CUDA; missing: " + "; ".join(found))
        return None
    return found


class BuildExt(build_ext):
    def get_ext_filename(self, name):
        # called with the full dotted name and with its last part: keep the plain library name
        if name.endswith("libzx_cuda"):
            return name.replace(".", os.sep) + ".so"
        return super().get_ext_filename(name)

    def build_extension(self, ext):
        if isinstance(ext, CudaLibrary):
            return self.build_cuda(ext)
        return super().build_extension(ext)

    def build_cuda(self, ext):
        home, nccl_inc, nccl_lib = ext.cuda
        nvcc = os.path.join(home, "bin", "nvcc")
        archs = os.environ.get("ZERO_EXT_CUDA_ARCHS", "80;90").split(";")
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
        tmp = os.path.join(self.build_temp, "cuda")
        os.makedirs(tmp, exist_ok=True)
        incs = ["-Icsrc", f"-I{home}/include", f"-I{nccl_inc}"]
        objs = []
        for src in ext.sources:
            obj = os.path.join(tmp, os.path.basename(src) + ".o")
            if src.endswith(".cu"):
                cmd = [nvcc, "-c", src, "-o", obj, "-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden"]
                cmd += gencode + incs
            else:
                cmd = [sysconfig.get_config_var("CC").split()[0] or "cc", "-c", src, "-o", obj, "-fPIC"] + C_FLAGS + incs
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            objs.append(obj)
        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        link = [nvcc, "-shared", "-o", out] + objs + [f"-L{nccl_lib}", "-lnccl", f"-Xlinker=-rpath,{nccl_lib}"]
        print(" ".join(link))
        subprocess.check_call(link)


def uring_options():
    """io_uring where liburing is installed (Debian's liburing-dev); else NVMe I/O uses its thread backend."""
    if any(os.path.exists(os.path.join(d, "liburing.h")) for d in ("/usr/include", "/usr/local/include")):
        return {"define_macros": [("ZX_HAVE_URING", "1")], "libraries": ["uring"]}
    print("zero_ext: liburing.h not found: building NVMe I/O without io_uring (pread/pwrite threads); "
          "install liburing-dev for io_uring")
    return {}


def extensions():
    # depends: headers hold inline kernels (cpu_optim.h), so a changed header rebuilds the module
    exts = [Extension("zero_ext._C", sources=C_SOURCES, include_dirs=["csrc"], extra_compile_args=C_FLAGS,
                      depends=sorted(glob.glob("csrc/*.h") + glob.glob("csrc/python/*.h")), **uring_options())]
    cuda = cuda_wanted()
    if cuda:
        lib = CudaLibrary("zero_ext.libzx_cuda", sources=CUDA_SOURCES)
        lib.cuda = cuda
        exts.append(lib)
    return exts


if __name__ == "__main__":
    setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
