"""Build mmreuse's native parts: the hashing fast path (`mmreuse._hashcore`).

Build against the torch already installed, without build isolation:
    pip install --no-build-isolation -e '.[test]'
"""

import os
from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).parent


def _has_openssl_headers() -> bool:
    inc = os.environ.get("OPENSSL_INCLUDE_DIR", "/usr/include")
    return (Path(inc) / "openssl" / "sha.h").exists()


def _extensions():
    exts = []
    if os.environ.get("MMREUSE_HASHCORE", "auto") != "0" and _has_openssl_headers():
        exts.append(
            Extension(
                "mmreuse._hashcore",
                ["csrc/hashcore.cpp"],
                include_dirs=[str(ROOT / "csrc")],
                libraries=["crypto"],
                extra_compile_args=["-O3", "-std=c++17"],
                language="c++",
            )
        )
    else:
        print("mmreuse: OpenSSL headers not found (apt-get install libssl-dev); "
              "building without the hashing fast path")
    return exts


setup(ext_modules=_extensions())
