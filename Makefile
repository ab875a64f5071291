# Two commands do all set-up on a fresh clone:
#   make run    venv + install, then the DVC pipeline (dvc.yaml: prepare -> SFT -> RL -> eval) on the tiny CPU
#               default, then the eval after SFT and after RL side by side; a second `make run` reruns nothing
#   make test   venv + install, then lint, format and type checks, then the test suite (what CI runs via .ci/run)
#   make relock       re-makes every DVC lock (root and experiments/*), printing which outs changed
#   make image-lock   re-resolves what each image installs (docker/locks/), after a pin changes
#   make image-test   builds the four images for real and runs the pipeline in them (not in CI; docs/containers.md)
#   make trainer-venv the trainer's own environment on a GPU host, .venv-trainer: flash-attn-4, no vLLM
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# the pipeline's output_dir (params.yaml), for the comparison printed at the end of `make run`
OUT := outputs/reverse_text
# this machine's pip config prints one harmless warning per package about a missing local mirror
QUIET_PIP := grep -v -E "is ignored: it is neither a file nor a directory" || true

WARM_UP := import asyncrl.inference.serve, asyncrl.orchestrator.orchestrate, asyncrl.trainer.loop, asyncrl.launcher.rl, \
	asyncrl.prepare, asyncrl.evals.eval, dvc.cli

.PHONY: install tokenizer lint run test relock image-lock image-test trainer-venv docs clean

install: $(VENV)/.warm $(VENV)/.node $(VENV)/.slurm tokenizer

# Qwen3's tokenizer, for the models of the GPU shapes (model.init.tokenizer=qwen3): llama.cpp's vocab-only file from
# llama-cpp-python's source archive on PyPI (76 MB, pinned by sha256), converted and checked once per machine into
# ~/.cache/asyncrl/tokenizers (asyncrl.models.qwen_tokenizer; ~15 s and the download); later installs find it there
# (0.1 s), and retry where it failed
tokenizer: $(VENV)/.installed
	{ $(BIN)/python -m asyncrl.models.qwen_tokenizer || \
	echo "could not write Qwen3's tokenizer: its tests will skip, or fail under CI=true"; } 2>&1 | $(QUIET_PIP)

# docker/install.sh is the one install recipe: the Dockerfile's stages run it too, so every CI run
# exercises the images' install steps. Target dev: the CPU build of torch first (an unpinned install would
# pull a multi-GB CUDA build; off this machine set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu),
# then asyncrl[dev], editable.
# pip compiles no bytecode here (PIP_COMPILE=no): Python writes it for a module the first time it is imported, and
# the suite and the pipeline import a fraction of the ~250 packages (the install's pip steps: 85 s -> 29 s of wall
# time on 2 cores).
$(VENV)/.installed: pyproject.toml docker/install.sh
	$(PYTHON) -m venv $(VENV)
	PYTHON=$(BIN)/python ASYNCRL_EDITABLE=1 PIP_QUIET=1 PIP_COMPILE=no docker/install.sh dev 2>&1 | $(QUIET_PIP)
	touch $@

# The warm-up import writes the bytecode of what the three processes import, so that a first run starts as fast as
# later ones even where PYTHONDONTWRITEBYTECODE is set (12 s, one core)
$(VENV)/.warm: $(VENV)/.installed
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -c "$(WARM_UP)"
	touch $@

# The test modules' imports (verifiers, openai, schemathesis, matplotlib... beyond the warm-up's) compiled by one
# process: each of the suite's 4 workers collects every test file, and on a fresh clone they would all compile the
# same modules at once (`pytest --collect-only -q` on a fresh clone's venv after the warm-up: 47.6 s of CPU, then
# 25.7 s; AMD EPYC, AVX2 only). Again only after an install.
$(VENV)/.collected: $(VENV)/.warm
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest --collect-only -q -p no:cacheprovider > $(VENV)/collect.log 2>&1 \
		|| { tail -30 $(VENV)/collect.log; exit 1; }
	touch $@

# where npm exists, the devcontainer CLI for tests/static
$(VENV)/.node: $(VENV)/.installed
	if command -v npm >/dev/null; then npm install --silent --no-audit --no-fund --prefix $(VENV)/node @devcontainers/cli@0.89.0; fi
	touch $@

