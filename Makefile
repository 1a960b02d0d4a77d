# Thin wrapper over CMake. Every target installs missing packages first
# (scripts/install-deps: Debian's packages and the project's Python environment),
# then configures and builds into $(BUILD). The Python interpreter is
# scripts/python's environment (torch 2.11 from PyPI) unless PYTHON names another.
BUILD ?= build
PYTHON ?=
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps configure build demo test check test-newest-torch bench clean

all: build

deps:
	scripts/install-deps

# A compiler cache (ccache, from install-deps) serves rebuilds and the
# pip-install test's second build of the core; CCACHE=0 turns it off.
CCACHE ?= $(if $(shell command -v ccache),ccache,)
LAUNCHER = $(if $(filter-out 0,$(CCACHE)),-DCMAKE_C_COMPILER_LAUNCHER=$(CCACHE) -DCMAKE_CXX_COMPILER_LAUNCHER=$(CCACHE),)

configure: deps
	cmake -S . -B $(BUILD) -DPython_EXECUTABLE=$${PYTHON:-$$(scripts/python --executable)} $(LAUNCHER) $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j$(JOBS)

demo: build
	scripts/demo.sh $(BUILD)

test: build
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS) --timeout 900

# The edit-compile-test loop: the unit, integration, layering, kb and MPI
# tests, without the ones that take minutes or need what a laptop lacks (the
# Python suite with its pip install, the installed-package test, TSan, GPU,
# browser, and the label `slow`: the 40 randomised fault plans under mpirun).
# About a minute after a one-file edit on 2 cores; `make test` runs everything.
CHECK_LABELS ?= unit|integration|layering|kb|mpi
CHECK_EXCLUDE ?= python|package|tsan|gpu|browser|slow
check: build
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS) --timeout 900 -L '$(CHECK_LABELS)' -LE '$(CHECK_EXCLUDE)'

# The Python suite against the newest torch release (an environment and a
# build of its own: build-torch-<version>/).
test-newest-torch: deps
	scripts/test-torch 2.15.0

bench: build
	bench/run.sh $(BUILD)

clean:
	rm -rf $(BUILD)
