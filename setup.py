"""Build mmreuse's native parts, against the torch already installed (no build isolation):

    pip install --no-build-isolation -e '.[test]'

- `mmreuse._C`: the torch ops (`torch.ops.mmreuse.*`, csrc/*.cpp) with CPU kernels everywhere,
  plus the CUDA kernels (csrc/cuda/*.cu) only with a CUDA torch, nvcc and an arch to build for
  (TORCH_CUDA_ARCH_LIST, or a visible GPU). MMREUSE_CUDA=0/1 overrides that choice.
- `mmreuse._index`: the block-hash tables of BlockIndex and RemoteKVIndex (plain CPython C++,
  no torch, always built: `import mmreuse.events` must not load libtorch).
- `mmreuse._jsonscan`: the proxy's one pass over a request body before it is decoded (plain
  CPython C++, no torch, always built).
- `mmreuse._hashcore`: the hashing fast path (plain CPython C++; needs OpenSSL headers).
  MMREUSE_HASHCORE=0 skips it (the pure-Python reference path is then used).

MMREUSE_DEBUG=1 builds every extension with -O0 -g (no -O3) and -DMMREUSE_DEBUG, which turns on
the MMREUSE_DCHECK bound checks (hashcore's output buffers); rebuild without it for release.

Without torch in the build environment, `mmreuse._C` is skipped (a proxy node's torch-free
install: hashing, demand, plan, the live view); `mmreuse.residency` then needs a rebuild with
torch installed (`pip install torch==2.13.0`, then this command again).
"""

import os
from pathlib import Path

from setuptools import Extension, setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:  # the torch-free core
    torch = None

ROOT = Path(__file__).parent


# plain CPython extensions, not in _C
_PLAIN_SOURCES = ("hashcore.cpp", "index_table.cpp", "json_scan.cpp")


def _opt_flags() -> list[str]:
    """Every extension's optimization flags: -O3, or with MMREUSE_DEBUG=1 -O0 -g and DCHECKs."""
    if os.environ.get("MMREUSE_DEBUG", "0") == "1":
        return ["-O0", "-g", "-DMMREUSE_DEBUG=1"]
    return ["-O3"]


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
    sources = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "csrc").glob("*.cpp")
        if p.name not in _PLAIN_SOURCES
    )
    # No -std flags: BuildExtension picks the one the installed torch needs (C++17 / C++20).
    extra = {"cxx": _opt_flags()}
    if use_cuda:
        sources += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cuda").glob("*.cu"))
        extra["nvcc"] = _opt_flags()
    ext = CUDAExtension if use_cuda else CppExtension
    print(f"mmreuse: building mmreuse._C with {'CPU and CUDA' if use_cuda else 'CPU'} kernels")
    return ext("mmreuse._C", sources, include_dirs=[str(ROOT / "csrc")], extra_compile_args=extra)


def _index_extension():
    return Extension(
        "mmreuse._index",
        ["csrc/index_table.cpp"],
        extra_compile_args=[*_opt_flags(), "-std=c++17"],
        language="c++",
    )


def _jsonscan_extension():
    return Extension(
        "mmreuse._jsonscan",
        ["csrc/json_scan.cpp"],
        extra_compile_args=[*_opt_flags(), "-std=c++17"],
        language="c++",
    )


def _hashcore_extension():
    if os.environ.get("MMREUSE_HASHCORE", "auto") == "0":
        return []
    inc = os.environ.get("OPENSSL_INCLUDE_DIR", "/usr/include")
    if not (Path(inc) / "openssl" / "sha.h").exists():
        print(
            "mmreuse: OpenSSL headers not found (apt-get install libssl-dev); "
            "building without the hashing fast path"
        )
        return []
    return [
        Extension(
            "mmreuse._hashcore",
            ["csrc/hashcore.cpp"],
            include_dirs=[str(ROOT / "csrc")],
            libraries=["crypto"],
            extra_compile_args=[*_opt_flags(), "-std=c++17"],
            language="c++",
        )
    ]


if torch is None:
    print("mmreuse: torch not installed; building without mmreuse._C (residency ops)")
setup(
    ext_modules=[
        *([] if torch is None else [_torch_extension()]),
        _index_extension(),
        _jsonscan_extension(),
        *_hashcore_extension(),
    ],
    cmdclass={} if torch is None else {"build_ext": BuildExtension},
)
