"""Build rl_losses._C: the C++ ops (always) and their CUDA kernels (where the machine can run them).

RL_LOSSES_CUDA=1 forces the CUDA build (an error if it cannot), RL_LOSSES_CUDA=0 forces a CPU-only build;
unset, CUDA is built when torch was built with it, nvcc is found and a GPU is visible (compiling the kernels
takes minutes that a machine without a GPU would never use). The choice is printed. The CUDA architectures are
TORCH_CUDA_ARCH_LIST's (torch's syntax: "8.0;9.0a;10.0+PTX", scripts/build_wheel.sh); unset, those of the
visible GPUs, or sm_90 (H100/H200, what the kernels are tuned for) where none is visible. The CPU row loops are
compiled for the widest vector width this machine runs unless RL_LOSSES_CPU_WIDTHS=all asks for all three
(cpu_widths).
"""
import glob
import os
import subprocess
import sys

from setuptools import find_packages, setup
from torch.utils import cpp_extension
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))


def visible_gpu_archs() -> list[str]:
    """The compute capabilities of the visible GPUs ("9.0"), none without a GPU or a driver."""
    if torch.version.cuda is None:
        return []
    count = torch.cuda.device_count()  # 0 without a driver; does not initialise CUDA
    return sorted({"{}.{}".format(*torch.cuda.get_device_capability(i)) for i in range(count)})


def want_cuda() -> tuple[bool, str]:
    flag = os.environ.get("RL_LOSSES_CUDA", "").strip()
    toolkit = torch.version.cuda is not None and CUDA_HOME is not None
    if flag == "1":
        if not toolkit:
            raise RuntimeError(
                f"RL_LOSSES_CUDA=1 but torch.version.cuda={torch.version.cuda} and CUDA_HOME={CUDA_HOME}: "
                "install a CUDA build of torch and the CUDA toolkit (nvcc)")
        return True, "RL_LOSSES_CUDA=1"
    if flag == "0":
        return False, "RL_LOSSES_CUDA=0"
    if not toolkit:
        return False, "no CUDA toolkit"
    if not visible_gpu_archs():
        return False, "no GPU visible; RL_LOSSES_CUDA=1 builds the CUDA kernels anyway"
    return True, "a GPU is visible"


def set_cuda_archs() -> str:
    # torch.utils.cpp_extension turns TORCH_CUDA_ARCH_LIST into the -gencode flags (so no arch flag of our
    # own may appear in the nvcc flags: torch would then drop the list).
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(visible_gpu_archs()) or "9.0"
    return os.environ["TORCH_CUDA_ARCH_LIST"]


def cuda_library_includes() -> list[str]:
    # ATen's CUDA headers include cuSPARSE/cuBLAS headers; a minimal toolkit may lack them while torch's own
    # pip CUDA wheels (nvidia-*) ship them. Add those include folders when they exist.
    try:
        import nvidia
    except ImportError:
        return []
    return sorted(d for p in nvidia.__path__ for d in glob.glob(os.path.join(p, "*", "include")))


# The vector widths of the CPU row loops (csrc/common/cpu_isa.h), narrowest first, as ATen names them.
CPU_WIDTHS = ["DEFAULT", "AVX2", "AVX512"]


def cpu_widths() -> tuple[str, str, str]:
    """The narrowest and the widest CPU vector width to compile, every one between included, and why.
    RL_LOSSES_CPU_WIDTHS=native (the default) compiles only the widest this machine runs, ATen's capability of its
    CPU (ATEN_CPU_CAPABILITY aside): each width is a copy of the row loops, about half of compiling a file that
    holds them (docs/performance.md), and a library built in place runs where it was built (elsewhere the ops
    raise when the CPU lacks that width). =all compiles every width (a wheel, CI: a compile break in any width
    must not land), =default / avx2 / avx512 every width up to the one named."""
    flag = os.environ.get("RL_LOSSES_CPU_WIDTHS", "native").strip().upper()
    if flag == "NATIVE":
        cpu = "AVX512" if torch.cpu._is_avx512_supported() else "AVX2" if torch.cpu._is_avx2_supported() else "DEFAULT"
        return cpu, cpu, "RL_LOSSES_CPU_WIDTHS=native: this CPU's widest"
    if flag == "ALL":
        return CPU_WIDTHS[0], CPU_WIDTHS[-1], "RL_LOSSES_CPU_WIDTHS=all"
    if flag not in CPU_WIDTHS:
        raise ValueError(f"RL_LOSSES_CPU_WIDTHS={flag.lower()}: expected native, all, default, avx2 or avx512")
    return CPU_WIDTHS[0], flag, f"RL_LOSSES_CPU_WIDTHS={flag.lower()}"


