"""Builds libattnkit.so with CMake and puts it inside the Python package
(attnkit/lib/libattnkit.so), where attnkit/_library.py looks first.

    python3 -m venv --system-site-packages .venv
    .venv/bin/pip install --no-build-isolation .       # or -e . for development

Environment:
    ATTNKIT_PREBUILT_LIBRARY  use this libattnkit.so instead of building one
    ATTNKIT_CMAKE_BUILD_DIR   CMake build directory (default: build-python/ in the source tree)
    ATTNKIT_CMAKE_ARGS        extra CMake arguments, e.g. -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
    ATTNKIT_JOBS              parallel build jobs (default: all cores)
The library runs on any x86-64-v2 CPU, whatever machine builds it: its kernels
are compiled once per ISA level (baseline, avx2, avx512, amx) and the best
level the running CPU has is picked at the first kernel call (attnkit.isa()
names it). On an older CPU, `import attnkit` fails saying which level is
missing.
"""
import os
import pathlib
import re
import shlex
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = pathlib.Path(__file__).resolve().parent


def version():
    text = (ROOT / "CMakeLists.txt").read_text()
    return re.search(r"project\(attnkit VERSION ([0-9.]+)", text).group(1)


def build_library():
    """The path of a libattnkit.so: the prebuilt one, or one CMake builds now."""
    prebuilt = os.environ.get("ATTNKIT_PREBUILT_LIBRARY")
    if prebuilt:
        path = pathlib.Path(prebuilt).resolve()
        if not path.is_file():
            raise SystemExit(f"attnkit setup: ATTNKIT_PREBUILT_LIBRARY={prebuilt} is not a file")
        return path
    build = pathlib.Path(os.environ.get("ATTNKIT_CMAKE_BUILD_DIR", ROOT / "build-python"))
    configure = ["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 "-DATTNKIT_BUILD_TESTS=OFF", "-DATTNKIT_BUILD_BENCH=OFF", "-DATTNKIT_BUILD_EXPERIMENTS=OFF",
                 *shlex.split(os.environ.get("ATTNKIT_CMAKE_ARGS", ""))]
    jobs = os.environ.get("ATTNKIT_JOBS", str(os.cpu_count() or 1))
    for command in (configure, ["cmake", "--build", str(build), "--target", "attnkit", "--parallel", jobs]):
        print("attnkit setup:", " ".join(command), flush=True)
        subprocess.run(command, check=True)
    return (build / "libattnkit.so").resolve()


class BuildPy(build_py):
    """build_py plus the library. An editable install (pip install -e) keeps
    the package in the source tree, so the library goes there."""

    def run(self):
        super().run()
        library = build_library()
        if getattr(self, "editable_mode", False):
            target = ROOT / "python" / "attnkit" / "lib"
        else:
            target = pathlib.Path(self.build_lib) / "attnkit" / "lib"
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(library, target / "libattnkit.so")


class BinaryDistribution(Distribution):
    """The wheel holds a compiled library: platform-specific, not pure Python."""

    def has_ext_modules(self):
        return True


# setuptools builds in build/ by default, which is the CMake build tree of scripts/build.
setup(version=version(), cmdclass={"build_py": BuildPy}, distclass=BinaryDistribution,
      options={"build": {"build_base": "build-python/setuptools"}})
