# Two commands do everything from a fresh clone: `make demo` and `make test`.
# Each creates .venv, installs the pinned requirements and builds the extension
# (incrementally: ninja rebuilds only what changed).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements-installed
# Builds are serialised so that concurrent `make` calls in one tree do not race.
LOCK := flock .build.lock

.PHONY: all venv build test test-cuda demo cmake-check clean

all: build

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

venv: $(STAMP)

build: $(STAMP)
	$(LOCK) $(PY) -m pip install --quiet -e . --no-build-isolation --no-deps

test: build
	$(PY) -m pytest -q tests

demo: build
	$(PY) -m mla_ext demo

# Builds the same sources through CMake + find_package(Torch) (CI runs this).
cmake-check: $(STAMP)
	$(LOCK) ./tools/cmake_build.sh build/cmake

clean:
	rm -rf build *.egg-info mla_ext/_C*.so
