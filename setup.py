"""The C part of the package (tiercache/_keymap.c: the key map's probing loops and the
repeat check of a request's keys; tiercache/_index.c: the index's per-entry loops of a
load; tiercache/_rows.c: the check of a request's rows, row copies on the CPU;
tiercache/_spin.c: a CPU kept out of idle for the daemon; tiercache/_lane.c: the words
a worker's lane of calls is published and waited on by; tiercache/_chain.c: a prompt's
chained page keys, with xxHash's header in tiercache/vendor); everything else is in
pyproject.toml. `pip install .` (or -e .) builds it; in a source tree without an install,
`python setup.py build_ext --inplace` does (scripts/gpu-env.sh calls gcc itself: a GPU
image's setuptools may be too old for pyproject's metadata)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tiercache._keymap", ["tiercache/_keymap.c"]),
                   Extension("tiercache._index", ["tiercache/_index.c"]),
                   Extension("tiercache._rows", ["tiercache/_rows.c"]),
                   Extension("tiercache._spin", ["tiercache/_spin.c"]),
                   Extension("tiercache._lane", ["tiercache/_lane.c"]),
                   Extension("tiercache._chain", ["tiercache/_chain.c"], depends=["tiercache/vendor/xxhash.h"])])
