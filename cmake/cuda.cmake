# The CUDA kernels and the cuBLASLt FP4 GEMM (XLA_FP4_ENABLE_CUDA=ON). Included by CMakeLists.txt after the
# _xla_fp4_ext target and Python_EXECUTABLE / XLA_FFI_INCLUDE_DIR exist.
#
# The kernels build into a static library of their own so that the host-compiler flags of the extension never reach
# nvcc. cuBLASLt comes from the nvidia-cublas wheel of the Python environment doing the build (the CUDA toolkit may
# not ship it), found by asking Python; XLA_FP4_CUBLAS_ROOT (a folder with include/cublasLt.h and lib/) overrides it.

include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  message(FATAL_ERROR "XLA_FP4_ENABLE_CUDA=ON but no CUDA compiler was found: put nvcc on PATH or set CUDACXX "
                      "(e.g. CUDACXX=/usr/local/cuda/bin/nvcc)")
endif()
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  # sm_90 SASS + PTX (Hopper, and JIT for anything newer), sm_100a SASS (Blackwell B200/GB200).
  set(CMAKE_CUDA_ARCHITECTURES "90;100a")
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
message(STATUS "CUDA ${CUDAToolkit_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}")

set(XLA_FP4_CUBLAS_ROOT "" CACHE PATH "Folder with include/cublasLt.h and lib/libcublasLt.so* (default: the wheel)")
if(NOT XLA_FP4_CUBLAS_ROOT)
  # nvidia-cublas (CUDA 13: nvidia/cu13/) or nvidia-cublas-cu12 (nvidia/cublas/), matching the toolkit's major version.
  # Prints the folder and its package path (nvidia/cu13), which is where the wheel puts it in any site-packages.
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "
import importlib, os, sys
for name in ('nvidia.cu${CUDAToolkit_VERSION_MAJOR}', 'nvidia.cublas'):
    try:
        roots = importlib.import_module(name).__path__
    except ImportError:
        continue
    for root in roots:
        if os.path.exists(os.path.join(root, 'include', 'cublasLt.h')):
            print(root + ';' + name.replace('.', '/'))
            sys.exit()
"
    OUTPUT_VARIABLE _cublas_wheel OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_cublas_wheel)
    list(GET _cublas_wheel 0 XLA_FP4_CUBLAS_ROOT)
    list(GET _cublas_wheel 1 _cublas_package_path)
  endif()
endif()
if(XLA_FP4_CUBLAS_ROOT)
  find_library(XLA_FP4_CUBLASLT_LIBRARY
    NAMES cublasLt "libcublasLt.so.${CUDAToolkit_VERSION_MAJOR}"
    PATHS "${XLA_FP4_CUBLAS_ROOT}/lib" NO_DEFAULT_PATH REQUIRED)
  add_library(xla_fp4_cublaslt SHARED IMPORTED)
  set_target_properties(xla_fp4_cublaslt PROPERTIES
    IMPORTED_LOCATION "${XLA_FP4_CUBLASLT_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${XLA_FP4_CUBLAS_ROOT}/include")
  message(STATUS "cuBLASLt: ${XLA_FP4_CUBLASLT_LIBRARY}")
elseif(TARGET CUDA::cublasLt)
  add_library(xla_fp4_cublaslt ALIAS CUDA::cublasLt)
  message(STATUS "cuBLASLt: the CUDA toolkit's")
else()
  message(FATAL_ERROR "cuBLASLt not found: install NVIDIA's wheel into the build environment (CUDA 13: pip install "
                      "'nvidia-cublas==${CUDAToolkit_VERSION_MAJOR}.${CUDAToolkit_VERSION_MINOR}.*'; CUDA 12: "
                      "nvidia-cublas-cu12), or set XLA_FP4_CUBLAS_ROOT")
endif()

add_library(xla_fp4_cuda STATIC
  xla_fp4/cuda/qdq_kernels.cu
  xla_fp4/cuda/packed_kernels.cu
  xla_fp4/cuda/fp4_gemm.cc)
set_target_properties(xla_fp4_cuda PROPERTIES
  POSITION_INDEPENDENT_CODE ON
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON
  CXX_VISIBILITY_PRESET hidden
  CUDA_VISIBILITY_PRESET hidden)
target_include_directories(xla_fp4_cuda PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}")
target_include_directories(xla_fp4_cuda SYSTEM PRIVATE "${XLA_FFI_INCLUDE_DIR}")
# Bit-exactness with the reference: no fused multiply-add contraction, no fast math (nvcc's default is --fmad=true).
target_compile_options(xla_fp4_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--fmad=false -O3>
  $<$<COMPILE_LANGUAGE:CXX>:-O3 -ffp-contract=off -fno-fast-math>)
# The static runtime: importing the extension needs no libcudart; the driver is loaded on first use only.
target_link_libraries(xla_fp4_cuda PUBLIC CUDA::cudart_static xla_fp4_cublaslt)

target_sources(_xla_fp4_ext PRIVATE xla_fp4/cuda/bindings.cc)
target_compile_definitions(_xla_fp4_ext PRIVATE XLA_FP4_WITH_CUDA)
target_link_libraries(_xla_fp4_ext PRIVATE xla_fp4_cuda)
if(XLA_FP4_CUBLASLT_LIBRARY)
  # Installed, site-packages/xla_fp4/_xla_fp4_ext.so finds the wheel's site-packages/nvidia/cu13/lib (where JAX's CUDA
  # plugin loads it from too); the configure-time folder is the fallback.
  get_filename_component(_cublas_dir "${XLA_FP4_CUBLASLT_LIBRARY}" DIRECTORY)
  set(_rpath "${_cublas_dir}")
  if(_cublas_package_path)
    set(_rpath "$ORIGIN/../${_cublas_package_path}/lib;${_rpath}")
  endif()
  set_target_properties(_xla_fp4_ext PROPERTIES BUILD_RPATH "${_cublas_dir}" INSTALL_RPATH "${_rpath}")
endif()
