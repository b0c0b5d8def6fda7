"""The gtopk wheel (python/setup.py, python/pyproject.toml), as a Python user
installs it, offline:

* `pip wheel --no-build-isolation --no-deps ./python` with Debian's
  python3-setuptools and python3-wheel makes gtopk-<__version__>-cpXY-cpXY-
  linux_*.whl holding the modules of python/gtopk and the extension;
* `pip install` of it into a fresh `venv --system-site-packages` imports
  there (gtopk.__version__, gtopk._gtopk, gtopk.torch with Debian's
  python3-torch) from the venv, not from the build tree;
* the python-worker image's install (deploy/docker/Dockerfile: pip install
  --no-index --no-deps --break-system-packages as root), under a --root,
  puts the package in a folder on /usr/bin/python3's default sys.path.

The CMake build: setup.py configures and builds a folder of its own,
<GTOPK_BUILD_DIR>/packaging-cmake (tests, benchmarks and CUDA off, -O0:
OPT_ARGS below; kept between runs, compiled through ccache), as `pip
install ./python` does: about 30 s cold on 2 idle cores (ccache off),
seconds after that.
GTOPK_PACKAGING_REUSE=1 reuses the build folder GTOPK_BUILD_DIR itself
(setup.py's GTOPK_BUILD_DIR: only the target gtopk_python, no configure).

Run: GTOPK_BUILD_DIR=build /usr/bin/python3 tests/python/packaging_test.py
(ctest -L packaging). Needs python3-pip, python3-venv, python3-setuptools,
python3-wheel (make deps).
"""

import fnmatch
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import unittest
import zipfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir,
                                    os.pardir))
# The packaging folder's optimisation: -O0 (a Debug build without -g).
# What this test checks (the wheel's name and files, the installs, the
# imports) does not depend on it, and on CI (no ccache) -O0 compiles the
# libraries and the extension in 47 CPU-seconds instead of Release's 62.
# GTOPK_PACKAGING_RELEASE=1: setup.py's default, Release.
OPT_ARGS = [] if os.environ.get("GTOPK_PACKAGING_RELEASE") == "1" else [
    "-DCMAKE_BUILD_TYPE=Debug", "-DCMAKE_CXX_FLAGS_DEBUG=-O0"]
BUILD_DIR = os.path.abspath(os.environ.get("GTOPK_BUILD_DIR") or
                            os.path.join(ROOT, "build"))
REUSE = os.environ.get("GTOPK_PACKAGING_REUSE") == "1"
PYTHON = sys.executable


