# make book  - build the book into _build/html
# make test  - unit tests, every notebook and solution under nbval, the book with warnings as errors
# Both create .venv (Python 3.11) and install requirements.txt and attnlib on first use.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN     = $(VENV)/bin
# Tiny Shakespeare: use ATTNLIB_DATA_DIR when set, else ../shared/data when present;
# otherwise attnlib downloads it once into ~/.cache/attnlib (sha256-checked).
ATTNLIB_DATA_DIR ?= $(if $(wildcard ../shared/data/tinyshakespeare.txt),$(abspath ../shared/data))
export ATTNLIB_DATA_DIR
export PYDEVD_DISABLE_FILE_VALIDATION = 1
NBVAL   = --nbval --nbval-current-env --nbval-sanitize-with .nbval_sanitize.cfg --nbval-cell-timeout 600

.PHONY: book test unit notebooks book-strict clean venv

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements.txt -e .
	touch $@

book: venv
	$(BIN)/jupyter-book build .

test: unit notebooks book-strict

unit: venv
	$(BIN)/python -m pytest tests -q

notebooks: venv
	$(BIN)/python -m pytest $(NBVAL) notebooks solutions -q

# nbval has just re-executed every notebook and matched its stored outputs, so the strict
# build renders those outputs instead of executing everything a second time.
book-strict: venv
	mkdir -p _build
	sed 's/execute_notebooks: cache/execute_notebooks: "off"/' _config.yml > _build/_config.test.yml
	$(BIN)/jupyter-book build . -W --keep-going --config _build/_config.test.yml

clean:
	rm -rf _build
