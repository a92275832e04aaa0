# make book      - build the book into _build/html from the notebooks' stored outputs (executes nothing)
# make book-execute - the same, executing the notebooks (through jupyter-cache: all of them the first time)
# make launch    - write launch/: the plain-Jupyter copies of the chapters and solutions that the
#                  book's Colab/Binder buttons open (after changing a notebook; a test fails if stale)
# make chromium  - install Debian's chromium for the browser tests, if no Chromium is found (once, needs sudo)
# make test      - lint, unit tests, every notebook and solution under nbval, the book with warnings
#                  as errors (_config.strict.yml), then every page of it in headless Chromium
# make gpu       - on a CUDA machine: what the GitHub workflow's GPU job runs (unit tests, nbval-lax, benchmarks)
# They create .venv (Python 3.11) and install requirements.txt and attnlib (editable, with its book and
# test extras) on first use, and the book's scripts from package-lock.json (npm). `make test` installs no
# browser: run `make chromium` first (or set CHROMIUM=/path/to/chrome).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN     = $(VENV)/bin
# Tiny Shakespeare: use ATTNLIB_DATA_DIR when set, else ../shared/data when present;
# otherwise attnlib downloads it once into ~/.cache/attnlib (sha256-checked).
ATTNLIB_DATA_DIR ?= $(if $(wildcard ../shared/data/tinyshakespeare.txt),$(abspath ../shared/data))
export ATTNLIB_DATA_DIR
export PYDEVD_DISABLE_FILE_VALIDATION = 1
# Notebooks store their outputs and nbval compares them digit for digit; the last digits of a float sum
# depend on the vector instructions a CPU's kernels use (AVX-512 on one machine, AVX2 on another). Every
# run here pins them to AVX2, which every x86-64 machine the book is built and tested on has: PyTorch's
# own kernels, MKL (its conditional numerical reproducibility mode) and oneDNN.
ifeq ($(shell uname -m),x86_64)
export ATEN_CPU_CAPABILITY ?= avx2
export MKL_CBWR ?= AVX2
export ONEDNN_MAX_CPU_ISA ?= AVX2
endif
# A cell may take three times its time on a quiet machine and more (a busy CI machine): 30 minutes.
NBVAL   = --nbval --nbval-current-env --nbval-sanitize-with .nbval_sanitize.cfg --nbval-cell-timeout 1800

.PHONY: book book-execute launch test lint unit notebooks book-strict browser chromium gpu clean venv static

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements.txt -e ".[book,test]"
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

# The notebooks are stored executed and nbval (make test) checks those outputs: the book renders
# them (_config.yml: execute_notebooks "off").
book: venv static
	$(BIN)/jupyter-book build .

# The book with every notebook executed in the build (jupyter-cache in _build/.jupyter_cache:
# the first run executes all of them, about 9 minutes on two cores; later runs only the notebooks
# whose code changed). Its configuration is _config.yml with execute_notebooks "cache", written
# to _build/ (Jupyter Book finds local_extensions relative to the configuration file: rebased).
book-execute: venv static
	mkdir -p _build
	$(BIN)/python -c 'import os, yaml; c = yaml.safe_load(open("_config.yml")); c["execute"]["execute_notebooks"] = "cache"; \
	  ext = c["sphinx"]["local_extensions"]; c["sphinx"]["local_extensions"] = {k: os.path.relpath(v, "_build") for k, v in ext.items()}; \
	  yaml.safe_dump(c, open("_build/_config.execute.yml", "w"), sort_keys=False)'
	$(BIN)/jupyter-book build . --config _build/_config.execute.yml

# launch/notebooks/NN_*.ipynb and launch/solutions/NN_*_solutions.ipynb, from the chapters and
# solutions (book/_ext/launch.py): what the book's launch buttons and download open. Committed;
# tests/test_launch_notebooks.py fails when they are stale.
launch: venv
	$(BIN)/python book/_ext/launch.py

test: lint unit notebooks book-strict browser

lint: venv
	$(BIN)/ruff check .

# Every test has a time limit (pytest-timeout) and every notebook cell one (nbval), each many times what it
# takes on a quiet machine: --durations prints the slowest, to keep the margins honest.
unit: venv
	$(BIN)/python -m pytest tests -q --timeout 900 --durations 10

notebooks: venv
	$(BIN)/python -m pytest $(NBVAL) notebooks solutions book/library_map.ipynb -q --durations 10

# The book with warnings as errors. Like `make book` it renders the stored outputs, which nbval
# has just re-executed and matched: _config.strict.yml is _config.yml (tests/test_layout.py keeps
# the two in step; execute_notebooks must be "off" there).
book-strict: venv static
	$(BIN)/jupyter-book build . -W --keep-going --config _config.strict.yml

# Every page of _build/html in headless Chromium (browser_tests/); screenshots in _build/screenshots.
# Needs a Chromium: `make chromium` installs one, CHROMIUM=/path/to/chrome names another.
browser: venv
	$(BIN)/python -m pytest browser_tests -q --timeout 600 --durations 5

# Debian's chromium, when no Chromium is found (CHROMIUM=/path/to/chrome uses another build instead).
# Its own step: `make test` installs nothing system-wide; .ci/run runs it before `make test`.
SUDO = $(if $(filter 0,$(shell id -u)),,sudo)
chromium:
	@if [ -z "$$CHROMIUM" ] && ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then \
	  echo "Installing Debian's chromium for the browser tests"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium >/dev/null; \
	fi

# The GitHub workflow's GPU job runs exactly `make gpu` (.github/workflows/ci.yml): anyone with a
# CUDA machine checks the GPU lane with this one command. Benchmark results go to bench-gpu/.
gpu: venv
	$(BIN)/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
	$(BIN)/python -m pytest tests -q
	$(BIN)/python -m pytest --nbval-lax --nbval-current-env --nbval-cell-timeout 1800 notebooks solutions book/library_map.ipynb -q
	mkdir -p bench-gpu
	$(BIN)/python -m attnlib.bench mha --device cuda --out bench-gpu/mha.json
	$(BIN)/python -m attnlib.bench kv-cache --device cuda --out bench-gpu/kv_cache.json
	$(BIN)/python -m attnlib.bench memory --device cuda --out bench-gpu/memory.json
	$(BIN)/python -m attnlib.bench train --device cuda --out bench-gpu/train.json
	$(BIN)/python -m attnlib.bench train --modern --device cuda --out bench-gpu/modern.json
	$(BIN)/python -m attnlib.bench flash --device cuda --out bench-gpu/flash.json
	$(BIN)/python -m attnlib.bench long-context --device cuda --out bench-gpu/long_context.json
	$(BIN)/python -m attnlib.bench serving --device cuda --out bench-gpu/serving.json

clean:
	rm -rf _build
