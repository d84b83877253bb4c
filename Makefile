# One entry point for everything: `make` lists the targets.
# `make train` and `make test` do their own set-up (a .venv with pinned packages, the pinned CDK CLI).
SHELL := /bin/bash
.DEFAULT_GOAL := help

# The first Python every pin has wheels for (tools/pip_install.py: 3.11, 3.12).
PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
CDK    := node_modules/.bin/cdk
export JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION := 1
export CDK_DISABLE_CLI_TELEMETRY := true

# Training knobs (override on the command line: `make train NPROC=4 STEPS=500 FAULTS=...`).
TARGET  ?= local
RECIPE  ?= debug_cpu
NPROC   ?= 2
RUN     ?= local
RESTART ?= none
FAULTS  ?=
STEPS   ?=
ARGS    ?=
OVERLAY ?= smoke
DATA    := data/stdlib

.PHONY: moto-venv help setup train test test-fast lint format clean synth diff deploy gpu-nodes destroy alert-test bench report planner data eks-status eks-logs eks-stop eks-preflight gpu-check gpu-wheels

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

# --- set-up ---------------------------------------------------------------------------------
# What a user's machine needs, command by command: docs/requirements.md.
# The stamp is rebuilt only when the project or the lock changes, so repeated runs are quick.
# tools/pip_install.py owns the install commands (tests/test_setup_install.py runs the same):
# the lock's CPU torch alone from PyTorch's CPU index (or a wheel on disk offline), then the
# rest from the ordinary index. The venv's own pip is used as it comes (no upgrade: offline that
# would retry for minutes). The check runs with the Python that will install: the venv's, if any.
$(VENV)/.stamp: pyproject.toml requirements.lock tools/pip_install.py
	@test -n "$(PYTHON)" || { echo "error: no python3 found: install Python 3.11 or 3.12" >&2; exit 2; }
	@$$(test -x $(PY) && echo $(PY) || echo $(PYTHON)) tools/pip_install.py --check
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); echo "error: $(PYTHON) -m venv failed: on Debian/Ubuntu, apt-get install python3-venv (or python3.X-venv)" >&2; exit 2; }
	$(PY) tools/pip_install.py -q
	@touch $@

