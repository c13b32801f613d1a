"""Builds flashattn_ext._C against the torch already installed.

    pip install -r requirements.txt                 # torch==2.11.0 (CUDA 13.0), ninja, numpy, pytest, ...
    pip install --no-build-isolation -e .

The CUDA kernels are compiled when torch is a CUDA build and nvcc is found;
otherwise the extension is CPU-only and still complete. The line starting
"flashattn_ext:" says which build was chosen and why (pip shows it with -v;
`python -m flashattn_ext` prints the build too). The C++ standard follows
torch's headers: C++20 where they require it (torch 2.15 and later), C++17
before. Environment knobs:

    FLASHATTN_CUDA_ARCHS   CUDA archs to compile, e.g. "90" or "80;90": overrides the rule below
    TORCH_CUDA_ARCH_LIST   torch's extension convention, used when FLASHATTN_CUDA_ARCHS is not set:
                           e.g. "9.0", "8.0;9.0", "8.0 8.6", names such as "Hopper"; archs below
                           8.0 are left out (the kernels need sm80's mma.sync), "+PTX" is ignored
                           (the extension ships SASS only), "native" means the GPUs present.
                           Neither set: the archs of the GPUs this machine has (a GPU machine builds
                           its own arch only), else, with no GPU visible, the supported list "80;90".
    FLASHATTN_HEAD_DIMS    kernel head dims to compile, e.g. "64,128" (default all of
                           csrc/cuda/generate_instantiations.py HEAD_DIMS; a call with another head dim uses the
                           next larger compiled one)
    FLASHATTN_CPU_ONLY=1   skip the CUDA kernels even when nvcc is present
    FLASHATTN_PTXAS_VERBOSE=1  print the register / shared memory report of every kernel
    FLASHATTN_TUNING=1     also compile the candidate tile configurations of
                           csrc/cuda/kernel_configs.h (for benchmarks/tune.py)
    FLASHATTN_DEBUG_INFO=1 keep the C++ sources' debug information (python's -g; the build drops it
                           by default: it doubled their compile time; symbols stay either way)
    MAX_JOBS               parallel compile jobs (default: all cores)

The build's progress (ninja's "[k/n]" line per compiled source) is printed as it
goes; pip hides it unless run with -v (`pip install -v --no-build-isolation -e .`).
"""

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

from setuptools import __version__ as setuptools_version
from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _generator_head_dims():
    """The one list of kernel head dims: csrc/cuda/generate_instantiations.py's
    HEAD_DIMS (which also writes one kernel source per head dim)."""
    path = os.path.join(ROOT, "csrc", "cuda", "generate_instantiations.py")
    spec = importlib.util.spec_from_file_location("generate_instantiations", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.HEAD_DIMS)


ALL_HEAD_DIMS = _generator_head_dims()
DTYPES = ("fp16", "bf16")
SETUP_HINT = "pip install -r requirements.txt"


def _say(msg):
    """One line for the person building (pip shows it with -v, or on failure)."""
    print(f"flashattn_ext: {msg}", flush=True)


