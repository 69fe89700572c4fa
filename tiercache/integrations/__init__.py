"""Adapters between inference frameworks and tiercache.

Each adapter lives in its own module and imports its framework only when that module is
imported, so `import tiercache` never needs an optional framework installed:

- `tiercache.integrations.transformers`: Hugging Face transformers hybrid caches
  (`pip install 'tiercache[transformers]'`).
"""
