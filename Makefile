# The front door. Every target is one visible command; `make help` lists them.
#   make train                 train configs/default.yaml, then test the best checkpoint
#   make train ARGS="--trainer.max_epochs 3"
#   make train-ddp             the same with DDP: every GPU, or NPROC=2 CPU processes (gloo) without a GPU
#   make resume                continue the most recent run where it stopped, with the config it was started with
#   make test                  the whole test suite
#   make predict CKPT=runs/<run>/checkpoints/last.ckpt INPUT=images/
#   make export CKPT=runs/<run>/checkpoints/last.ckpt
#   make doctor                is this machine ready to train?
#   make sweep WORKERS=2       hyperparameter sweep (Optuna), trials = make train runs; best.yaml at the end
#   make prepare SOURCE=imagefolder ROOT=/data/pets OUTPUT=/data/pets-stream IMAGE_SIZE=64   litdata chunks for streaming
#   make tensorboard           watch the runs under runs/ in TensorBoard: http://127.0.0.1:6006/ (PORT=...)
# The environment: the active virtualenv or conda env if there is one, else ./.venv (created here).
# Packages are (re)installed only when pyproject.toml or constraints.txt changed.
# INSTALL=0 (make train INSTALL=0, ...) installs nothing: it checks that the environment satisfies pyproject.toml
# and lists what is missing, so a cluster's own conda env keeps its torch (scripts/check_env.py).

SHELL  := /bin/bash
PYTHON ?= python3
CONFIG ?= configs/default.yaml
ARGS   ?=
# train-ddp: processes per node (default: every GPU, or 2 CPU processes when nvidia-smi finds none) and nodes.
NPROC  ?= $(if $(shell nvidia-smi -L 2>/dev/null),auto,2)
NODES  ?= 1
# test: pytest-xdist worker processes, each taking whole test files (TEST_WORKERS=0: one process, as plain pytest).
# Three on 2 cores: a test waiting on its processes (a rendezvous, Lightning's 5 s poll, a server) idles a core.
TEST_WORKERS ?= 3
# sweep: the sweep file and worker processes on this machine.
SPACE   ?= configs/sweep/digits.yaml
WORKERS ?= 1
# prepare: the source (imagefolder, digits, cifar10, mnist, fashionmnist), its folder, where the chunks go (a
# directory or s3://bucket/prefix) and the training size (unset: native size).
SOURCE     ?= digits
ROOT       ?=
OUTPUT     ?= data/$(SOURCE)-stream
IMAGE_SIZE ?=
# tensorboard: the port it listens on, on 127.0.0.1 only (not reachable from other machines).
PORT   ?= 6006

ifdef VIRTUAL_ENV
ENV_DIR := $(VIRTUAL_ENV)
else ifdef CONDA_PREFIX
ENV_DIR := $(CONDA_PREFIX)
else
ENV_DIR := .venv
endif
PY    := $(ENV_DIR)/bin/python
STAMP := $(ENV_DIR)/.project-installed
INSTALL ?= 1
ifeq ($(INSTALL)$(wildcard $(PY)),0)  # INSTALL=0 without an env or ./.venv: the Python on PATH
PY := $(PYTHON)
endif

.PHONY: help install train train-ddp resume test lint format clean distclean lock predict export doctor bench bench-quick mutants tensorboard sweep prepare

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(PY):
	$(PYTHON) -m venv $(ENV_DIR)

# Bytecode is compiled at install time (pip's default): without .pyc files (PYTHONDONTWRITEBYTECODE set),
# importing torch + lightning compiles them at every start and takes about three times as long (~20 s
# instead of ~7 s on 2 CPU cores).
ifeq ($(INSTALL),0)
.PHONY: $(STAMP)
$(STAMP):
	$(PY) scripts/check_env.py
else
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install --quiet --constraint constraints.txt --editable ".[dev,export,report,sweep,stream]"
	@touch $(STAMP)
endif

install: $(STAMP)  ## create/refresh the environment

