# Three commands for a newcomer:
#   make book   build the book into _build/html from the notebooks' committed outputs (seconds)
#   make lab    open the notebooks in JupyterLab to run and change them
#   make test   ruff, the import layering (lint-imports), unit tests, every notebook re-executed
#               against its saved outputs (nbval), the book built with warnings as errors, and
#               the rendered pages checked in Chromium
# make book-exec builds the book re-executing every notebook whose code changed (minutes).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of PyTorch. Override for another build, e.g. make TORCH="torch==2.13.0 --index-url ..."
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
LAB_STAMP := $(VENV)/.lab-installed
BOOK_FLAGS := -W -n --keep-going
# The book's configuration with notebook execution off: pages render the committed outputs.
NOEXEC_CONFIG := .config-noexec.yml
# Jobs make test runs side by side (unit tests, notebooks, the book): two on two cores.
TEST_JOBS ?= 2
# Notebooks make notebooks checks side by side (NBVAL_JOBS=1 checks one at a time).
NBVAL_JOBS ?= 2
# The notebooks, largest file first (about the longest first)
NBVAL_TARGETS := $(patsubst notebooks/%.ipynb,nbval-%,$(shell ls -S notebooks/*.ipynb))
# PyTorch threads per checked notebook: two notebooks with two threads each on two cores make
# their threads wait on each other (a multi-threaded training cell ran several times slower).
NBVAL_THREADS ?= 1
# Extra options for JupyterLab, e.g. make lab LAB_FLAGS="--no-browser --port 8890"
LAB_FLAGS ?=

.PHONY: book book-exec lab test lint unit unit-tests notebooks book-check book-then-browser browser figures clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -r requirements.txt
	touch $(STAMP)

$(NOEXEC_CONFIG): _config.yml
	sed 's/execute_notebooks: cache/execute_notebooks: "off"/' _config.yml > $@

# The book from the committed outputs, which `make test` has checked: nothing is executed.
book: $(STAMP) $(NOEXEC_CONFIG)
	$(BIN)/jupyter-book build . $(BOOK_FLAGS) --config $(NOEXEC_CONFIG)
	@echo "open _build/html/index.html"

# The book re-executing every notebook whose code changed since the last build (jupyter-cache).
book-exec: $(STAMP)
	$(BIN)/jupyter-book build . $(BOOK_FLAGS)
	@echo "open _build/html/index.html"

# JupyterLab in the same environment, as the optional extra `lab` (so `make test` stays lean).
$(LAB_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[lab]"
	touch $(LAB_STAMP)

# As root (containers), Jupyter refuses to start unless told it is allowed.
lab: $(LAB_STAMP)
	GPT2KIMI_PROGRESS=1 $(BIN)/jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_FLAGS)

# The checks that take seconds run first; then the unit tests, every notebook and the book with
# its browser checks share TEST_JOBS slots (two cores: two jobs of one PyTorch thread each), the
# longest first, so that neither core idles while a long notebook runs. -k: every failure shows.
test: lint
	$(MAKE) --no-print-directory -k -j$(TEST_JOBS) --output-sync=target \
	  TEST_THREADS=$(NBVAL_THREADS) book-then-browser unit-tests $(NBVAL_TARGETS)

lint: $(STAMP)
	$(BIN)/ruff check src tests book
	$(BIN)/lint-imports
	$(BIN)/python -m gpt2kimi.experiments check  # every results file registered and current

unit: lint unit-tests

# Each test runs PyTorch on one thread (tests/conftest.py); TEST_THREADS also holds the processes
# the tests start (chapter 9's gloo workers) to that many when make test runs them beside a notebook
unit-tests: $(STAMP)
	$(if $(TEST_THREADS),OMP_NUM_THREADS=$(TEST_THREADS)) \
	  $(BIN)/python -m pytest tests --ignore=tests/browser -p no:cacheprovider

# One pytest per notebook, NBVAL_JOBS at a time, the largest first; fails if any notebook fails.
# Each prints its wall time. GPT2KIMI_PROGRESS=0 keeps progress bars out of the compared outputs;
# each notebook runs NBVAL_THREADS PyTorch threads (make notebooks NBVAL_JOBS=1 NBVAL_THREADS=2
# on an idle two-core machine).
notebooks: $(STAMP)
	$(MAKE) --no-print-directory -k -j$(NBVAL_JOBS) --output-sync=target $(NBVAL_TARGETS)

nbval-%: $(STAMP)
	@start=$$(date +%s); GPT2KIMI_PROGRESS=0 OMP_NUM_THREADS=$(NBVAL_THREADS) \
	  $(BIN)/python -m pytest --nbval notebooks/$*.ipynb -p no:cacheprovider; rc=$$?; \
	  echo "nbval notebooks/$*.ipynb: $$(( $$(date +%s) - start )) s"; exit $$rc

# the browser checks read the book just built: one job, in this order
book-then-browser: book-check
	$(BROWSER_TESTS)

# nbval re-executes every notebook against its committed outputs, so the test build renders
# those outputs instead of executing everything a second time.
book-check: $(STAMP) $(NOEXEC_CONFIG)
	$(BIN)/jupyter-book build . $(BOOK_FLAGS) --config $(NOEXEC_CONFIG)

BROWSER_TESTS = $(BIN)/python -m pytest tests/browser -p no:cacheprovider
browser: $(STAMP)
	$(BROWSER_TESTS)

figures: $(STAMP)
	$(BIN)/python book/figures/make_intro_figure.py

clean:
	rm -rf _build $(NOEXEC_CONFIG)
