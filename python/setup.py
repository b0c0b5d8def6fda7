"""Build the gtopk wheel: the extension gtopk._gtopk through the repository's
CMake build, the pure modules from python/gtopk/ (docs/python.md). No
package index needed:

    /usr/bin/python3 -m pip wheel --no-build-isolation --no-deps -w dist ./python
    /usr/bin/python3 -m pip install --no-build-isolation ./python   # + PEP 668 option

The extension is built for the interpreter that runs this (sys.executable),
in the CMake build folder GTOPK_BUILD_DIR when set, else in
python/build/cmake-<python tag> (kept, so a second build is incremental).

Environment:
  GTOPK_BUILD_DIR    an existing CMake build folder of this repository to
                     build the target gtopk_python in (it must have been
                     configured with GTOPK_PYTHON on for this interpreter);
                     it is configured again only when CMAKE_ARGS or
                     GTOPK_CMAKE_ARGS are given or it has no CMakeCache.txt.
  CMAKE_ARGS, GTOPK_CMAKE_ARGS
                     extra CMake options (shell words), e.g.
                     GTOPK_CMAKE_ARGS="-DGTOPK_CUDA=OFF -DGTOPK_WERROR=ON".
                     CMAKE_BUILD_TYPE defaults to Release, GTOPK_CUDA to the
                     project's AUTO (the CUDA step when nvcc is found).
  CMAKE_BUILD_PARALLEL_LEVEL (or JOBS)
                     compile jobs (default: the number of cores).
  CMAKE_GENERATOR    default Ninja when ninja is installed.
  GTOPK_STRIP=0      keep the extension's symbols (default: stripped).
  GTOPK_SOURCE_DIR   the repository root (default: this file's parent).
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.environ.get("GTOPK_SOURCE_DIR") or
                       os.path.join(HERE, os.pardir))


def read_version():
    """__version__ of python/gtopk/__init__.py, read (importing it needs the
    extension)."""
    with open(os.path.join(HERE, "gtopk", "__init__.py")) as f:
        m = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', f.read(),
                      re.M)
    if not m:
        raise RuntimeError("no __version__ in python/gtopk/__init__.py")
    return m.group(1)


def cmake_args_from_env():
    args = []
    for var in ("CMAKE_ARGS", "GTOPK_CMAKE_ARGS"):
        args += shlex.split(os.environ.get(var, ""))
    return args


class CMakeBuild(build_ext):
    """Builds gtopk._gtopk with CMake (target gtopk_python) and copies it
    where setuptools puts extensions."""

    def build_extension(self, ext):
        if not os.path.exists(os.path.join(ROOT, "CMakeLists.txt")) or \
                not os.path.exists(os.path.join(ROOT, "python", "_gtopk.cc")):
            raise RuntimeError(
                "gtopk: the repository is not at %s (CMakeLists.txt, "
                "python/_gtopk.cc): build the wheel from a checkout "
                "(pip wheel ./python, python3 -m build --wheel python), "
                "not from an sdist, or set GTOPK_SOURCE_DIR" % ROOT)
        cmake = shutil.which("cmake")
        if not cmake:
            raise RuntimeError("gtopk: cmake not found (Debian: make deps)")
        extra = cmake_args_from_env()
        build_dir = os.environ.get("GTOPK_BUILD_DIR")
        if build_dir:
            build_dir = os.path.abspath(build_dir)
            configure = bool(extra) or not os.path.exists(
                os.path.join(build_dir, "CMakeCache.txt"))
        else:
            tag = "cp%d%d" % sys.version_info[:2]
            build_dir = os.path.join(HERE, "build", "cmake-" + tag)
            configure = True
        if configure:
            cmd = [cmake, "-S", ROOT, "-B", build_dir]
            if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
                if "CMAKE_GENERATOR" not in os.environ and \
                        shutil.which("ninja"):
                    cmd += ["-G", "Ninja"]
                cmd += ["-DCMAKE_BUILD_TYPE=Release",
                        "-DGTOPK_BUILD_TESTS=OFF", "-DGTOPK_BUILD_BENCH=OFF"]
            # The interpreter running this build (a venv's python is fine:
            # same headers and extension suffix as its base).
            cmd += ["-DGTOPK_PYTHON=ON",
                    "-DPython_EXECUTABLE=" + sys.executable] + extra
            self.announce("gtopk: " + " ".join(map(shlex.quote, cmd)), 2)
            subprocess.check_call(cmd)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or \
            os.environ.get("JOBS") or str(os.cpu_count() or 1)
        cmd = [cmake, "--build", build_dir, "--target", "gtopk_python",
               "-j", jobs]
        self.announce("gtopk: " + " ".join(map(shlex.quote, cmd)), 2)
        subprocess.check_call(cmd)

        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        built = os.path.join(build_dir, "python", "gtopk", "_gtopk" + suffix)
        if not os.path.exists(built):
            found = os.listdir(os.path.join(build_dir, "python", "gtopk"))
            raise RuntimeError(
                "gtopk: %s has no _gtopk%s for %s (found: %s): that build "
                "folder is for another interpreter; unset GTOPK_BUILD_DIR or "
                "configure it with -DPython_EXECUTABLE=%s" % (
                    build_dir, suffix, sys.executable,
                    ", ".join(sorted(found)), sys.executable))
        dest = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copyfile(built, dest)
        if os.environ.get("GTOPK_STRIP", "1") != "0" and shutil.which("strip"):
            subprocess.check_call(["strip", "--strip-unneeded", dest])


setup(
    name="gtopk",
    version=read_version(),
    description="gTop-k sparsified data-parallel training: the worker client "
                "and gtopk.torch.DistributedOptimizer",
    license="See the repository",
    python_requires=">=3.8",
    # Paths relative to the folder pip runs this from: python/ itself, or
    # the repository root through ../setup.py.
    packages=["gtopk"],
    package_dir={"gtopk": os.path.relpath(os.path.join(HERE, "gtopk"))},
    ext_modules=[Extension("gtopk._gtopk", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
    options={"build": {"build_base": os.path.join(HERE, "build")},
             "egg_info": {"egg_base": os.path.relpath(HERE)}},
)
