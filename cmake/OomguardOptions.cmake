# Optional parts of oomguard. Each option is reported at configure time as on or
# off with the reason, so that nothing silently disappears.

set(_og_report "")
macro(_og_note name value why)
  list(APPEND _og_report "${name}=${value} (${why})")
endmacro()

# oomguard_import_library(<target> <library> <include_dir>): an IMPORTED
# target for a library found with find_library/find_path, so that targets
# link every dependency the same way (and its headers come as SYSTEM).
function(oomguard_import_library target library include_dir)
  if(NOT TARGET ${target})
    add_library(${target} UNKNOWN IMPORTED)
    set_target_properties(${target} PROPERTIES
      IMPORTED_LOCATION "${library}"
      INTERFACE_INCLUDE_DIRECTORIES "${include_dir}")
  endif()
endfunction()

# ---- CUDA toolkit (runtime API only; no kernels, so no CUDA language needed) ----
if(NOT DEFINED CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
  set(CUDAToolkit_ROOT /usr/local/cuda)
endif()
find_package(CUDAToolkit QUIET)
option(OOMGUARD_WITH_CUDA "Build the CUDA device (CudaDevice)" ${CUDAToolkit_FOUND})
if(OOMGUARD_WITH_CUDA AND NOT CUDAToolkit_FOUND)
  message(FATAL_ERROR "OOMGUARD_WITH_CUDA=ON but the CUDA toolkit was not found (set CUDAToolkit_ROOT)")
endif()
if(OOMGUARD_WITH_CUDA)
  _og_note(OOMGUARD_WITH_CUDA ON "CUDA toolkit ${CUDAToolkit_VERSION} at ${CUDAToolkit_LIBRARY_DIR}")
elseif(CUDAToolkit_FOUND)
  _og_note(OOMGUARD_WITH_CUDA OFF "disabled by the user")
else()
  _og_note(OOMGUARD_WITH_CUDA OFF "CUDA toolkit not found")
endif()

# ---- NCCL ----
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY AND OOMGUARD_WITH_CUDA)
  set(_og_nccl_default ON)
else()
  set(_og_nccl_default OFF)
endif()
option(OOMGUARD_WITH_NCCL "Build the NCCL coordinator" ${_og_nccl_default})
if(OOMGUARD_WITH_NCCL)
  if(NOT (NCCL_INCLUDE_DIR AND NCCL_LIBRARY AND OOMGUARD_WITH_CUDA))
    message(FATAL_ERROR "OOMGUARD_WITH_NCCL=ON needs CUDA and nccl.h/libnccl")
  endif()
  _og_note(OOMGUARD_WITH_NCCL ON "${NCCL_LIBRARY}")
  oomguard_import_library(oomguard_ext::nccl "${NCCL_LIBRARY}" "${NCCL_INCLUDE_DIR}")
elseif(NOT OOMGUARD_WITH_CUDA)
  _og_note(OOMGUARD_WITH_NCCL OFF "needs OOMGUARD_WITH_CUDA")
elseif(NOT NCCL_LIBRARY)
  _og_note(OOMGUARD_WITH_NCCL OFF "libnccl not found")
else()
  _og_note(OOMGUARD_WITH_NCCL OFF "disabled by the user")
endif()

# ---- MPI ----
find_package(MPI QUIET COMPONENTS C)
option(OOMGUARD_WITH_MPI "Build the MPI coordinator and its tests" ${MPI_C_FOUND})
if(OOMGUARD_WITH_MPI)
  if(NOT MPI_C_FOUND)
    message(FATAL_ERROR "OOMGUARD_WITH_MPI=ON but MPI was not found (apt-get install libopenmpi-dev)")
  endif()
  _og_note(OOMGUARD_WITH_MPI ON "MPI ${MPI_C_VERSION}, ${MPIEXEC_EXECUTABLE}")
elseif(MPI_C_FOUND)
  _og_note(OOMGUARD_WITH_MPI OFF "disabled by the user")
else()
  _og_note(OOMGUARD_WITH_MPI OFF "MPI not found")
