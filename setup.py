"""Build of mla_ext._C.

C++ CPU kernels are always built. CUDA kernels are added when torch is a CUDA
build and a CUDA toolkit (nvcc + headers) is found, for TORCH_CUDA_ARCH_LIST
(default "8.0;8.6;8.9;9.0a": SASS for A100, A10/RTX 30xx, L4/L40S/RTX 40xx, H100/H200)
plus PTX for MLA_EXT_CUDA_PTX (default "9.0", empty for none) so that newer GPUs
(Blackwell sm_100/sm_120) JIT-compile the kernels from it. MLA_EXT_CUDA=0 forces a CPU-only build (fast iteration),
MLA_EXT_CUDA=1 makes a missing toolkit an error instead of a fallback.
"""
import glob
import os
import re
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.0;8.6;8.9;9.0a"
DEFAULT_PTX = "9.0"


def _toolkit_root():
    """The CUDA toolkit root, or None.

    The `nvcc` on PATH may be a wrapper script (it is on the build machines),
    which makes torch's own guess land one level too high; look through it.
    """
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.environ["CUDA_HOME"])
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = os.path.realpath(nvcc)
        try:
            with open(real, "rb") as f:
                head = f.read(4096)
            if head.startswith(b"#!"):
                m = re.search(rb"exec\s+(\S+/bin/nvcc)", head)
                if m:
                    real = m.group(1).decode()
        except OSError:
            pass
        candidates.append(os.path.dirname(os.path.dirname(real)))
    candidates += ["/usr/local/cuda"]
    for root in candidates:
        if os.path.exists(os.path.join(root, "include", "cuda_runtime_api.h")) and os.path.exists(
            os.path.join(root, "bin", "nvcc")
        ):
            return root
    return None


def _want_cuda(torch):
    mode = os.environ.get("MLA_EXT_CUDA", "auto").lower()
    if mode in ("0", "off", "false", "no"):
        return False, "disabled by MLA_EXT_CUDA=0"
    reasons = []
    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} is a CPU-only build")
    root = _toolkit_root()
    if root is None:
        reasons.append("no CUDA toolkit found (nvcc + include/cuda_runtime_api.h)")
    if reasons:
        if mode in ("1", "on", "true", "yes"):
            sys.exit("MLA_EXT_CUDA=1 but CUDA cannot be built: " + "; ".join(reasons))
        return False, "; ".join(reasons)
    os.environ["CUDA_HOME"] = root
    return True, root


def _gencode_flags(archs: str, ptx: str) -> list[str]:
    """nvcc -gencode flags: one SASS binary per arch-list entry ("X.Y", "X.Ya",
    "X.Y+PTX"), plus plain PTX for `ptx`. Built here rather than by torch because
    torch would add none of its own once any arch flag is given, and it has no
    way to say "SASS for 9.0a but PTX for compute_90" (compute_90a PTX runs on
    sm_90 only, which is no help to a newer GPU)."""
    flags = []
    for entry in (a.strip() for a in archs.replace(",", ";").split(";")):
        if not entry:
            continue
        num = entry.replace("+PTX", "").replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if entry.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    if ptx:
        num = ptx.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def _extensions():
    import torch

    # Decide (and export CUDA_HOME) before torch.utils.cpp_extension is
    # imported: it reads CUDA_HOME once, at import time.
    use_cuda, why = _want_cuda(torch)
    from torch.utils import cpp_extension

    print(f"[mla_ext] CUDA kernels: {'yes, toolkit ' + why if use_cuda else 'no (' + why + ')'}")

    # The schema file, each stage's torch binding (*_ops.cpp) and the torch-free CPU kernels (*_cpu.cpp).
    cpu_sources = ["csrc/registration.cpp"] + sorted(
        glob.glob("csrc/**/*_ops.cpp", recursive=True) + glob.glob("csrc/**/*_cpu.cpp", recursive=True))
    cxx = ["-O3", "-std=c++20", "-g0", "-fopenmp", "-Wno-unused-function"]
    include_dirs = [os.path.join(ROOT, "csrc")]
    if not use_cuda:
        return [
            cpp_extension.CppExtension(
                "mla_ext._C",
                cpu_sources,
                include_dirs=include_dirs,
                extra_compile_args={"cxx": cxx},
                extra_link_args=["-fopenmp"],
            )
        ]

    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCHS
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    ptx = os.environ.get("MLA_EXT_CUDA_PTX", DEFAULT_PTX)
    cuda_sources = sorted(glob.glob("csrc/**/*.cu", recursive=True))
    # Kernels and bindings need no cuBLAS/nvrtc headers (bindings use c10/cuda
    # only), so the pip wheels' include dir, which shadows the toolkit's
    # cuda_runtime.h, is deliberately not added.
    defines = [
        "-DMLA_EXT_WITH_CUDA",
        f'-DMLA_EXT_CUDA_ARCH_LIST="{archs}"',
        f'-DMLA_EXT_CUDA_PTX="{ptx}"',
    ]
    nvcc = [
        "-O3",
        "-std=c++20",
        "--expt-relaxed-constexpr",
        "-lineinfo",
        # torch disables the half/bf16 operators for its own reasons; kernels
        # here use intrinsics anyway but should not be forced to.
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__",
    ] + defines + _gencode_flags(archs, ptx)
    return [
        cpp_extension.CUDAExtension(
            "mla_ext._C",
            cpu_sources + cuda_sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx + defines, "nvcc": nvcc},
            extra_link_args=["-fopenmp"],
        )
    ]


def _cmdclass():
    from torch.utils import cpp_extension

    return {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


setup(
    name="mla_ext",
    version="0.1.0",
    description="MLA prefill-with-context kernels (paged latent cache, kv_b_proj, chunked attention)",
    packages=find_packages(include=["mla_ext", "mla_ext.*"]),
    # Measured dispatch tables (one JSON per device) travel with the package.
    package_data={"mla_ext": ["dispatch_tables/*.json", "dispatch_tables/README.md"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "numpy"],
    # vLLM loads general plugins in every process; mla_ext's registers the
    # MLA_EXT prefill backend and changes nothing unless it is selected
    # (mla_ext/vllm/plugin.py). SGLang loads sglang.srt.plugins likewise; mla_ext's
    # hooks nothing unless MLA_EXT_SGLANG=1 or SGLANG_PLUGINS names it
    # (mla_ext/sglang/plugin.py).
    # On vLLM CPU the platform plugin makes vLLM's CPU platform honour MLA_EXT (and
    # is vLLM's CpuPlatform unchanged otherwise: mla_ext/vllm/cpu_platform.py).
    entry_points={"vllm.general_plugins": ["mla_ext = mla_ext.vllm.plugin:register"],
                  "vllm.platform_plugins": ["mla_ext = mla_ext.vllm.plugin:cpu_platform"],
                  "sglang.srt.plugins": ["mla_ext = mla_ext.sglang.plugin:register"]},
    ext_modules=_extensions(),
    cmdclass=_cmdclass(),
    zip_safe=False,
)
