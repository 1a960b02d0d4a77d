# Thin wrapper over CMake. Every target installs missing packages first
# (scripts/install-deps), then configures and builds into $(BUILD).
BUILD ?= build
PYTHON ?= /usr/bin/python3
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps configure build demo test bench clean

all: build

deps:
	scripts/install-deps

configure: deps
	cmake -S . -B $(BUILD) -DPython_EXECUTABLE=$(PYTHON) $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j$(JOBS)

demo: build
	scripts/demo.sh $(BUILD)

test: build
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS) --timeout 900

bench: build
	bench/run.sh $(BUILD)

clean:
	rm -rf $(BUILD)
