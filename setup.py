"""Build mmreuse's native parts, against the torch already installed (no build isolation):

    pip install --no-build-isolation -e '.[test]'

- `mmreuse._C`: the torch ops (`torch.ops.mmreuse.*`, csrc/*.cpp) with CPU kernels everywhere,
  plus the CUDA kernels (csrc/cuda/*.cu) only with a CUDA torch, nvcc and an arch to build for
  (TORCH_CUDA_ARCH_LIST, or a visible GPU). MMREUSE_CUDA=0/1 overrides that choice.
- `mmreuse._hashcore`: the hashing fast path (plain CPython C++; needs OpenSSL headers).
  MMREUSE_HASHCORE=0 skips it (the pure-Python reference path is then used).
"""

import os
from pathlib import Path

import torch
from setuptools import Extension, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = Path(__file__).parent


def _want_cuda() -> bool:
    mode = os.environ.get("MMREUSE_CUDA", "auto")
    if mode in ("0", "1"):
        return mode == "1"
    # CUDA_HOME is always None under a CPU torch, whatever the environment says.
    has_toolkit = torch.version.cuda is not None and CUDA_HOME is not None
    has_arch = torch.cuda.is_available() or bool(os.environ.get("TORCH_CUDA_ARCH_LIST"))
    return has_toolkit and has_arch


def _torch_extension():
    use_cuda = _want_cuda()
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp")
                     if p.name != "hashcore.cpp")
    # No -std flags: BuildExtension picks the one the installed torch needs (C++17 / C++20).
    extra = {"cxx": ["-O3"]}
    if use_cuda:
        sources += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cuda").glob("*.cu"))
        extra["nvcc"] = ["-O3"]
    ext = CUDAExtension if use_cuda else CppExtension
    print(f"mmreuse: building mmreuse._C with {'CPU and CUDA' if use_cuda else 'CPU'} kernels")
    return ext("mmreuse._C", sources, include_dirs=[str(ROOT / "csrc")], extra_compile_args=extra)


def _hashcore_extension():
    if os.environ.get("MMREUSE_HASHCORE", "auto") == "0":
        return []
    inc = os.environ.get("OPENSSL_INCLUDE_DIR", "/usr/include")
    if not (Path(inc) / "openssl" / "sha.h").exists():
        print("mmreuse: OpenSSL headers not found (apt-get install libssl-dev); "
              "building without the hashing fast path")
        return []
    return [Extension(
        "mmreuse._hashcore",
        ["csrc/hashcore.cpp"],
        include_dirs=[str(ROOT / "csrc")],
        libraries=["crypto"],
        extra_compile_args=["-O3", "-std=c++17"],
        language="c++",
    )]


setup(
    ext_modules=[_torch_extension(), *_hashcore_extension()],
    cmdclass={"build_ext": BuildExtension},
)
