# oomguard_find_torch(): find_package(Torch REQUIRED) for code compiled against
# libtorch's C++ API (examples/cpp/libtorch_train), the same way in the
# configure-time probe (OomguardOptions.cmake) and in the real build.
#
# PyPI's Linux torch wheels are CUDA builds: their TorchConfig enables the CUDA
# language and, unless TORCH_CUDA_ARCH_LIST says which GPUs to compile for,
# runs a program to detect the GPUs present (none here). Nothing of oomguard
# compiles CUDA kernels against torch, so any list will do; and the CUDA
# language standard follows CMAKE_CXX_STANDARD (20), which nvcc 13 does not
# accept through CMake 3.25, so it is pinned to 17.
macro(oomguard_find_torch)
  if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(ENV{TORCH_CUDA_ARCH_LIST} "9.0")
  endif()
  if(NOT DEFINED CMAKE_CUDA_STANDARD)
    set(CMAKE_CUDA_STANDARD 17)
  endif()
  find_package(Torch REQUIRED)
endmacro()