endif()

# ---- Python bindings (pybind11) ----
# The project's interpreter is scripts/python (a virtual environment with torch
# 2.11 from PyPI); the Makefile passes it as Python_EXECUTABLE. pybind11 comes
# from that environment (python -m pybind11 --cmakedir), or a system install.
find_package(Python QUIET COMPONENTS Interpreter Development.Module)
if(Python_FOUND AND NOT pybind11_DIR)
  execute_process(COMMAND ${Python_EXECUTABLE} -m pybind11 --cmakedir
                  RESULT_VARIABLE _og_pb_rc OUTPUT_VARIABLE _og_pb_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_og_pb_rc EQUAL 0 AND IS_DIRECTORY "${_og_pb_dir}")
    set(pybind11_DIR "${_og_pb_dir}" CACHE PATH "pybind11's CMake package (from ${Python_EXECUTABLE})")
  endif()
endif()
if(Python_FOUND)
  find_package(pybind11 CONFIG QUIET)
endif()
if(Python_FOUND AND pybind11_FOUND)
  set(_og_python_default ON)
else()
  set(_og_python_default OFF)
endif()
option(OOMGUARD_BUILD_PYTHON "Build the Python package oomguard (pybind11 module oomguard._oomguard)"
       ${_og_python_default})
if(OOMGUARD_BUILD_PYTHON)
  if(NOT (Python_FOUND AND pybind11_FOUND))
    message(FATAL_ERROR "OOMGUARD_BUILD_PYTHON=ON needs the Python interpreter and headers and pybind11 "
                        "(scripts/python has them: -DPython_EXECUTABLE=$(scripts/python --executable))")
  endif()
  _og_note(OOMGUARD_BUILD_PYTHON ON "Python ${Python_VERSION} at ${Python_EXECUTABLE}, pybind11 ${pybind11_VERSION}")
elseif(NOT Python_FOUND)
  _og_note(OOMGUARD_BUILD_PYTHON OFF "Python interpreter or headers not found")
elseif(NOT pybind11_FOUND)
  _og_note(OOMGUARD_BUILD_PYTHON OFF "pybind11 not found (pip install pybind11, or use scripts/python)")
else()
  _og_note(OOMGUARD_BUILD_PYTHON OFF "disabled by the user")
endif()

# ---- torch: the one that the Python interpreter imports (a pip wheel's
# torch/include and torch/lib), else a libtorch on the search paths ----
# Asked with -I, so that a build environment's PYTHONPATH (pip's isolated
# builds) does not hide the torch installed where the package will run.
set(OOMGUARD_TORCH_ROOT "" CACHE INTERNAL "The torch package the build compiles against")
set(OOMGUARD_TORCH_VERSION "" CACHE INTERNAL "Its version")
set(_og_torch_skipped "libtorch (c10) not found")
if(Python_Interpreter_FOUND)
  execute_process(
    COMMAND ${Python_EXECUTABLE} -I -c
      "import os, torch; print(os.path.dirname(torch.__file__)); print(torch.__version__); print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
    RESULT_VARIABLE _og_torch_rc OUTPUT_VARIABLE _og_torch_out ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_og_torch_rc EQUAL 0)
    string(REPLACE "\n" ";" _og_torch_out "${_og_torch_out}")
    list(GET _og_torch_out 0 _og_torch_root)
    list(GET _og_torch_out 1 _og_torch_version)
    list(GET _og_torch_out 2 _og_torch_abi)
    if(_og_torch_abi EQUAL 1)
      set(OOMGUARD_TORCH_ROOT "${_og_torch_root}" CACHE INTERNAL "The torch package the build compiles against")
      set(OOMGUARD_TORCH_VERSION "${_og_torch_version}" CACHE INTERNAL "Its version")
    else()
      string(CONCAT _og_torch_skipped "torch ${_og_torch_version} at ${_og_torch_root} uses the pre-C++11 "
                                      "string ABI (PyPI's wheels use the C++11 ABI from torch 2.7 on)")
    endif()
  endif()