# The CDK CLI (make synth/deploy) and aws-cdk-lib's jsii runtime (tests/infra) run on Node.js,
# package.json's engines: >= 20. Without it `make train` is unaffected, `make test` skips tests/infra.
NODE_MIN := $(shell sed -n 's/.*"node": *">= *\([0-9]*\)".*/\1/p' package.json)
NODE_MAJOR = $(shell node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
node_modules/.stamp: package.json package-lock.json
	@if [ "$(NODE_MAJOR)" -lt $(NODE_MIN) ] || ! command -v npm >/dev/null; then \
	  echo "note: no Node.js >= $(NODE_MIN) with npm: the CDK CLI is not installed and tests/infra skip (install Node.js $(NODE_MIN)+: https://nodejs.org/en/download)" >&2; \
	else npm ci --no-audit --no-fund --loglevel=error && touch $@; fi

setup: $(VENV)/.stamp node_modules/.stamp ## Create .venv with pinned packages and install the pinned CDK CLI

lock: ## Re-pin every Python package into requirements.lock (after changing pyproject.toml)
	$(PY) -m pip install -q -e '.[train,infra,dev]'
	$(PY) -m pip freeze --exclude-editable | grep -v '^-e ' > requirements.lock

# The EC2 stand-in for the node fencer's tests (podsim/ec2.py): moto in server mode, in a
# venv of its own (botocore pins python-dateutil<3; the project's kubernetes client needs >=3).
moto-venv: .venv-moto/bin/moto_server ## The EC2 stand-in the node-fencer tests use (moto server)
.venv-moto/bin/moto_server:
	$(PYTHON) -m venv .venv-moto
	.venv-moto/bin/pip install -q 'moto[server]==5.2.6' 'boto3==1.44.18'

# --- training -------------------------------------------------------------------------------
$(DATA)/meta.json: | $(VENV)/.stamp
	$(PY) -m training prepare --stdlib --out $(DATA)

data: $(VENV)/.stamp $(DATA)/meta.json ## Build the local corpus (Python's standard library source, tokenized)

train: $(VENV)/.stamp ## Train: locally on CPU ranks (default) or on EKS with TARGET=eks
ifeq ($(TARGET),eks)
	$(PY) -m training.launch.eks submit --overlay $(OVERLAY) --follow \
	  $(if $(filter-out none,$(RESTART)),--restart $(RESTART)) $(ARGS)
else
	@$(MAKE) --no-print-directory $(DATA)/meta.json
	$(PY) -m training.launch.local --nproc $(NPROC) --recipe $(RECIPE) --run-dir runs/$(RUN) \
	  --restart $(RESTART) $(if $(FAULTS),--faults '$(FAULTS)') $(if $(STEPS),--train.steps=$(STEPS)) $(ARGS)
endif

eks-preflight: $(VENV)/.stamp ## All-reduce check across the overlay's GPU nodes (EFA); names a slow node
	$(PY) -m manifests.preflight --overlay $(OVERLAY) $(ARGS)

eks-status: $(VENV)/.stamp ## Show the EKS training job's pods, restarts and completion
	$(PY) -m training.launch.eks status --overlay $(OVERLAY) $(if $(GROUP),--group $(GROUP))

eks-logs: $(VENV)/.stamp ## Stream rank 0's log of the EKS training job
	$(PY) -m training.launch.eks logs --overlay $(OVERLAY) $(if $(GROUP),--group $(GROUP))

eks-stop: $(VENV)/.stamp ## Delete the EKS training job (never the data on FSx)
	$(PY) -m training.launch.eks stop --overlay $(OVERLAY)

report: $(VENV)/.stamp ## Redraw a run's timeline and summary: make report RUN=local
	$(PY) -m training.runlog.report runs/$(RUN)

planner: $(VENV)/.stamp ## Goodput planner: mode, interval, spares, FSx per size (ARGS="--full", "--sanity"; writes docs/planner.png; docs/planner.md)
	$(PY) -m planner $(ARGS)

bench: $(VENV)/.stamp data ## Run every benchmark side by side and print the tables
	$(PY) -m bench.run_all $(ARGS)

# --- infrastructure -------------------------------------------------------------------------
STACK := EksFsdpResilient
# The deployed stack is the one source of deploy state: every synth reads its template and the
# settings it was deployed with back through the AWS CLI (infra/deployed.py, app.py) and keeps
# what ARGS does not change, from any clone. Without credentials synth and diff say so in one
# line; deploy (deployCheck=required) refuses.
synth: setup ## Synthesize the CloudFormation templates (keeps the deployed stack's settings; offline: says it could not check)
	$(CDK) synth --no-notices --no-lookups --no-version-reporting --quiet $(ARGS)

diff: setup ## What the next deploy replaces, removes, updates and keeps, against the deployed stack
	$(CDK) synth --no-notices --no-lookups --no-version-reporting --quiet $(ARGS)

deploy: setup ## Deploy the stacks (needs AWS credentials); writes cdk-outputs.json
	$(CDK) deploy --all --no-notices --outputs-file cdk-outputs.json -c deployCheck=required $(ARGS)

gpu-nodes: $(VENV)/.stamp ## GPU nodes for an overlay (its nodes + hot spares): make gpu-nodes OVERLAY=2node, or NODES=2
	@[[ -z "$(NODES)" || "$(NODES)" =~ ^[0-9]+$$ ]] || { echo "NODES: give the GPU node count (make gpu-nodes NODES=2) or an overlay (make gpu-nodes OVERLAY=2node: its nodes + hot spares)" >&2; exit 2; }
	$(MAKE) --no-print-directory deploy ARGS='$(if $(NODES),-c gpuNodesDesired=$(NODES),-c overlay=$(OVERLAY)) $(ARGS)'

alert-test: $(VENV)/.stamp ## Send a test alert through the deployed alert manager to the SNS topic and say whether it arrived (AWS credentials; reads the deployed stack's outputs)
	$(PY) -m infra.alert_probe $(ARGS)

destroy: setup ## Tear the stacks down, images included; prints what it keeps (FSx with its network) and how to delete it
	$(CDK) destroy --all --no-notices -c deployCheck=destroy $(ARGS)
	@cat cdk.out/retained.txt 2>/dev/null || true

# --- quality --------------------------------------------------------------------------------
lint: $(VENV)/.stamp ## ruff lint + format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.stamp ## Apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# TEST_WORKERS=N runs independent tests side by side on N pytest-xdist processes (tests that share
# a machine-wide resource carry an xdist_group, tests/conftest.py). Default 0 (one process): on
# 2 cores two workers once took 52 min against 50-58 serial, and timing-bound tests
# failed under it; on 2026-12-07 a fresh clone's `make test TEST_WORKERS=2` passed once in 22.0
# min against 30.1 serial. The default moves when two workers pass repeatedly.
TEST_WORKERS ?= 0
PYTEST_WORKERS = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

test: setup lint moto-venv ## Run the whole test suite (CPU; GPU tests are skipped without a GPU; <= 20 min on 2 cores)
	$(VENV)/bin/pytest $(PYTEST_WORKERS) $(ARGS)

# --- the lent GPU machine (docs/gpu.md) ---------------------------------------------------------
# It is offline, with its own python3 and torch: gpu-check builds no .venv there. What it lacks
# travels as wheels in .whl/ (fetched here by gpu-wheels, at the versions requirements.lock pins)
# and tests/gpu_check.py --wheels installs them apart (pip --no-index --target, then PYTHONPATH),
# as the device tool's README prescribes; without make there: python3 tests/gpu_check.py --wheels .whl
GPU_PYTHON ?= python3
GPU_PYVER  ?= 3.12
GPU_SITE   ?= /tmp/gpu-check-site
WHEEL_DIR  ?= .whl
GPU_WHEELS := nvidia-resiliency-ext isal defusedxml

gpu-wheels: ## Fetch the wheels the lent GPU machine lacks into .whl/ (carry .whl there)
	rm -rf $(WHEEL_DIR) && mkdir -p $(WHEEL_DIR)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYVER) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
	  --platform manylinux_2_31_x86_64 -d $(WHEEL_DIR) \
	  $$(grep -iE '^($(subst $(eval) ,|,$(GPU_WHEELS)))==' requirements.lock)
	@ls $(WHEEL_DIR)

gpu-check: ## On the lent GPU machine, offline: the carried wheels + the device check, one JSON report (<= 8 min)
	$(GPU_PYTHON) tests/gpu_check.py --wheels $(WHEEL_DIR) --site $(GPU_SITE) $(ARGS)

# The edit loop: leaves out the tests marked `distributed` (real torch.distributed process groups,
# emulated pods: the restart layers, fault matrices, checkpoint tiers across ranks) and `slow`
# (> ~30 s each: in their files, and tests/conftest.py SLOW); `make test` runs them all.
test-fast: setup ## The edit loop (< 5 min): the suite less its distributed and slow tests
	$(VENV)/bin/pytest $(PYTEST_WORKERS) -m "not slow and not distributed" $(ARGS)

clean: ## Remove build outputs and local runs (keeps .venv; `make distclean` removes it too)
	rm -rf cdk.out runs .pytest_cache .ruff_cache
	find . -name __pycache__ -not -path './.venv/*' -not -path './node_modules/*' -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) .venv-moto node_modules data
