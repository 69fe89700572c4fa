# Everything a fresh machine needs: `make serve` runs the daemon, `make test` the tests.
# The virtual environment is built on first use. TORCH pins torch; TORCH_INDEX is where
# it comes from: PyTorch's CPU index on a machine without a GPU (no nvidia-smi), unless
# pip is configured with an index or a wheel directory of its own (that machine chose
# where packages come from); otherwise pip's default, PyPI's CUDA build. Override it:
# `make env TORCH_INDEX=URL`, or `TORCH_INDEX=` for pip's default.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || $(PYTHON) -m pip config list 2>/dev/null \
  | grep -qE '\.(index-url|find-links)=' || echo $(TORCH_CPU_INDEX))
PIP_TORCH = "$(TORCH)"$(if $(strip $(TORCH_INDEX)), --index-url $(strip $(TORCH_INDEX)))
EXTRAS ?= dev,transformers
PROTO := proto/tiercache/v1/tiercache.proto
PROTOC = $(PY) -m grpc_tools.protoc -Iproto --python_out=$(1) --grpc_python_out=$(1) --pyi_out=$(1) $(PROTO)

# The vLLM connector's tests need vLLM, whose pins (transformers<5.20) clash with the
# transformers extra: they get a virtual environment of their own. vLLM 0.32.0 pins
# torch==2.13.0, which the CPU build satisfies; it also pulls torchvision, torchaudio and
# torchcodec, which do not import beside the CPU torch, so they go again.
VLLM_VENV ?= .venv-vllm
VLLM ?= vllm==0.32.0
PYV := $(VLLM_VENV)/bin/python

.PHONY: env serve test test-vllm demo proto proto-check test-gpu bench-gpu wheels clean

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py tiercache/_keymap.c tiercache/_index.c tiercache/_rows.c tiercache/_spin.c tiercache/_lane.c tiercache/_chain.c tiercache/vendor/xxhash.h
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(PIP_TORCH)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

serve: env  ## the daemon with defaults: ./tiercache-data, 1 GiB of host memory
	$(VENV)/bin/tiercache serve $(ARGS)

test: env  ## quiet, as pyproject's addopts say; ends with the "N passed" line (CI reads it)
	$(PY) -m pytest

$(VLLM_VENV)/.installed: pyproject.toml setup.py tiercache/_keymap.c tiercache/_index.c tiercache/_rows.c tiercache/_spin.c tiercache/_lane.c tiercache/_chain.c tiercache/vendor/xxhash.h
	$(PYTHON) -m venv $(VLLM_VENV)
	$(PYV) -m pip install -q --upgrade pip
	$(PYV) -m pip install -q $(PIP_TORCH)
	$(PYV) -m pip install -q "$(VLLM)"
	$(PYV) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PYV) -m pip install -q -e ".[dev]"
	$(PYV) -c "import vllm, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

test-vllm: $(VLLM_VENV)/.installed  ## the vLLM connector against vLLM's real scheduler (CPU)
	$(PYV) -m pytest tests/tiercache/integrations/vllm tests/service/test_groups.py

demo: env  ## a daemon and two workers in shared-prefix conversations
	$(PY) examples/demo.py

proto: env  ## regenerate tiercache/v1 from the .proto
	$(call PROTOC,.)

proto-check: env  ## fail if tiercache/v1 is stale
	@tmp=$$(mktemp -d) && $(call PROTOC,$$tmp) && for f in tiercache_pb2.py tiercache_pb2.pyi tiercache_pb2_grpc.py; do \
	  cmp -s $$tmp/tiercache/v1/$$f tiercache/v1/$$f || { echo "tiercache/v1/$$f is stale: run make proto"; exit 1; }; done

test-gpu:  ## on a GPU machine: GPU tests, then the whole suite (no network needed, see wheels)
	bash scripts/test-gpu.sh

bench-gpu:  ## on a GPU machine: benchmarks.gpu_transfer and checkpoint_copy (BENCHES="..." for others, BENCH_ARGS="..." to them; tables also to $$OUT)
	bash scripts/bench-gpu.sh

WHEELS := lmdb==3.0.0 protobuf==7.36.2 grpcio==1.85.1 grpcio-health-checking==1.85.1 \
  grpcio-reflection==1.85.1 prometheus-client==0.26.0 pyyaml==6.0.3 \
  hypothesis==6.170.15 sortedcontainers==2.4.0 redis==8.1.0 hiredis==3.5.0 pyzmq==27.3.0 \
  msgpack==1.2.4 msgspec==0.22.0 fla-core==0.6.0 flash-linear-attention==0.6.0
wheels:  ## what a GPU machine without network needs beside its torch, into .whl (Python 3.12)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
	  -d .whl $(WHEELS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