endif()
if(OOMGUARD_TORCH_ROOT)
  find_path(C10_INCLUDE_DIR c10/util/Exception.h HINTS ${OOMGUARD_TORCH_ROOT}/include NO_DEFAULT_PATH)
  find_library(C10_LIBRARY c10 HINTS ${OOMGUARD_TORCH_ROOT}/lib NO_DEFAULT_PATH)
  find_path(TORCH_API_INCLUDE_DIR torch/nn/module.h HINTS ${OOMGUARD_TORCH_ROOT}/include/torch/csrc/api/include
            NO_DEFAULT_PATH)
  find_library(TORCH_CPU_LIBRARY torch_cpu HINTS ${OOMGUARD_TORCH_ROOT}/lib NO_DEFAULT_PATH)
  if(NOT DEFINED Torch_DIR AND EXISTS ${OOMGUARD_TORCH_ROOT}/share/cmake/Torch/TorchConfig.cmake)
    set(Torch_DIR ${OOMGUARD_TORCH_ROOT}/share/cmake/Torch CACHE PATH "libtorch's CMake package (torch.utils.cmake_prefix_path)")
  endif()
else()
  find_path(C10_INCLUDE_DIR c10/util/Exception.h)
  find_library(C10_LIBRARY c10)
  find_path(TORCH_API_INCLUDE_DIR torch/nn/module.h PATH_SUFFIXES torch/csrc/api/include)
  find_library(TORCH_CPU_LIBRARY torch_cpu)
endif()
if(C10_INCLUDE_DIR AND C10_LIBRARY)
  oomguard_import_library(oomguard_ext::c10 "${C10_LIBRARY}" "${C10_INCLUDE_DIR}")
endif()
# libtorch's C++ API (torch_cpu and its headers), for oomguard::torch's
# TrainStep and state helpers. Imported directly rather than through
# find_package(Torch), which would enable the CUDA language for the whole
# build (examples/cpp and the package consumer use find_package(Torch)).
if(C10_INCLUDE_DIR AND C10_LIBRARY AND TORCH_API_INCLUDE_DIR AND TORCH_CPU_LIBRARY)
  oomguard_import_library(oomguard_ext::torch_cpu "${TORCH_CPU_LIBRARY}" "${C10_INCLUDE_DIR}")
  set_property(TARGET oomguard_ext::torch_cpu APPEND PROPERTY INTERFACE_INCLUDE_DIRECTORIES "${TORCH_API_INCLUDE_DIR}")
  set_property(TARGET oomguard_ext::torch_cpu APPEND PROPERTY INTERFACE_LINK_LIBRARIES oomguard_ext::c10)
  set(_og_torch_default ON)
else()
  set(_og_torch_default OFF)
endif()
option(OOMGUARD_WITH_TORCH "Build oomguard::torch: TrainStep and the libtorch state helpers, the budgeted CPU \
allocator, and c10::OutOfMemoryError recognised by type (libtorch)" ${_og_torch_default})
if(OOMGUARD_WITH_TORCH)
  if(NOT _og_torch_default)
    message(FATAL_ERROR "OOMGUARD_WITH_TORCH=ON but libtorch (libc10, libtorch_cpu and the C++ API headers) was not "
                        "found (pip install torch for the interpreter given as Python_EXECUTABLE, or a libtorch "
                        "on CMAKE_PREFIX_PATH)")
  endif()
  _og_note(OOMGUARD_WITH_TORCH ON "${TORCH_CPU_LIBRARY}")
elseif(_og_torch_default)
  _og_note(OOMGUARD_WITH_TORCH OFF "disabled by the user")
else()
  if(_og_torch_skipped)
    _og_note(OOMGUARD_WITH_TORCH OFF "${_og_torch_skipped}")
  else()
    _og_note(OOMGUARD_WITH_TORCH OFF "libtorch (libc10, libtorch_cpu, C++ API headers) not found")
  endif()
endif()