use_cuda, why = want_cuda()
narrowest, widest, why_widths = cpu_widths()
archs = f", TORCH_CUDA_ARCH_LIST={set_cuda_archs()}" if use_cuda else ""
print(f"rl_losses: building {'CPU + CUDA' if use_cuda else 'CPU-only'} extension ({why}; torch {torch.__version__}, "
      f"torch.version.cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME}{archs}); CPU vector widths "
      f"{', '.join(CPU_WIDTHS[CPU_WIDTHS.index(narrowest):CPU_WIDTHS.index(widest) + 1])} ({why_widths})")

sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))


def runs_cpu_loops(source: str) -> bool:
    """Whether a C++ file holds loops over the logits or the tokens: the row loops (common/row_pass_cpu.h) or an
    at::parallel_for of its own (the sampler's row sweep, the per-token policy loss)."""
    with open(source) as f:
        text = f.read()
    return "common/row_pass_cpu.h" in text or "at::parallel_for" in text


UNITY = os.path.join(os.environ.get("RL_LOSSES_BUILD_BASE") or "build", "unity")
UNITY_GLUE = os.path.join(UNITY, "glue.cpp")
UNITY_LOOPS = os.path.join(UNITY, "loops.cpp")


def write_unity(path: str, files: list[str]) -> str:
    """A translation unit of #include lines, rewritten only when the list changes; ninja's dependency files see
    edits to the files it includes. The files keep their own names for what they define inside anonymous
    namespaces, so no two of one unit may define the same one (GCC says which)."""
    text = "".join(f'#include "{os.path.relpath(s, "csrc")}"\n' for s in files)
    if not os.path.exists(path) or open(path).read() != text:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return path


def unity_sources(cpp: list[str]) -> list[str]:
    """The C++ files compiled in three kinds of translation units. Each unit paid about 1.6 s of CPU to load the
    precompiled header and instantiate the templates it leaves pending (more on a busy machine), whatever its size.
    - The files without CPU loops (argument checks, ATen calls, registration: "glue"): one unit, UNITY_GLUE. They
      instantiate mostly the same ATen templates: 22 files took about 100 CPU-s apart and 17 s together at -O1
      (docs/performance.md, "Installing and building").
    - The files with loops of their own but no row pass (element-wise loops over tokens or rows: the per-token
      policy loss, the sampler's floors, the kept set's scatter), each a few seconds of code: one unit,
      UNITY_LOOPS, at -O3 with the precompiled header like every file with loops: 3 files took 17.5 CPU-s apart,
      7.6 together (benchmarks/results/cpu-2026-11-27-build-tus.txt).
    - The files with the row loops (common/row_pass_cpu.h), 10-20 CPU-s of code each: one unit each, so that the
      build's two jobs share them evenly."""
    glue = [s for s in cpp if not runs_cpu_loops(s)]
    rows = [s for s in cpp if s not in glue and "common/row_pass_cpu.h" in open(s).read()]
    loops = [s for s in cpp if s not in glue and s not in rows]
    return rows + [write_unity(UNITY_GLUE, glue), write_unity(UNITY_LOOPS, loops)]


sources = unity_sources(sources)
# py_limited_api=True below defines Py_LIMITED_API.
define_macros = [("RL_LOSSES_CPU_NARROWEST", str(CPU_WIDTHS.index(narrowest))),
                 ("RL_LOSSES_CPU_WIDEST", str(CPU_WIDTHS.index(widest)))]
