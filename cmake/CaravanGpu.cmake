# GPU sources are optional. With CARAVAN_GPU=AUTO they build when a CUDA compiler is found
# (nvcc, also looked for in /usr/local/cuda/bin); CARAVAN_GPU=ON makes a missing one an error.
# The result is CARAVAN_HAVE_GPU, which runtime/ turns into the CARAVAN_HAVE_GPU definition.
# CARAVAN_GPU_REASON says why a build has no GPU sources (configure message, and the runtime's
# probe_gpus().reason through runtime/gpu/probe_none.cpp): turned off, or no compiler found. It
# becomes a compile definition: no ';' in it (a CMake list separator).
set(CARAVAN_HAVE_GPU OFF)
set(CARAVAN_GPU_REASON "")
# Any case, and CMake's boolean spellings (1/0, TRUE/FALSE, YES/NO) for ON and OFF.
string(TOUPPER "${CARAVAN_GPU}" CARAVAN_GPU)
if(CARAVAN_GPU MATCHES "^(1|TRUE|YES|Y)$")
  set(CARAVAN_GPU ON)
elseif(CARAVAN_GPU MATCHES "^(0|FALSE|NO|N)$")
  set(CARAVAN_GPU OFF)
endif()
if(NOT CARAVAN_GPU MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "CARAVAN_GPU=${CARAVAN_GPU}: expected AUTO, ON or OFF")
endif()
if(CARAVAN_GPU STREQUAL "OFF")
  string(CONCAT CARAVAN_GPU_REASON "it was turned off when the build was configured (CARAVAN_GPU=OFF): "
                                   "reconfigure with -DCARAVAN_GPU=AUTO or -DCARAVAN_GPU=ON to build it")
  set(gpu_status "OFF (turned off: CARAVAN_GPU=OFF; -DCARAVAN_GPU=AUTO or ON builds them)")
else()
  # A compiler not found before is looked for again (check_language caches NOTFOUND), so that
  # installing the toolkit and reconfiguring the same build folder finds it.
  if(CMAKE_CUDA_COMPILER STREQUAL "CMAKE_CUDA_COMPILER-NOTFOUND" OR CMAKE_CUDA_COMPILER STREQUAL "NOTFOUND")
    unset(CMAKE_CUDA_COMPILER CACHE)
  endif()
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)  # Hopper (H100/H200), the GPUs Caravan is measured on
    endif()
    enable_language(CUDA)
    # CMake 3.25 predates nvcc's C++20 support (CUDA 12+); tell it the flag so that CUDA_STANDARD 20
    # and the cxx_std_20 requirement of Caravan's targets work for .cu files too.
    if(CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.0 AND NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_COMPILE_FEATURES cuda_std_20)
      list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
    endif()
    find_package(CUDAToolkit REQUIRED)
    set(CARAVAN_HAVE_GPU ON)
  elseif(CARAVAN_GPU STREQUAL "ON")
    message(FATAL_ERROR "CARAVAN_GPU=ON but no CUDA compiler was found (set CUDACXX or put nvcc on PATH)")
  else()
    string(CONCAT CARAVAN_GPU_REASON "no CUDA compiler was found when the build was configured (CARAVAN_GPU=AUTO): "
                                     "install the CUDA toolkit (nvcc on PATH, in /usr/local/cuda/bin, or CUDACXX) "
                                     "and reconfigure")
    set(gpu_status "OFF (CARAVAN_GPU=AUTO found no CUDA compiler: set CUDACXX or put nvcc on PATH)")
  endif()
endif()
if(CARAVAN_HAVE_GPU)
  set(gpu_status "ON (CARAVAN_GPU=${CARAVAN_GPU})")
endif()
message(STATUS "Caravan GPU sources: ${gpu_status}")