# The budgeted CPU allocator (oomguard._budget): real torch OOMs on CPU, for the
# tests and the example. One translation unit against libc10 only.
if(OOMGUARD_BUILD_PYTHON AND C10_INCLUDE_DIR AND C10_LIBRARY)
  set(_og_budget_default ON)
else()
  set(_og_budget_default OFF)
endif()
option(OOMGUARD_BUILD_TORCH_BUDGET "Build oomguard._budget (c10::SetCPUAllocator with a byte budget)"
       ${_og_budget_default})
if(OOMGUARD_BUILD_TORCH_BUDGET)
  if(NOT (OOMGUARD_BUILD_PYTHON AND C10_INCLUDE_DIR AND C10_LIBRARY))
    message(FATAL_ERROR "OOMGUARD_BUILD_TORCH_BUDGET=ON needs OOMGUARD_BUILD_PYTHON and torch (c10) for that interpreter")
  endif()
  _og_note(OOMGUARD_BUILD_TORCH_BUDGET ON "${C10_LIBRARY}")
elseif(NOT OOMGUARD_BUILD_PYTHON)
  _og_note(OOMGUARD_BUILD_TORCH_BUDGET OFF "needs OOMGUARD_BUILD_PYTHON")
elseif(NOT C10_LIBRARY)
  _og_note(OOMGUARD_BUILD_TORCH_BUDGET OFF "${_og_torch_skipped}")
else()
  _og_note(OOMGUARD_BUILD_TORCH_BUDGET OFF "disabled by the user")
endif()

# ---- tests, examples, benchmarks ----
option(OOMGUARD_BUILD_TESTS "Build the tests" ${OOMGUARD_MAIN_PROJECT})
option(OOMGUARD_BUILD_EXAMPLES "Build the examples (mlp_train)" ${OOMGUARD_MAIN_PROJECT})
find_package(benchmark QUIET)
if(benchmark_FOUND AND OOMGUARD_MAIN_PROJECT)
  set(_og_bench_default ON)
else()
  set(_og_bench_default OFF)
endif()
option(OOMGUARD_BUILD_BENCH "Build the benchmarks (Google Benchmark)" ${_og_bench_default})
if(OOMGUARD_BUILD_TESTS)
  find_package(GTest REQUIRED)
  _og_note(OOMGUARD_BUILD_TESTS ON "main project")
else()
  _og_note(OOMGUARD_BUILD_TESTS OFF "not the main project or disabled")
endif()
_og_note(OOMGUARD_BUILD_EXAMPLES ${OOMGUARD_BUILD_EXAMPLES} "examples/")
if(OOMGUARD_BUILD_BENCH)
  if(NOT benchmark_FOUND)
    message(FATAL_ERROR "OOMGUARD_BUILD_BENCH=ON but Google Benchmark was not found")
  endif()
  _og_note(OOMGUARD_BUILD_BENCH ON "Google Benchmark ${benchmark_VERSION}")
else()
  _og_note(OOMGUARD_BUILD_BENCH OFF "Google Benchmark not found or disabled")
endif()

