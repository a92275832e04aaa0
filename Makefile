# make book  - build the book into _build/html
# make test  - lint, unit tests, every notebook and solution under nbval, the book with warnings
#              as errors, then every page of it in headless Chromium
# Both create .venv (Python 3.11) and install requirements.txt and attnlib on first use, and the
# book's scripts from package-lock.json (npm); the browser tests install Debian's chromium if missing.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN     = $(VENV)/bin
# Tiny Shakespeare: use ATTNLIB_DATA_DIR when set, else ../shared/data when present;
# otherwise attnlib downloads it once into ~/.cache/attnlib (sha256-checked).
ATTNLIB_DATA_DIR ?= $(if $(wildcard ../shared/data/tinyshakespeare.txt),$(abspath ../shared/data))
export ATTNLIB_DATA_DIR
export PYDEVD_DISABLE_FILE_VALIDATION = 1
NBVAL   = --nbval --nbval-current-env --nbval-sanitize-with .nbval_sanitize.cfg --nbval-cell-timeout 600

.PHONY: book test lint unit notebooks book-strict browser chromium clean venv static

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements.txt -e .
	touch $@

# The scripts the built book serves itself from _static (no network when reading it): MathJax 3, the
# ipywidgets embed manager and RequireJS, pinned in package.json / package-lock.json.
STATIC = _vendor
static: $(STATIC)/.installed

$(STATIC)/.installed: package.json package-lock.json
	@command -v npm >/dev/null || { echo "npm (Node.js) is needed to install the book's scripts: apt-get install npm"; exit 1; }
	npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
	rm -rf $(STATIC) && mkdir -p $(STATIC)/html-manager
	cp -r node_modules/mathjax/es5 $(STATIC)/mathjax
	cp node_modules/requirejs/require.js $(STATIC)/require.js
	cp node_modules/@jupyter-widgets/html-manager/dist/embed-amd.js node_modules/@jupyter-widgets/html-manager/dist/*.woff* \
	   node_modules/@jupyter-widgets/html-manager/dist/*.ttf node_modules/@jupyter-widgets/html-manager/dist/*.eot \
	   node_modules/@jupyter-widgets/html-manager/dist/*.svg $(STATIC)/html-manager/
	touch $@

book: venv static
	$(BIN)/jupyter-book build .

test: lint unit notebooks book-strict browser

lint: venv
	$(BIN)/ruff check .

unit: venv
	$(BIN)/python -m pytest tests -q

notebooks: venv
	$(BIN)/python -m pytest $(NBVAL) notebooks solutions -q

# nbval has just re-executed every notebook and matched its stored outputs, so the strict
# build renders those outputs instead of executing everything a second time.
book-strict: venv static
	mkdir -p _build
	sed -e 's/execute_notebooks: cache/execute_notebooks: "off"/' -e 's#: book/_ext#: ../book/_ext#' _config.yml > _build/_config.test.yml
	$(BIN)/jupyter-book build . -W --keep-going --config _build/_config.test.yml

# Every page of _build/html in headless Chromium (browser_tests/); screenshots in _build/screenshots.
browser: venv chromium
	$(BIN)/python -m pytest browser_tests -q

# Debian's chromium (CHROMIUM=/path/to/chrome uses another build of Chromium instead).
SUDO = $(if $(filter 0,$(shell id -u)),,sudo)
chromium:
	@if [ -z "$$CHROMIUM" ] && ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then \
	  echo "Installing Debian's chromium for the browser tests"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium >/dev/null; \
	fi

clean:
	rm -rf _build