# No -std flag: torch.utils.cpp_extension picks the standard its headers need (C++17 or C++20).
# The std::string ABI must match torch's: a mismatch only shows when an error message crosses into libc10
# (every TORCH_CHECK failure then crashed the process instead of raising). Recent torch no longer passes it.
abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
# -fopenmp: at::parallel_for is a header template compiled into this library; without OpenMP its pragma is
# ignored and the CPU kernels run on one thread. It also honours the `omp simd` marks on the CPU row loops.
# -fno-trapping-math (as torch itself is built): lets GCC vectorise the polynomial exp in those loops.
# -g0: no debug info (Python's own CFLAGS ask for -g): it lengthens every compile and the wheel has no use for it.
extra = {"cxx": ["-O3", "-g0", "-fopenmp", "-fno-trapping-math", abi]}
include_dirs = [os.path.join(ROOT, "csrc")]
if use_cuda:
    sources += sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True))
    # --threads: nvcc generates the code of a file's architectures (the wheel's four) in parallel, not one after
    # the other; the longest file (grpo_cuda.cu) otherwise holds the whole build for its four passes.
    extra["nvcc"] = ["-O3", abi, "--expt-relaxed-constexpr", "-lineinfo", "-Xptxas=-warn-spills", "--threads=4"]
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

def ninja_escape(path: str) -> str:
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def edit_ninja_file(write_ninja_file, pch_flags: list[str]):
    """torch's ninja writer, with the precompiled header (PrecompiledHeaderBuild) made a build step of its own and the
    glue (UNITY_GLUE) compiled without it. The header is compiled by torch's own compile rule, with the flags
    it gives every C++ file but the -include of the header itself, and every other C++ object waits for it; ninja
    rebuilds it when its command or a header it includes changes. The glue includes torch/autograd.h, most of the
    header's parse again, and took as long with the header as without (30.4 CPU-s without, 33.9 with, at -O1 and a
    load average of 6 on 2 cores): left out of it, it compiles on the second core while the header is precompiled
    on the first, which the build used to leave idle for 28 s. In a CPU-only build the glue also compiles at -O1 instead of -O3: it checks arguments,
    calls ATen and registers the ops, and -O3 made it slower to compile (about half its time) for microseconds of
    host time that a CPU kernel's milliseconds hide; the files with loops keep -O3. (With CUDA its host time is a
    GPU call's critical path: docs/design.md.) A ninja variable bound under a build statement overrides the
    file's for that statement alone."""
    def write(**kwargs):
        write_ninja_file(**kwargs)
        glue = {obj for src, obj in zip(kwargs["sources"], kwargs["objects"])
                if os.path.abspath(src) == os.path.abspath(UNITY_GLUE)}
        with open(kwargs["path"]) as f:
            lines = f.read().splitlines()
        post = next(line for line in lines if line.startswith("post_cflags = "))[len("post_cflags = "):]
        header = pch_flags[1] if pch_flags else None
        if header:
            without = post.replace(" " + " ".join(pch_flags), "")
            assert without != post, f"the precompiled header's flags {pch_flags} are not in post_cflags: {post}"
            post = without
        glue_flags = post + (" -O1" if not use_cuda else "")
        out = []
        for line in lines:
            target = line[len("build "):line.index(": compile ")].replace("$ ", " ") \
                if line.startswith("build ") and ": compile " in line else None
            if target in glue:
                out += [line, f"  post_cflags = {glue_flags}"]
            elif target and header:
                out.append(f"{line} | {ninja_escape(header)}.gch")
            else:
                out.append(line)
        if header:
            out += [f"build {ninja_escape(header)}.gch: compile {ninja_escape(header)}",
                    "  cflags = $cflags -x c++-header", f"  post_cflags = {post}"]
        with open(kwargs["path"], "w") as f:
            f.write("\n".join(out) + "\n")
    return write


