"""The C part of the package (the key map's probing loops); everything else is in
pyproject.toml. `pip install .` (or -e .) builds it; in a source tree without an
install, `python setup.py build_ext --inplace` does (scripts/gpu-env.sh calls gcc itself:
a GPU image's setuptools may be too old for pyproject's metadata)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tiercache._keymap", ["tiercache/_keymap.c"])])
