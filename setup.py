"""Build rl_losses._C: the C++ ops (always) and their CUDA kernels (when torch has CUDA and nvcc exists).

RL_LOSSES_CUDA=1 forces the CUDA build (an error if it cannot), RL_LOSSES_CUDA=0 forces a CPU-only build;
unset, CUDA is built when torch was built with it and nvcc is found. The choice is printed. CUDA targets
sm_90 (H100/H200) plus whatever TORCH_CUDA_ARCH_LIST asks for.
"""
import glob
import os
import subprocess

from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda() -> bool:
    flag = os.environ.get("RL_LOSSES_CUDA", "").strip()
    available = torch.version.cuda is not None and CUDA_HOME is not None
    if flag == "1":
        if not available:
            raise RuntimeError(
                f"RL_LOSSES_CUDA=1 but torch.version.cuda={torch.version.cuda} and CUDA_HOME={CUDA_HOME}: "
                "install a CUDA build of torch and the CUDA toolkit (nvcc)")
        return True
    if flag == "0":
        return False
    return available


def cuda_arch_flags() -> list[str]:
    # sm_90 always (the H100/H200 this project is tuned for); TORCH_CUDA_ARCH_LIST adds more through
    # torch's own handling, which reads the variable when it is set.
    flags = ["-gencode=arch=compute_90,code=sm_90"]
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    return flags


def cuda_library_includes() -> list[str]:
    # ATen's CUDA headers include cuSPARSE/cuBLAS headers; a minimal toolkit may lack them while torch's own
    # pip CUDA wheels (nvidia-*) ship them. Add those include folders when they exist.
    try:
        import nvidia
    except ImportError:
        return []
    return sorted(d for p in nvidia.__path__ for d in glob.glob(os.path.join(p, "*", "include")))


use_cuda = want_cuda()
print(f"rl_losses: building {'CPU + CUDA' if use_cuda else 'CPU-only'} extension "
      f"(torch {torch.__version__}, torch.version.cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME})")

sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
define_macros = []  # py_limited_api=True below defines Py_LIMITED_API
# No -std flag: torch.utils.cpp_extension picks the standard its headers need (C++17 or C++20).
# The std::string ABI must match torch's: a mismatch only shows when an error message crosses into libc10
# (every TORCH_CHECK failure then crashed the process instead of raising). Recent torch no longer passes it.
abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
# -fopenmp: at::parallel_for is a header template compiled into this library; without OpenMP its pragma is
# ignored and the CPU kernels run on one thread. It also honours the `omp simd` marks on the CPU row loops.
# -fno-trapping-math (as torch itself is built): lets GCC vectorise the polynomial exp in those loops.
extra = {"cxx": ["-O3", "-fopenmp", "-fno-trapping-math", abi]}
include_dirs = [os.path.join(ROOT, "csrc")]
if use_cuda:
    sources += sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True))
    extra["nvcc"] = ["-O3", abi, "--expt-relaxed-constexpr", "-lineinfo",
                     "-Xptxas=-warn-spills"] + cuda_arch_flags()
    define_macros.append(("RL_LOSSES_WITH_CUDA", "1"))
    include_dirs += cuda_library_includes()
    Ext = CUDAExtension
else:
    Ext = CppExtension


def avoid_static_libstdcxx() -> None:
    """Build with the system compiler when $CXX would link libstdc++ statically. The GPU machine's CXX
    (a wrapper around its own gcc) finds only a static libstdc++.a on its search path; a private static copy
    inside the extension has an uninitialised locale, and formatting any error message with a number then
    crashed the process (std::ostream::operator<<(double) inside _C.so) instead of raising.
    """
    def shared_libstdcxx(compiler: str) -> bool:
        try:
            out = subprocess.run([compiler, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                                 timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return True  # cannot tell: leave the user's choice alone
        return os.path.isabs(out) and os.path.exists(out)

    cxx = os.environ.get("CXX")
    if not cxx or shared_libstdcxx(cxx):
        return
    if os.path.exists("/usr/bin/g++") and shared_libstdcxx("/usr/bin/g++"):
        print(f"rl_losses: {cxx} finds no shared libstdc++ (it would link it statically); "
              "building with /usr/bin/gcc and /usr/bin/g++")
        os.environ["CC"], os.environ["CXX"] = "/usr/bin/gcc", "/usr/bin/g++"
    else:
        print(f"rl_losses: WARNING: {cxx} would link libstdc++ statically; errors raised by the ops may crash. "
              "Set CC/CXX to a compiler that links it dynamically.")


avoid_static_libstdcxx()

ext = Ext(
    name="rl_losses._C",
    sources=sources,
    include_dirs=include_dirs,
    extra_compile_args=extra,
    extra_link_args=["-fopenmp"],
    define_macros=define_macros,
    py_limited_api=True,
)

setup(
    packages=find_packages("python"),
    package_dir={"": "python"},
    # py.typed: the package's annotations are meant for type checkers (PEP 561); _C.pyi types the library module.
    package_data={"rl_losses": ["py.typed", "_C.pyi"]},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
