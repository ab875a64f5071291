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

# The CPU build of torch first: an unpinned install would pull a multi-GB CUDA build.
# (Off this machine, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.)
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U "pip>=25" 2>&1 | $(QUIET_PIP)
	$(BIN)/python -m pip install -q "torch==2.13.0" 2>&1 | $(QUIET_PIP)
	$(BIN)/python -m pip install -q -e ".[dev]" 2>&1 | $(QUIET_PIP)
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
