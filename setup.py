"""Builds flashattn_ext._C against the torch already installed.

    pip install --no-build-isolation -e .

The CUDA kernels are compiled when torch is a CUDA build and nvcc is found;
otherwise the extension is CPU-only and still complete. Environment knobs:

    FLASHATTN_CUDA_ARCHS   CUDA archs to compile, e.g. "90" or "80;90" (default "80;90")
    FLASHATTN_HEAD_DIMS    kernel head dims to compile, e.g. "64,128" (default all:
                           32,64,96,128,192,256; a call with another head dim uses the
                           next larger compiled one)
    FLASHATTN_CPU_ONLY=1   skip the CUDA kernels even when nvcc is present
    FLASHATTN_PTXAS_VERBOSE=1  print the register / shared memory report of every kernel
    FLASHATTN_TUNING=1     also compile the candidate tile configurations of
                           csrc/cuda/kernel_configs.h (for benchmarks/tune.py)
    MAX_JOBS               parallel compile jobs (default: all cores)
"""

import glob
import os
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
ALL_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
DTYPES = ("fp16", "bf16")


def _env_list(name, default, sep):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return list(default)
    return [x.strip() for x in raw.replace(";", sep).replace(",", sep).split(sep) if x.strip()]


def _cuda_available():
    if os.environ.get("FLASHATTN_CPU_ONLY", "0") == "1":
        return False, "FLASHATTN_CPU_ONLY=1"
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None:
        return False, "torch is a CPU-only build"
    if CUDA_HOME is None or shutil.which(os.path.join(CUDA_HOME, "bin", "nvcc")) is None:
        return False, "nvcc not found (set CUDA_HOME)"
    return True, ""


def _head_dims():
    dims = sorted({int(d) for d in _env_list("FLASHATTN_HEAD_DIMS", ALL_HEAD_DIMS, ",")})
    bad = [d for d in dims if d not in ALL_HEAD_DIMS]
    if bad:
        sys.exit(f"FLASHATTN_HEAD_DIMS: {bad} not among the kernel head dims {ALL_HEAD_DIMS}")
    return dims


def _archs():
    archs = _env_list("FLASHATTN_CUDA_ARCHS", ("80", "90"), ";")
    for a in archs:
        if not a.isdigit() or int(a) < 80:
            sys.exit(f"FLASHATTN_CUDA_ARCHS: {a!r} is not an arch >= 80 (the kernels need mma.sync bf16)")
    return archs


def _links_libstdcxx_shared(cxx, extra):
    """Whether `cxx` links a shared library against the shared libstdc++
    (its NEEDED entries name libstdc++.so) when given `extra` flags."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w") as f:
            f.write('#include <sstream>\nstd::string probe(long x) { std::ostringstream s; s << x; return s.str(); }\n')
        cmd = [cxx, "-shared", "-fPIC", src, "-o", lib] + extra
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            return False
        with open(lib, "rb") as f:
            return b"libstdc++.so" in f.read()


def _cxx_runtime_link_args():
    """A compiler that links libstdc++ statically by default (seen on a GPU
    machine whose CXX was such a g++ wrapper) puts a second, never-initialized
    copy of the C++ runtime inside _C beside the one torch loads: the first
    error message that formatted a number crashed the process. Such a
    compiler is told to link the shared libstdc++ instead."""
    cxx = os.environ.get("CXX", "c++")
    try:
        if _links_libstdcxx_shared(cxx, []):
            return []
        for extra in (["-nostdlib++", "-lstdc++"], ["-Wl,-Bdynamic", "-lstdc++"]):
            if _links_libstdcxx_shared(cxx, extra):
                print(f"flashattn_ext: {cxx} links libstdc++ statically; linking with {' '.join(extra)} instead")
                return extra
    except OSError:
        return []
    print(f"flashattn_ext: WARNING: {cxx} links libstdc++ statically and no flag made it link the shared one; "
          "the extension may crash at its first error message: set CXX to a compiler that links libstdc++ shared")
    return []


def extensions():
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    cxx_flags = ["-O3", "-std=c++17",]
    link_args = ["-fopenmp"] + _cxx_runtime_link_args()
    sources = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
    with_cuda, why_not = _cuda_available()
    if not with_cuda:
        print(f"flashattn_ext: building without CUDA kernels ({why_not})")
        return [
            CppExtension(
                "flashattn_ext._C",
                sources,
                extra_compile_args={"cxx": cxx_flags + ["-fopenmp"]},
                extra_link_args=link_args,
                py_limited_api=True,
            )
        ]

    dims, archs = _head_dims(), _archs()
    kernel_sources = []
    for d in dims:
        for dt in DTYPES:
            kernel_sources += sorted(glob.glob(f"csrc/cuda/instantiations/*_hdim{d}_{dt}.cu"))
    sources += sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu")) + kernel_sources
    defines = ["-DFLASHATTN_WITH_CUDA"] + [f"-DFLASHATTN_HDIM_{d}" for d in dims]
    if os.environ.get("FLASHATTN_TUNING", "0") == "1":
        defines += ["-DFLASHATTN_TUNING"]
    defines += [
        f'-DFLASHATTN_CUDA_ARCHS="{";".join(archs)}"',
        f'-DFLASHATTN_HEAD_DIMS="{",".join(str(d) for d in dims)}"',
    ]
    nvcc_flags = [
        "-O3",
        "-std=c++17",
        "--use_fast_math",
        "-lineinfo",
        "--expt-relaxed-constexpr",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    ] + defines
    for a in archs:
        # sm90 is built as sm90a: the Hopper kernels use wgmma, which only the
        # arch-specific target has (the binary runs on H100/H200 either way).
        a = "90a" if a == "90" else a
        nvcc_flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    if "90" in archs:
        nvcc_flags += ["-DFLASHATTN_SM90"]
    if os.environ.get("FLASHATTN_PTXAS_VERBOSE", "0") == "1":
        nvcc_flags += ["-Xptxas", "-v"]
    print(f"flashattn_ext: building CUDA kernels for archs {archs}, head dims {dims}")
    return [
        CUDAExtension(
            "flashattn_ext._C",
            sources,
            extra_compile_args={"cxx": cxx_flags + defines + ["-fopenmp"], "nvcc": nvcc_flags},
            extra_link_args=link_args,
            py_limited_api=True,
        )
    ]


def main():
    from torch.utils.cpp_extension import BuildExtension

    setup(
        ext_modules=extensions(),
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )


if __name__ == "__main__":
    main()
