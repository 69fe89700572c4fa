"""tiercache: KV pages and recurrent-state checkpoints of hybrid attention/SSM models,
cached across device, host, disk and remote tiers (DESIGN.md; the layers: README.md).

`__version__` is the one place the version is written: pyproject.toml reads it, and
`tiercache --version`, the daemon's startup line and `tiercache_build_info` show it."""

__version__ = "0.1.0"