def source_version():
    with open(os.path.join(ROOT, "python", "gtopk", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def clean_env(**extra):
    """The environment without what points imports at the build tree or
    changes pip's behaviour."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV",
                        "GTOPK_BUILD_DIR", "VIRTUAL_ENV")}
    env.update(extra)
    return env


def run(cmd, timeout=900, **kw):
    t0 = time.time()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=timeout, **kw)
    print("packaging_test: %.1f s: %s" % (time.time() - t0, " ".join(cmd)),
          flush=True)
    if r.returncode != 0:
        raise AssertionError("exit %d: %s\n%s" % (
            r.returncode, " ".join(cmd), r.stdout[-8000:]))
    return r.stdout


class PackagingTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        for mod in ("pip", "venv", "setuptools", "wheel"):
            r = subprocess.run([PYTHON, "-c", "import " + mod],
                               capture_output=True)
            if r.returncode != 0:
                raise AssertionError(
                    "%s cannot import %s: install python3-pip python3-venv "
                    "python3-setuptools python3-wheel (make deps)" % (
                        PYTHON, mod))
        cls.tmp = tempfile.mkdtemp(prefix="gtopk-packaging-")
        # A copy of python/'s packaging files and modules, so that pip's
        # in-tree build (build/, gtopk.egg-info) writes there and not into
        # the checkout; GTOPK_SOURCE_DIR points setup.py at the sources.
        src = os.path.join(cls.tmp, "python")
        os.makedirs(os.path.join(src, "gtopk"))
        for name in ("setup.py", "pyproject.toml"):
            shutil.copy(os.path.join(ROOT, "python", name), src)
        for py in glob.glob(os.path.join(ROOT, "python", "gtopk", "*.py")):
            shutil.copy(py, os.path.join(src, "gtopk"))
        env = clean_env(GTOPK_SOURCE_DIR=ROOT)
        if REUSE:
            if not os.path.exists(os.path.join(BUILD_DIR, "CMakeCache.txt")):
                raise AssertionError("%s is not a configured build folder "
                                     "(GTOPK_PACKAGING_REUSE=1)" % BUILD_DIR)
            env["GTOPK_BUILD_DIR"] = BUILD_DIR
        else:
            # A folder of its own, configured by setup.py every run (CMake
            # options given); tests, benchmarks and CUDA off: the quickest
            # full build.
            env["GTOPK_BUILD_DIR"] = os.path.join(BUILD_DIR, "packaging-cmake")
            env["GTOPK_CMAKE_ARGS"] = " ".join(["-DGTOPK_CUDA=OFF"] + OPT_ARGS)
        cls.dist = os.path.join(cls.tmp, "dist")
        t0 = time.time()
        run([PYTHON, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
             "--no-index", "-w", cls.dist, src], env=env, cwd=cls.tmp)
        cls.wheel_seconds = time.time() - t0
        wheels = glob.glob(os.path.join(cls.dist, "*.whl"))
        if len(wheels) != 1:
            raise AssertionError("pip wheel made %s" % wheels)
        cls.wheel = wheels[0]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_wheel_name_and_contents(self):
        version = source_version()
        tag = "cp%d%d" % sys.version_info[:2]
        self.assertRegex(os.path.basename(self.wheel),
                         r"^gtopk-%s-%s-%s-linux_\w+\.whl$" % (
                             re.escape(version), tag, tag))
        names = zipfile.ZipFile(self.wheel).namelist()
        ext = "gtopk/_gtopk" + sysconfig.get_config_var("EXT_SUFFIX")
        self.assertIn(ext, names)
        for py in glob.glob(os.path.join(ROOT, "python", "gtopk", "*.py")):
            self.assertIn("gtopk/" + os.path.basename(py), names)
        self.assertIn("gtopk-%s.dist-info/METADATA" % version, names)
        print("packaging_test: wheel %s (%d bytes) in %.1f s" % (
            os.path.basename(self.wheel), os.path.getsize(self.wheel),
            self.wheel_seconds), flush=True)

    def test_installs_into_a_venv(self):
        venv = os.path.join(self.tmp, "venv")
        run([PYTHON, "-m", "venv", "--system-site-packages", venv],
            env=clean_env())
        vpy = os.path.join(venv, "bin", "python")
        run([vpy, "-m", "pip", "install", "--no-index", "--no-deps",
             self.wheel], env=clean_env())
        out = run([vpy, "-c",
                   "import gtopk, gtopk._gtopk, gtopk.torch, torch; "
                   "print(gtopk.__version__); print(gtopk.__file__); "
                   "print(gtopk._gtopk.__file__); "
                   "print(callable(gtopk.torch.DistributedOptimizer))"],
                  env=clean_env(), cwd=self.tmp)
        version, init, ext, opt = out.split()[-4:]
        self.assertEqual(version, source_version())
        prefix = os.path.realpath(venv) + os.sep
        self.assertTrue(os.path.realpath(init).startswith(prefix), init)
        self.assertTrue(os.path.realpath(ext).startswith(prefix), ext)
        self.assertEqual(opt, "True")

    def test_image_install_lands_on_the_default_sys_path(self):
        """deploy/docker/Dockerfile's python-worker installs the wheel as
        root with this pip command; under a --root here."""
        with open(os.path.join(ROOT, "deploy", "docker", "Dockerfile")) as f:
            text = re.sub(r"\\\n", " ", f.read())
        m = re.search(r"python3 -m pip install ((?:--\S+ +)+)", text)
        self.assertTrue(m, "the Dockerfile installs the wheel with pip")
        flags = m.group(1).split()
        for flag in ("--no-index", "--no-deps", "--break-system-packages"):
            self.assertIn(flag, flags)
        root = os.path.join(self.tmp, "root")
        run([PYTHON, "-m", "pip", "install", "--root", root] + flags +
            [self.wheel], env=clean_env())
        inits = glob.glob(os.path.join(root, "**", "gtopk", "__init__.py"),
                          recursive=True)
        self.assertEqual(len(inits), 1, inits)
        site = os.path.dirname(os.path.dirname(inits[0]))
        in_image = "/" + os.path.relpath(site, root)
        out = run([PYTHON, "-c", "import json, sys; print(json.dumps("
                   "sys.path))"], env=clean_env(), cwd=self.tmp)
        self.assertIn('"%s"' % in_image, out)
        globs = re.findall(r"compileall -q (\S+)", text)
        self.assertTrue(globs)
        self.assertTrue(fnmatch.fnmatch(in_image + "/gtopk", globs[0]),
                        (in_image, globs))
        out = run([PYTHON, "-c", "import gtopk, gtopk._gtopk; "
                   "print(gtopk.__file__)"],
                  env=clean_env(PYTHONPATH=site), cwd=self.tmp)
        self.assertEqual(out.split()[-1], inits[0])


if __name__ == "__main__":
    unittest.main(verbosity=2)