train: $(STAMP)  ## train $(CONFIG) (extra flags: ARGS="..."), then test the best checkpoint
	$(PY) -m project fit --config $(CONFIG) $(ARGS)

train-ddp: $(STAMP)  ## train with DDP on NPROC devices x NODES nodes (multi-node: see scripts/torchrun.sh)
	$(PY) -m project fit --config $(CONFIG) --config configs/ddp.yaml --trainer.devices $(NPROC) --trainer.num_nodes $(NODES) $(ARGS)

predict: $(STAMP)  ## classify INPUT=<image or folder> with CKPT=<checkpoint>; writes a CSV
	$(PY) -m project predict --ckpt_path "$(CKPT)" --input "$(INPUT)" $(ARGS)

export: $(STAMP)  ## export CKPT=<checkpoint> to ONNX + torch.export, checked against PyTorch
	$(PY) -m project export --ckpt_path "$(CKPT)" $(ARGS)

doctor: $(STAMP)  ## check the machine and the config before training (CONFIG, ARGS as for train)
	$(PY) -m project doctor --config $(CONFIG) $(ARGS)
tensorboard: $(STAMP)  ## TensorBoard on runs/ at http://127.0.0.1:6006/ (PORT=...): scalars, report, HPARAMS
	@echo "TensorBoard on runs/: http://127.0.0.1:$(PORT)/  (Ctrl-C stops it)"
	$(PY) -m tensorboard.main --logdir runs --host 127.0.0.1 --port $(PORT)
sweep: $(STAMP)  ## Optuna sweep of SPACE (configs/sweep/digits.yaml) in WORKERS processes; same command resumes (ARGS)
	$(PY) -m project sweep --space $(SPACE) --config $(CONFIG) --workers $(WORKERS) $(ARGS)

prepare: $(STAMP)  ## write SOURCE (ROOT=...) as litdata chunks at OUTPUT (dir or s3://), resized to IMAGE_SIZE; re-run safe
	$(PY) -m project prepare --source $(SOURCE) $(if $(ROOT),--root "$(ROOT)") --output_dir "$(OUTPUT)" $(if $(IMAGE_SIZE),--image_size $(IMAGE_SIZE)) $(ARGS)

resume: $(STAMP)  ## continue the most recent run as it was started (its config.yaml); ARGS are recorded changes
	$(PY) -m project fit $(if $(filter command line environment,$(origin CONFIG)),--config $(CONFIG)) --ckpt_path last $(ARGS)

test: $(STAMP)  ## run the test suite in TEST_WORKERS processes (extra pytest flags: ARGS="...")
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(ARGS)

mutants: $(STAMP)  ## plant each known bug (tests/mutants/*.patch) in a copy: its claims' tests must fail (ARGS: names, --list)
	$(PY) tests/tools/mutate.py $(ARGS)

bench: $(STAMP)  ## template vs hand-written loop, side by side (<= 10 min): runs/bench/bench.json + table
	$(PY) scripts/bench.py $(ARGS)

bench-quick: $(STAMP)  ## the same figures with 2 repeats and fewer sizes (<= 2 min)
	$(PY) scripts/bench.py --quick $(ARGS)

lint: $(STAMP)  ## ruff lint + format check
	$(PY) -m ruff check project tests scripts
	$(PY) -m ruff format --check project tests scripts

format: $(STAMP)  ## apply ruff fixes and formatting
	$(PY) -m ruff check --fix project tests scripts
	$(PY) -m ruff format project tests scripts

lock: $(STAMP)  ## re-pin constraints.txt from the current environment
	( echo '# Exact versions `make` installs (pip -c). Regenerate with `make lock` after changing pyproject.toml.'; \
	  $(PY) -m pip freeze --exclude-editable ) > constraints.txt

clean:  ## remove run outputs and caches (keeps the environment)
	rm -rf runs lightning_logs .pytest_cache .ruff_cache
	find . -name __pycache__ -not -path './.venv/*' -prune -exec rm -rf {} +

distclean: clean  ## also remove ./.venv
	rm -rf .venv