def _fail(msg):
    """One plain line and a non-zero exit, no traceback."""
    print(f"flashattn_ext: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def _check_build_dependencies():
    """What the build needs before anything imports it: torch (built against,
    so it must be installed first and the build not isolated), wheel (setuptools
    < 70.1 keeps bdist_wheel there) and ninja (else a slow serial build)."""
    missing = [m for m in ("torch",) if importlib.util.find_spec(m) is None]
    if missing and any("pip-build-env" in p for p in sys.path):
        _fail(
            "pip is building in an isolated environment, without your torch: run `pip install "
            f"--no-build-isolation -e .` (after `{SETUP_HINT}`), so that the kernels compile against the "
            "torch they will run with"
        )
    if tuple(int(x) for x in re.findall(r"\d+", setuptools_version)[:2]) < (70, 1):
        if importlib.util.find_spec("wheel") is None:
            missing.append("wheel")
    if missing:
        _fail(
            f"{' and '.join(missing)} not installed in {sys.executable}; run `{SETUP_HINT}` first, then "
            "`pip install --no-build-isolation -e .` (torch must be there before the build: the kernels "
            "compile against it)"
        )
    if importlib.util.find_spec("ninja") is None and shutil.which("ninja") is None:
        _say(f"ninja not found: falling back to a slow serial build (`{SETUP_HINT}` installs it)")


def _env_list(name, default, sep):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return list(default)
    return [x.strip() for x in raw.replace(";", sep).replace(",", sep).split(sep) if x.strip()]


def _nvcc_version(nvcc):
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _cuda_available():
    """(True, nvcc version) or (False, why not)."""
    if os.environ.get("FLASHATTN_CPU_ONLY", "0") == "1":
        return False, "FLASHATTN_CPU_ONLY=1"
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU-only build"
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
    if nvcc is None or shutil.which(nvcc) is None:
        return False, "nvcc not found (install the CUDA toolkit or set CUDA_HOME)"
    version = _nvcc_version(nvcc)
    torch_major = int(torch.version.cuda.split(".")[0])
    if version is not None and version[0] != torch_major:
        _fail(
            f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but {nvcc} is CUDA "
            f"{version[0]}.{version[1]}: install a torch built for CUDA {version[0]} (for CUDA 13: "
            f"`{SETUP_HINT}`, torch==2.11.0), point CUDA_HOME at a CUDA {torch_major} toolkit, or build "
            "without the CUDA kernels with FLASHATTN_CPU_ONLY=1"
        )
    return True, "nvcc " + (f"{version[0]}.{version[1]}" if version else "(version unknown)") + f" at {CUDA_HOME}"


def cxx_standard():
    """17 or 20: the C++ standard torch's headers require. Since 2.15 ATen.h
    stops with "#error C++20 or later compatible compiler is required"; older
    headers ask for C++17. Read from the headers rather than guessed from the
    version."""
    import torch

    std = 17
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    for header in ("ATen/ATen.h", "c10/macros/Macros.h", "torch/all.h"):
        try:
            with open(os.path.join(include, header), errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        for found in re.findall(r"C\+\+\s*(\d\d) or later", text):
            std = max(std, int(found))
    return std


def _head_dims():
    dims = sorted({int(d) for d in _env_list("FLASHATTN_HEAD_DIMS", ALL_HEAD_DIMS, ",")})
    bad = [d for d in dims if d not in ALL_HEAD_DIMS]
    if bad:
        sys.exit(f"FLASHATTN_HEAD_DIMS: {bad} not among the kernel head dims {ALL_HEAD_DIMS}")
    return dims


SUPPORTED_ARCHS = ("80", "90")  # the default build without a GPU to look at: A100 (sm80), H100/H200 (sm90a)

# TORCH_CUDA_ARCH_LIST's names (torch.utils.cpp_extension's table).
NAMED_ARCHS = {
    "Kepler+Tesla": "3.7",
    "Kepler": "3.5",
    "Maxwell+Tegra": "5.3",
    "Maxwell": "5.0;5.2",
    "Pascal": "6.0;6.1",
    "Volta+Tegra": "7.2",
    "Volta": "7.0",
    "Turing": "7.5",
    "Ampere+Tegra": "8.7",
    "Ampere": "8.0;8.6",
    "Ada": "8.9",
    "Hopper": "9.0",
    "Blackwell+Tegra": "11.0",
    "Blackwell": "10.0;10.3;12.0;12.1",
}


def _parse_torch_arch_list(raw):
    """TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX", "8.6 9.0a", "Hopper") -> (archs >= 80 as
    strings like "90", what was left out and why)."""
    raw = raw.replace(" ", ";")
    for name, value in NAMED_ARCHS.items():  # combined names ("Ampere+Tegra") first
        raw = raw.replace(name, value)
    archs, below, ptx = [], [], False
    for entry in (e.strip() for e in raw.split(";")):
        if not entry:
            continue
        m = re.fullmatch(r"(\d+)\.(\d)[af]?(\+PTX)?", entry)
        if m is None:
            sys.exit(f"TORCH_CUDA_ARCH_LIST: {entry!r} is not an arch such as 8.0, 9.0a or 8.6+PTX")
        arch = m.group(1) + m.group(2)
        ptx = ptx or bool(m.group(3))
        if int(arch) < 80:
            below.append(entry)
        elif arch not in archs:
            archs.append(arch)
    dropped = [f"{', '.join(below)} (below 8.0: the kernels need sm80's mma.sync)"] if below else []
    if ptx:
        dropped.append("+PTX (the extension ships SASS only)")
    return sorted(archs, key=int), dropped


def _visible_gpu_archs():
    """The compute capabilities of the GPUs torch sees, as "90", "80", ..., capped
    at the newest arch this torch was built for (as torch's own rule does: nvcc
    is expected to match it). Empty without a GPU."""
    import torch

    try:
        caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        built = [int(re.sub(r"\D", "", a.split("_", 1)[1])) for a in torch.cuda.get_arch_list() if a.startswith("sm_")]
    except Exception:  # noqa: BLE001  (a driver that fails to answer counts as no GPU)
        return []
    archs = []
    for major, minor in caps:
        cap = 10 * major + minor
        if built:
            cap = min(cap, max(built))
        if str(cap) not in archs:
            archs.append(str(cap))
    return sorted(archs, key=int)


def _archs():
    """(archs to compile, why these): FLASHATTN_CUDA_ARCHS, else
    TORCH_CUDA_ARCH_LIST, else the GPUs present, else SUPPORTED_ARCHS."""
    if os.environ.get("FLASHATTN_CUDA_ARCHS", "").strip():
        archs = _env_list("FLASHATTN_CUDA_ARCHS", SUPPORTED_ARCHS, ";")
        for a in archs:
            if not a.isdigit() or int(a) < 80:
                sys.exit(f"FLASHATTN_CUDA_ARCHS: {a!r} is not an arch >= 80 (the kernels need mma.sync bf16)")
        return archs, "set by FLASHATTN_CUDA_ARCHS"
    torch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if torch_list and torch_list != "native":
        archs, dropped = _parse_torch_arch_list(torch_list)
        if not archs:
            sys.exit(
                f"TORCH_CUDA_ARCH_LIST={torch_list!r} names no arch >= 8.0 (the kernels need sm80's mma.sync): "
                "set it to e.g. 9.0, or build without the CUDA kernels with FLASHATTN_CPU_ONLY=1"
            )
        note = "from TORCH_CUDA_ARCH_LIST"
        if dropped:
            note += "; left out: " + ", ".join(dropped)
        return archs, note
    visible = _visible_gpu_archs()
    usable = [a for a in visible if int(a) >= 80]
    if usable:
        note = "the GPUs of this machine"
        if len(usable) < len(visible):
            note += " (left out, below sm80: " + ", ".join(f"sm_{a}" for a in visible if int(a) < 80) + ")"
        return usable, note + "; TORCH_CUDA_ARCH_LIST or FLASHATTN_CUDA_ARCHS to build others"
    if visible:
        why = f"this machine's GPUs ({', '.join('sm_' + a for a in visible)}) are below sm80, which the kernels need"
    else:
        why = "no GPU visible"
    note = f"{why}, so the supported list; TORCH_CUDA_ARCH_LIST or FLASHATTN_CUDA_ARCHS to choose"
    return list(SUPPORTED_ARCHS), note


def _links_libstdcxx_shared(cxx, extra):
    """Whether `cxx` links a shared library against the shared libstdc++
    (its NEEDED entries name libstdc++.so) when given `extra` flags."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w") as f:
            f.write("#include <sstream>\nstd::string probe(long x) { std::ostringstream s; s << x; return s.str(); }\n")
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
    compiler is told to link the shared libstdc++ instead, and where no flag
    does that, the build switches to the system's c++ / g++ (CXX is set for
    the compile and link steps) when that one links it shared."""
    cxx = os.environ.get("CXX", "c++")
    try:
        if _links_libstdcxx_shared(cxx, []):
            return []
        for extra in (["-nostdlib++", "-lstdc++"], ["-Wl,-Bdynamic", "-lstdc++"]):
            if _links_libstdcxx_shared(cxx, extra):
                _say(f"{cxx} links libstdc++ statically; linking with {' '.join(extra)} instead")
                return extra
        for other in (shutil.which("c++"), shutil.which("g++")):
            if other and os.path.realpath(other) != os.path.realpath(shutil.which(cxx) or cxx):
                if _links_libstdcxx_shared(other, []):
                    _say(
                        f"CXX={cxx} links libstdc++ statically (a second C++ runtime inside the extension "
                        f"crashes it); building with {other} instead"
                    )
                    os.environ["CXX"] = other
                    return []
    except OSError:
        return []
    _say(
        f"WARNING: {cxx} links libstdc++ statically and no flag or other compiler links the shared one; "
        "the extension may crash at its first error message: set CXX to a compiler that links libstdc++ shared"
    )
    return []


def extensions():
    import torch
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    std = cxx_standard()
    std_note = f"C++{std} (torch {torch.__version__}" + (" requires C++20)" if std >= 20 else ")")
    # -fno-trapping-math: the CPU kernels' element-wise loops (exp, clamps,
    # selects) vectorize only when the compiler may evaluate both arms of a
    # select; with the default -ftrapping-math GCC keeps them as branches,
    # scalar, on AVX2 (AVX-512 masks them). Nothing here enables FP traps, and
    # IEEE results (NaN, inf, signed zeros) are unchanged.
    # -g0 (after python's own -g): the DWARF of torch's headers in every C++
    # source was half of their compile time (CPU-only build on 2 cores 140 -> 90
    # s; attention_cuda.cpp 23 -> 12 s) and 31 of the CPU-only module's 33 MB.
    # Function names stay in the symbol table for backtraces.
    debug_info = os.environ.get("FLASHATTN_DEBUG_INFO", "0") == "1"
    cxx_flags = ["-O3"] + ([] if debug_info else ["-g0"]) + [f"-std=c++{std}", "-fno-trapping-math"]
    link_args = ["-fopenmp"] + _cxx_runtime_link_args()
    sources = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
    with_cuda, detail = _cuda_available()
    if not with_cuda:
        _say(f"building the CPU kernels only, no CUDA kernels ({detail}); {std_note}")
        return [
            CppExtension(
                "flashattn_ext._C",
                sources,
                extra_compile_args={"cxx": cxx_flags + ["-fopenmp"]},
                extra_link_args=link_args,
                py_limited_api=True,
            )
        ]

    dims, (archs, arch_source) = _head_dims(), _archs()
    kernel_sources = []
    for d in dims:
        for dt in DTYPES:
            kernel_sources += sorted(glob.glob(f"csrc/cuda/instantiations/*_hdim{d}_{dt}.cu"))
    sources += sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu")) + kernel_sources
    defines = ["-DFLASHATTN_WITH_CUDA"]
    # The compiled head dims, ascending: the C++ dispatch (attention_cuda.cpp, host
    # compiler only: nvcc would split the value at its commas) unrolls over them.
    head_dims_define = f"-DFLASHATTN_HDIMS={','.join(str(d) for d in dims)}"
    if os.environ.get("FLASHATTN_TUNING", "0") == "1":
        defines += ["-DFLASHATTN_TUNING"]
    defines += [
        f'-DFLASHATTN_CUDA_ARCHS="{";".join(archs)}"',
        f'-DFLASHATTN_HEAD_DIMS="{",".join(str(d) for d in dims)}"',
    ]
    nvcc_flags = [
        "-O3",
        f"-std=c++{std}",
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
    _say(
        f"building the CPU kernels and the CUDA kernels for archs {', '.join(archs)} "
        f"({', '.join('sm_90a' if a == '90' else 'sm_' + a for a in archs)}: {arch_source}), head dims "
        f"{', '.join(str(d) for d in dims)} ({len(kernel_sources)} kernel sources), {detail}; {std_note}"
    )
    return [
        CUDAExtension(
            "flashattn_ext._C",
            sources,
            extra_compile_args={"cxx": cxx_flags + defines + [head_dims_define, "-fopenmp"], "nvcc": nvcc_flags},
            extra_link_args=link_args,
            py_limited_api=True,
        )
    ]


def main():
    _check_build_dependencies()
    from torch.utils.cpp_extension import BuildExtension

    setup(
        ext_modules=extensions(),
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )


if __name__ == "__main__":
    main()
