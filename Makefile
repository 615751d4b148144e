# Two commands for a newcomer:
#   make book   build the book into _build/html (executes notebooks whose code changed)
#   make test   unit tests, every notebook re-executed against its saved outputs (nbval),
#               the book built with warnings as errors, and the rendered pages checked in Chromium
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of PyTorch. Override for another build, e.g. make TORCH="torch==2.13.0 --index-url ..."
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
BOOK_FLAGS := -W -n --keep-going

.PHONY: book test unit notebooks book-check browser lint figures clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -r requirements.txt
	touch $(STAMP)

book: $(STAMP)
	$(BIN)/jupyter-book build . $(BOOK_FLAGS)
	@echo "open _build/html/index.html"

test: unit notebooks book-check browser

unit: $(STAMP)
	$(BIN)/ruff check src tests book
	$(BIN)/python -m pytest tests --ignore=tests/browser

notebooks: $(STAMP)
	$(BIN)/python -m pytest --nbval notebooks -p no:cacheprovider

# nbval has just re-executed every notebook against its committed outputs, so the test build
# renders those outputs instead of executing everything a second time.
book-check: $(STAMP)
	sed 's/execute_notebooks: cache/execute_notebooks: "off"/' _config.yml > .config-noexec.yml
	$(BIN)/jupyter-book build . $(BOOK_FLAGS) --config .config-noexec.yml

browser: $(STAMP)
	$(BIN)/python -m pytest tests/browser -p no:cacheprovider

figures: $(STAMP)
	$(BIN)/python book/figures/make_intro_figure.py

clean:
	rm -rf _build .config-noexec.yml