class PrecompiledHeaderBuild(BuildExtension.with_options(use_ninja=True)):
    """torch's ninja build, with the torch headers of csrc/common/precompiled.h precompiled once (GCC) and
    force-included into every C++ file but the glue (not the .cu files): a step of the ninja file
    (edit_ninja_file), compiled with the very flags torch's compile rule gives the C++ files. GCC checks them
    (-Winvalid-pch says where it cannot use the header, and the file then parses the headers itself), so a mismatch
    costs time, never correctness. Without a GNU compiler it is skipped.
    """

    def build_extension(self, ext):
        compile_objects = self.compiler.compile  # torch's ninja wrapper, installed by build_extensions
        write_ninja_file = cpp_extension._write_ninja_file

        def compile_with_pch(sources, output_dir=None, macros=None, include_dirs=None, debug=0, extra_preargs=None,
                             extra_postargs=None, depends=None):
            flags = self.precompiled_header(extra_postargs)
            if flags:
                extra_postargs = dict(extra_postargs, cxx=extra_postargs["cxx"] + flags)
            cpp_extension._write_ninja_file = edit_ninja_file(write_ninja_file, flags)
            return compile_objects(sources, output_dir, macros, include_dirs, debug, extra_preargs, extra_postargs,
                                   depends)

        self.compiler.compile = compile_with_pch
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = compile_objects
            cpp_extension._write_ninja_file = write_ninja_file

    def precompiled_header(self, extra_postargs) -> list[str]:
        """Writes the header that edit_ninja_file's step precompiles; returns the flags that use it ([] where it
        cannot: no GNU compiler, whose precompiled-header format this is)."""
        cxx = os.environ.get("CXX", "c++")  # the compiler torch's ninja file compiles C++ with
        if not isinstance(extra_postargs, dict) or "cxx" not in extra_postargs or sys.platform != "linux":
            return []
        try:
            version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        if "Free Software Foundation" not in version:
            return []
        header = os.path.join(os.path.abspath(self.build_temp), "pch", "rl_losses_pch.h")
        text = '#include "common/precompiled.h"\n'
        if not os.path.exists(header) or open(header).read() != text:  # rewritten only if changed: ninja sees its time
            os.makedirs(os.path.dirname(header), exist_ok=True)
            with open(header, "w") as f:
                f.write(text)
        return ["-include", header, "-Winvalid-pch"]


ext = Ext(
    name="rl_losses._C",
    sources=sources,
    # setuptools skips the whole extension when no source is newer than the library; listing the headers makes
    # a header change reach ninja, which then recompiles only the files that include it.
    depends=sorted(glob.glob(os.path.join("csrc", "**", "*.h"), recursive=True)
                   + glob.glob(os.path.join("csrc", "**", "*.cuh"), recursive=True)),
    include_dirs=include_dirs,
    extra_compile_args=extra,
    extra_link_args=["-fopenmp"],
    define_macros=define_macros,
    py_limited_api=True,
)

# The library links against this torch's C++ API, whose ABI changes between minor versions (docs/design.md,
# "Prebuilt wheels"): a wheel requires the torch minor it was built with.
torch_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])

setup(
    install_requires=[f"torch=={torch_minor}.*", "numpy"],
    packages=find_packages("python"),
    package_dir={"": "python"},
    # py.typed: the package's annotations are meant for type checkers (PEP 561); _C.pyi types the library module.
    package_data={"rl_losses": ["py.typed", "_C.pyi"]},
    ext_modules=[ext],
    cmdclass={"build_ext": PrecompiledHeaderBuild},
    # One wheel for every CPython >= 3.10: the module uses only the limited C API (torch's build defines
    # Py_LIMITED_API=0x030A0000 for py_limited_api extensions).
    options={"bdist_wheel": {"py_limited_api": "cp310"},
             # RL_LOSSES_BUILD_BASE: a build folder other than build/ (scripts/build_wheel.sh: one per variant).
             **({"build": {"build_base": os.environ["RL_LOSSES_BUILD_BASE"]}}
                if os.environ.get("RL_LOSSES_BUILD_BASE") else {})},
)