# ---- the libtorch example (examples/cpp/libtorch_train): full libtorch ----
# find_package(Torch) stops configuration with a fatal error when one of its
# own dependencies (gflags, glog, protobuf, a CUDA toolkit of the version a
# CUDA libtorch was built with) is missing. So it is first tried in a separate
# CMake run; only when that succeeds does examples/cpp call it for real.
# Otherwise the example is off and the reason is reported.
set(_og_lt_default OFF)
set(_og_lt_why "needs OOMGUARD_WITH_TORCH and OOMGUARD_BUILD_EXAMPLES")
if(OOMGUARD_WITH_TORCH AND OOMGUARD_BUILD_EXAMPLES)
  set(_og_probe_key "${Torch_DIR}|${CMAKE_PREFIX_PATH}|${CMAKE_CXX_COMPILER}")
  if(NOT DEFINED OOMGUARD_TORCH_PROBE_KEY OR NOT OOMGUARD_TORCH_PROBE_KEY STREQUAL _og_probe_key)
    set(_og_probe_dir ${PROJECT_BINARY_DIR}/torch-probe)
    file(REMOVE_RECURSE ${_og_probe_dir})
    file(WRITE ${_og_probe_dir}/CMakeLists.txt
         "cmake_minimum_required(VERSION 3.20)\nproject(oomguard_torch_probe CXX)\nset(CMAKE_CXX_STANDARD 20)\n"
         "include(${PROJECT_SOURCE_DIR}/cmake/OomguardTorch.cmake)\noomguard_find_torch()\n")
    set(_og_probe_args -S ${_og_probe_dir} -B ${_og_probe_dir}/build "-DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER}")
    foreach(v Torch_DIR CMAKE_PREFIX_PATH CUDAToolkit_ROOT CUDA_TOOLKIT_ROOT_DIR CMAKE_CUDA_COMPILER)
      if(DEFINED ${v})
        list(APPEND _og_probe_args "-D${v}=${${v}}")
      endif()
    endforeach()
    message(STATUS "oomguard: checking whether find_package(Torch) works (for libtorch_train)")
    execute_process(COMMAND ${CMAKE_COMMAND} ${_og_probe_args}
                    RESULT_VARIABLE _og_probe_rc OUTPUT_VARIABLE _og_probe_out ERROR_VARIABLE _og_probe_err)
    if(_og_probe_rc EQUAL 0)
      set(_og_probe_reason "")
    else()
      # The first error line says what was missing.
      string(REGEX MATCH "CMake Error[^\n]*\n[^\n]*\n?[^\n]*" _og_probe_reason "${_og_probe_err}")
      string(REGEX REPLACE "[ \n]+" " " _og_probe_reason "${_og_probe_reason}")
      if(NOT _og_probe_reason)
        set(_og_probe_reason "find_package(Torch) failed (see ${_og_probe_dir})")
      endif()
    endif()
    if(_og_probe_rc EQUAL 0)
      set(OOMGUARD_TORCH_PROBE_OK ON CACHE INTERNAL "find_package(Torch) works")
    else()
      set(OOMGUARD_TORCH_PROBE_OK OFF CACHE INTERNAL "find_package(Torch) works")
    endif()
    set(OOMGUARD_TORCH_PROBE_REASON "${_og_probe_reason}" CACHE INTERNAL "why find_package(Torch) failed")
    set(OOMGUARD_TORCH_PROBE_KEY "${_og_probe_key}" CACHE INTERNAL "inputs of the Torch probe")
  endif()
  if(OOMGUARD_TORCH_PROBE_OK)
    set(_og_lt_default ON)
  else()
    set(_og_lt_why "find_package(Torch) failed: ${OOMGUARD_TORCH_PROBE_REASON}")
  endif()
endif()
option(OOMGUARD_BUILD_LIBTORCH_EXAMPLE "Build examples/cpp/libtorch_train when find_package(Torch) works"
       ${_og_lt_default})
# A cached ON that the environment no longer supports falls back to off with
# the reason rather than failing the configuration.
set(OOMGUARD_LIBTORCH_EXAMPLE OFF)
if(OOMGUARD_BUILD_LIBTORCH_EXAMPLE AND _og_lt_default)
  set(OOMGUARD_LIBTORCH_EXAMPLE ON)
  _og_note(OOMGUARD_BUILD_LIBTORCH_EXAMPLE ON "find_package(Torch) works")
elseif(_og_lt_default)
  _og_note(OOMGUARD_BUILD_LIBTORCH_EXAMPLE OFF "disabled by the user")
else()
  _og_note(OOMGUARD_BUILD_LIBTORCH_EXAMPLE OFF "${_og_lt_why}")
endif()

