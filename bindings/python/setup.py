"""Builds the compiled modules of `oomguard` with the project's CMake.

`pip install --no-build-isolation bindings/python` configures the repository
(two directories up, or OOMGUARD_SOURCE_DIR) with OOMGUARD_BUILD_PYTHON=ON and
builds the target `oomguard_python`, then packages the modules it put under
<build>/python/oomguard. With OOMGUARD_PREBUILT_DIR=<an existing build dir>
it packages that build's modules instead of building again.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = pathlib.Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str, optional: bool = False) -> None:
        super().__init__(name, sources=[], optional=optional)


class CMakeBuild(build_ext):
    _built: pathlib.Path | None = None

    def _package_dir(self) -> pathlib.Path:
        if CMakeBuild._built is not None:
            return CMakeBuild._built
        prebuilt = os.environ.get("OOMGUARD_PREBUILT_DIR")
        if prebuilt:
            build = pathlib.Path(prebuilt).resolve()
        else:
            source = pathlib.Path(os.environ.get("OOMGUARD_SOURCE_DIR", HERE.parents[1])).resolve()
            if not (source / "include" / "oomguard" / "guard.h").exists():
                raise RuntimeError(f"oomguard sources not found at {source} (set OOMGUARD_SOURCE_DIR)")
            build = pathlib.Path(self.build_temp).resolve() / "cmake"
            subprocess.check_call([
                "cmake", "-S", str(source), "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}",
                "-DCMAKE_BUILD_TYPE=Release", "-DOOMGUARD_BUILD_PYTHON=ON", "-DOOMGUARD_BUILD_TESTS=OFF",
                "-DOOMGUARD_BUILD_EXAMPLES=OFF", "-DOOMGUARD_BUILD_BENCH=OFF"])
            jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
            subprocess.check_call(["cmake", "--build", str(build), "--target", "oomguard_python", "-j", jobs])
        pkg = build / "python" / "oomguard"
        if not pkg.is_dir():
            raise RuntimeError(f"{pkg} does not exist: was {build} configured with OOMGUARD_BUILD_PYTHON=ON?")
        CMakeBuild._built = pkg
        return pkg

    def build_extension(self, ext: Extension) -> None:
        stem = ext.name.rsplit(".", 1)[-1]
        candidates = sorted(self._package_dir().glob(f"{stem}.*.so")) or sorted(self._package_dir().glob(f"{stem}.so"))
        if not candidates:
            if ext.optional:
                print(f"oomguard: {stem} was not built (optional), skipping", file=sys.stderr)
                return
            raise RuntimeError(f"{stem} not found in {self._package_dir()}")
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(candidates[0], target)


setup(
    ext_modules=[CMakeExtension("oomguard._oomguard"), CMakeExtension("oomguard._budget", optional=True)],
    cmdclass={"build_ext": CMakeBuild},
)
