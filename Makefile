# Two commands do all set-up on a fresh clone:
#   make run    venv + install, then prepare -> SFT -> eval -> RL -> eval on the tiny CPU default
#   make test   venv + install, then the test suite (what CI runs via .ci/run)
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXP ?= reverse_text
OUT := outputs/$(EXP)
# this machine's pip config prints one harmless warning per package about a missing local mirror
QUIET_PIP := grep -v -E "is ignored: it is neither a file nor a directory" || true

.PHONY: install run test clean

install: $(VENV)/.installed

# docker/install.sh is the one install recipe: the Dockerfile's stages run it too, so every CI run
# exercises the images' install steps. Target dev: the CPU build of torch first (an unpinned install would
# pull a multi-GB CUDA build; off this machine set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu),
# then asyncrl[dev], editable. Then, where npm exists, the devcontainer CLI for tests/static.
$(VENV)/.installed: pyproject.toml docker/install.sh
	$(PYTHON) -m venv $(VENV)
	PYTHON=$(BIN)/python ASYNCRL_EDITABLE=1 PIP_QUIET=1 docker/install.sh dev 2>&1 | $(QUIET_PIP)
	if command -v npm >/dev/null; then npm install --silent --no-audit --no-fund --prefix $(VENV)/node @devcontainers/cli@0.89.0; fi
	touch $@

run: install
	$(BIN)/asyncrl prepare experiment=$(EXP)
	$(BIN)/asyncrl sft experiment=$(EXP)
	$(BIN)/asyncrl eval experiment=$(EXP) model.name=$(OUT)/sft/model eval.out_dir=$(OUT)/eval_sft
	$(BIN)/asyncrl rl experiment=$(EXP) model.name=$(OUT)/sft/model launcher.overwrite=true
	$(BIN)/asyncrl eval experiment=$(EXP) model.name=$(OUT)/rl/model eval.out_dir=$(OUT)/eval_rl
	$(BIN)/python -m asyncrl.evals.compare $(OUT)/eval_sft $(OUT)/eval_rl

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf outputs
