# `pip install .` from the repository root: the same build as
# `pip install ./python` (python/setup.py, python/pyproject.toml;
# docs/python.md).
import os
import runpy

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "python", "setup.py"), run_name="__main__")