# SLURM 22.05 (Debian 12) for tests/integration/test_slurm_cluster.py, which starts a real three-node cluster on this
# machine: 7 s to install, done only as root where apt-get exists (a CI machine, a container); elsewhere, or if it
# fails, that test skips and names the command (under CI=true it fails instead: tests/helpers/required.py)
SLURM_INSTALL := if [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null && ! command -v slurmctld >/dev/null; then \
	{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	slurmctld slurmd slurm-client; } >/dev/null 2>&1 || echo "could not install SLURM (apt-get): its test will skip, or fail under CI=true" >&2; fi
$(VENV)/.slurm: $(VENV)/.installed
	$(SLURM_INSTALL)
	touch $@

# DVC runs each stage's command (`asyncrl ...`) through the shell: the venv's bin/ goes first on PATH. The install's
# steps after pip run side by side, as under `make test`.
run: $(VENV)/.installed
	$(MAKE) --no-print-directory -j4 -Otarget install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/dvc repro
	$(BIN)/asyncrl compare $(OUT)/eval_sft $(OUT)/eval_rl

# Every lock again: `dvc repro -f` of dvc.yaml and of each experiments/*/dvc.yaml with a dvc.lock (the root
# ~7 min on 2 cores, all of them about an hour), printing per pipeline which outs' md5 changed; the root lock
# is copied to experiments/reverse_text/ (the default run's record). After a refactor (code moved, results
# the same, or a setting added at its default), `make relock CODE=1` instead: the root pipeline's forced rerun
# checks that its outs reproduce bit for bit, then the experiments' locks take their src/ deps' new hashes and
# their params' new keys without a rerun (it stops, and re-records nothing, if a root out or a recorded param
# changed). Both write every params.yaml as composed now first. tests/unit/test_dvc_deps.py says which src/
# files each stage must depend on (--fix writes them). experiments/relock.py does the work.
relock: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python experiments/relock.py $(if $(CODE),--code)

# What pip installs into each image, with the file it picks (wheel or sdist) for the image's Python
# (python3.12 here; LOCK_PYTHON=...) on Linux x86_64: docker/locks/*.txt, ~4 min an image. Run it when a pin
# in pyproject.toml or docker/install.sh changes; tests/static/test_image_locks.py fails until then, and
# when a locked sdist is not in docker/source-only.txt (the builder stages' list).
LOCK_PYTHON ?= python3.12
image-lock: install
	$(BIN)/python docker/lock.py cpu dev gpu trainer --python $(LOCK_PYTHON)

# flash-attn-4 without vLLM (docs/gpus.md); editable, as the launcher wants launcher.trainer_python on this checkout
trainer-venv:
	$(PYTHON) -m venv .venv-trainer
	PYTHON=.venv-trainer/bin/python ASYNCRL_EDITABLE=1 docker/install.sh trainer

# lint, format, types, the import contract (layers, no cycles: [tool.importlinter] in pyproject.toml), the
# code's shape (files <= 400 lines, functions <= 80, imports at the top) and no commit hashes or work-item
# numbers first: a finding fails in seconds, before the suite's minutes (the suite runs the last two again)
lint: $(VENV)/.installed
	$(BIN)/ruff check src tests benchmarks environments experiments
	$(BIN)/ruff format --check src tests benchmarks environments experiments
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python tests/static/test_code_shape.py
	$(BIN)/python tests/static/test_no_history.py

# the suite in 4 workers whatever the core count (each starts several processes of a GB or so at a time, and waits on
# them much of the time: on 2 cores 4 workers take 703 s, 3 take 768, 2 take 814-840; docs/testing.md): one test file
# per worker, so its module fixtures are built once; the ~250 processes it starts write bytecode once rather than
# compile their imports at every start where PYTHONDONTWRITEBYTECODE is set
# Lint runs beside the rest of the install (the warm-up then the collection, npm, SLURM, the tokenizer): after the
# pip steps each is mostly one core and some wait on the network; lint's mypy alone takes ~45 s of a core on a fresh
# clone (AMD EPYC, AVX2 only).
test: $(VENV)/.installed
	$(MAKE) --no-print-directory -j4 -Otarget lint install $(VENV)/.collected
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n 4 --dist loadfile --no-loadscope-reorder

docs: install ; $(BIN)/python -m asyncrl.config.reference  # docs/configuration-reference.md, from the schema

# Build the four images with buildah (no Docker engine needed; root) and run the pipeline in them: in the cpu
# image against the host's hashes, split between gpu and trainer as docker compose runs it (on the CPU).
# tests/container, ~14 min on 2 cores and ~30 GB of disk while the gpu images exist; not part of `make test`
image-test: install
	$(BIN)/python -m pytest -m container tests/container -q -s

clean:
	rm -rf outputs