# ---- required: every dependency as an imported target, found here once so
# that every directory of the project sees the same targets ----
find_package(spdlog REQUIRED)
find_package(Threads REQUIRED)
find_package(SQLite3 REQUIRED)                  # kb
# kb: the PostgreSQL backend (libpq, Debian's libpq-dev; its .pc file names
# the include directory and the library).
find_package(PkgConfig REQUIRED)
pkg_check_modules(OOMGUARD_LIBPQ REQUIRED libpq)
find_path(OOMGUARD_LIBPQ_INCLUDE_DIR libpq-fe.h HINTS ${OOMGUARD_LIBPQ_INCLUDE_DIRS} REQUIRED)
find_library(OOMGUARD_LIBPQ_LIBRARY pq HINTS ${OOMGUARD_LIBPQ_LIBRARY_DIRS} REQUIRED)
oomguard_import_library(oomguard_ext::libpq "${OOMGUARD_LIBPQ_LIBRARY}" "${OOMGUARD_LIBPQ_INCLUDE_DIR}")
find_package(nlohmann_json REQUIRED)            # kb, checkpoint, server, cli
find_package(HDF5 REQUIRED COMPONENTS C)        # checkpoint (hdf5::hdf5)
find_package(Boost 1.74 REQUIRED)               # server (Boost.Beast, header-only)
find_package(CLI11 REQUIRED)                    # cli, examples
find_path(OOMGUARD_ZSTD_INCLUDE_DIR zstd.h REQUIRED)
find_library(OOMGUARD_ZSTD_LIBRARY zstd REQUIRED)
oomguard_import_library(oomguard_ext::zstd "${OOMGUARD_ZSTD_LIBRARY}" "${OOMGUARD_ZSTD_INCLUDE_DIR}")
find_path(OOMGUARD_XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
find_library(OOMGUARD_XXHASH_LIBRARY xxhash REQUIRED)
oomguard_import_library(oomguard_ext::xxhash "${OOMGUARD_XXHASH_LIBRARY}" "${OOMGUARD_XXHASH_INCLUDE_DIR}")
# xxhash's runtime dispatch (AVX2 where the CPU has it, 2-4x SSE2's speed;
# the same hashes): the checkpoint hashes every byte it saves and loads
# (sdk/checkpoint/xxh.h). Debian's libxxhash has it on x86-64.
include(CheckCXXSourceCompiles)
set(CMAKE_REQUIRED_INCLUDES "${OOMGUARD_XXHASH_INCLUDE_DIR}")
set(CMAKE_REQUIRED_LIBRARIES "${OOMGUARD_XXHASH_LIBRARY}")
check_cxx_source_compiles([=[
#include <xxh_x86dispatch.h>
int main() { return XXH3_64bits("a", 1) == 0; }
]=] OOMGUARD_XXHASH_DISPATCH)
unset(CMAKE_REQUIRED_INCLUDES)
unset(CMAKE_REQUIRED_LIBRARIES)
if(OOMGUARD_XXHASH_DISPATCH)
  set_property(TARGET oomguard_ext::xxhash APPEND PROPERTY INTERFACE_COMPILE_DEFINITIONS OOMGUARD_XXH_DISPATCH=1)
endif()

# oomguard_use_backends(<target> [CUDA] [TORCH]): compiles <target> with the
# optional backends named that this build has (OOMGUARD_WITH_CUDA=1,
# OOMGUARD_WITH_TORCH=1) and links their runtime libraries privately.
function(oomguard_use_backends target)
  cmake_parse_arguments(_ob "CUDA;TORCH" "" "" ${ARGN})
  if(_ob_CUDA AND OOMGUARD_WITH_CUDA)
    target_compile_definitions(${target} PRIVATE OOMGUARD_WITH_CUDA=1)
    target_link_libraries(${target} PRIVATE CUDA::cudart)
  endif()
  if(_ob_TORCH AND OOMGUARD_WITH_TORCH)
    target_compile_definitions(${target} PRIVATE OOMGUARD_WITH_TORCH=1)
    target_link_libraries(${target} PRIVATE oomguard_ext::c10)
  endif()
endfunction()

function(oomguard_report_options)
  message(STATUS "oomguard ${PROJECT_VERSION} configuration:")
  foreach(line IN LISTS _og_report)
    message(STATUS "  ${line}")
  endforeach()
endfunction()
