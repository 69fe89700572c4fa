# Sourced by the GPU scripts: a GPU machine may have no network and no virtual
# environment. Wheels brought along in .whl (make wheels) go to /tmp/tiercache-site.
# The daemon's package is service/, imported as tiercache_service (pyproject.toml's
# package-dir): a link in that folder names it so without installing the project.
mkdir -p /tmp/tiercache-site
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/tiercache-site .whl/*.whl || exit 1
fi
ln -sfn "$PWD/service" /tmp/tiercache-site/tiercache_service
# the package's C modules (setup.py's extensions), built in this tree for this Python by
# gcc itself: `setup.py build_ext` needs a setuptools new enough for pyproject's metadata
for module in _keymap _index _rows _spin _lane _chain; do
  python3 -c 'import subprocess, sys, sysconfig as s; subprocess.run(["gcc", "-O2", "-shared",
    "-fPIC", "-I" + s.get_paths()["include"], f"tiercache/{sys.argv[1]}.c", "-o",
    f"tiercache/{sys.argv[1]}" + s.get_config_var("EXT_SUFFIX")], check=True)' $module || exit 1
done
export PYTHONPATH="/tmp/tiercache-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no GPU here'" || exit 1
