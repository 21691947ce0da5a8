# CUDA setup in one place. TANDEM_CUDA=AUTO builds CUDA code only where nvcc
# exists; ON requires it; OFF never builds it. Kernels target Hopper (sm_90a).
set(TANDEM_HAVE_CUDA OFF)
if(NOT TANDEM_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # H100/H200: sm_90a enables wgmma/TMA instructions used by the Hopper kernels.
      set(CMAKE_CUDA_ARCHITECTURES 90a)
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)   # cmake 3.25 rejects CUDA20
    find_package(CUDAToolkit REQUIRED)
    set(TANDEM_HAVE_CUDA ON)
  elseif(TANDEM_CUDA STREQUAL "ON")
    message(FATAL_ERROR "TANDEM_CUDA=ON but no CUDA compiler (nvcc) was found")
  endif()
endif()
message(STATUS "tandem: CUDA=${TANDEM_HAVE_CUDA} UCX=${TANDEM_WITH_UCX}")
