# engram-store: two commands on a fresh machine.
#   make run    create .venv, make a small synthetic V4.1 table set if none, start the daemon
#   make test   create .venv, run the test suite
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch comes from the local wheel mirror; on GPU hosts set TORCH_REQ= to keep your CUDA torch.
TORCH_REQ ?= torch==2.13.0
MODEL ?= deepseek-v4.1-flash
SCALE ?= 0.001
TABLES ?= data/tables-$(MODEL)-$(SCALE)
DRAM_BYTES ?= 1GiB
RUN_DIR ?= data/run
PYTEST_ARGS ?=
# The vLLM plugin's tests run vLLM's own Engram code: vLLM 0.33.0 without its dependency tree (it pins a
# CUDA torch) plus the few packages its Engram module imports. VLLM=0 skips them (they then report skipped).
VLLM ?= 1
VLLM_REQ ?= vllm==0.33.0
# The SGLang plugin's tests run SGLang's own Engram code in a venv of their own (SGLANG_VENV; its pins must not
# change vLLM's): SGLang 0.5.23 without its dependency tree plus what its Engram modules import. SGLANG=0 skips.
SGLANG ?= 1
SGLANG_REQ ?= sglang==0.5.23
SGLANG_VENV ?= .venv-sglang

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-installed
SGLANG_STAMP := $(SGLANG_VENV)/.installed
NATIVE_STAMP := $(VENV)/.native-built
NATIVE_SOURCES := $(wildcard engram_store/*/*.c engram_store/*/*.h) setup.py

.PHONY: run test venv tables bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(if $(TORCH_REQ),$(BIN)/pip install --quiet "$(TORCH_REQ)")
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

$(VLLM_STAMP): tests/vllm-requirements.txt | $(STAMP)
	$(BIN)/pip install --quiet --no-deps "$(VLLM_REQ)"
	$(BIN)/pip install --quiet --no-deps -r tests/vllm-requirements.txt
	touch $@

# An edited C file is rebuilt before anything runs (pip install -e builds the extensions in place).
$(NATIVE_STAMP): $(NATIVE_SOURCES) | $(STAMP)
	$(BIN)/pip install --quiet --no-deps -e .
	touch $@

# Without TORCH_REQ (GPU hosts) the SGLang venv sees the host's torch through --system-site-packages.
$(SGLANG_STAMP): pyproject.toml tests/sglang-requirements.txt
	$(PYTHON) -m venv $(if $(TORCH_REQ),,--system-site-packages) $(SGLANG_VENV)
	echo '*' > $(SGLANG_VENV)/.gitignore  # git ignores the venv (as Python 3.13's venv does by itself)
	$(if $(TORCH_REQ),$(SGLANG_VENV)/bin/pip install --quiet "$(TORCH_REQ)")
	$(SGLANG_VENV)/bin/pip install --quiet -e .
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps "$(SGLANG_REQ)" -r tests/sglang-requirements.txt
	touch $@

tables: $(TABLES)/manifest.json

$(TABLES)/manifest.json: | $(STAMP) $(NATIVE_STAMP)
	$(BIN)/engram-store synth --model $(MODEL) --scale $(SCALE) --seed 0 --out $(TABLES)

# gRPC clients authenticate with the token in $(RUN_DIR)/grpc.token (made once, mode 0600).
run: $(STAMP) $(NATIVE_STAMP) tables
	mkdir -p $(RUN_DIR)
	test -s $(RUN_DIR)/grpc.token || (umask 077 && $(BIN)/python -c "import secrets; print(secrets.token_hex(32))" \
		> $(RUN_DIR)/grpc.token)
	$(BIN)/engram-store serve --tables $(TABLES) --dram-bytes $(DRAM_BYTES) \
		--socket $(RUN_DIR)/engram-store.sock --grpc 127.0.0.1:0 --grpc-token-file $(RUN_DIR)/grpc.token \
		--metrics 127.0.0.1:0 --ready-file $(RUN_DIR)/ready.json

test: $(STAMP) $(NATIVE_STAMP) $(if $(filter 1,$(VLLM)),$(VLLM_STAMP)) $(if $(filter 1,$(SGLANG)),$(SGLANG_STAMP))
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/import_throughput.py

clean:
	rm -rf $(VENV) $(SGLANG_VENV) data
