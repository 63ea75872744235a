# The CUDA kernels and the cuBLASLt FP4 GEMM, as the extension module xla_fp4._xla_fp4_cuda. Included by
# CMakeLists.txt (XLA_FP4_CUDA AUTO or ON) after Python_EXECUTABLE and XLA_FFI_INCLUDE_DIR exist; sets
# XLA_FP4_CUDA_STATUS. AUTO builds the kernels when nvcc >= 12.8 and cuBLASLt are found and otherwise says in one line
# why not; ON makes each missing piece an error.
#
# The kernels build into a static library of their own so that the host-compiler flags of the extension never reach
# nvcc. cuBLASLt comes from NVIDIA's wheel (the CUDA toolkit may not ship it): the one in the environment being
# installed into (under pip's build isolation the interpreter's prefix is still that environment), else the build
# environment's, else the toolkit's; XLA_FP4_CUBLAS_ROOT (a folder with include/cublasLt.h and lib/) overrides them.

macro(xla_fp4_without_cuda reason)
  if(XLA_FP4_CUDA STREQUAL "ON")
    message(FATAL_ERROR "XLA_FP4_CUDA=ON but ${reason}")
  endif()
  set(XLA_FP4_CUDA_STATUS "not built: ${reason}")
  message(WARNING "xla_fp4: building without the CUDA kernels: ${reason}")
  return()  # from this file: CMakeLists.txt goes on with the CPU kernels
endmacro()

if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
  find_program(XLA_FP4_NVCC nvcc PATHS /usr/local/cuda/bin NO_CACHE)
  if(XLA_FP4_NVCC)
    set(ENV{CUDACXX} "${XLA_FP4_NVCC}")
  endif()
endif()
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  xla_fp4_without_cuda("no working CUDA compiler (nvcc) was found: put nvcc on PATH or set CUDACXX")
endif()
execute_process(COMMAND "${CMAKE_CUDA_COMPILER}" --version OUTPUT_VARIABLE _nvcc_version)
string(REGEX MATCH "release ([0-9]+)\\.([0-9]+)" _ "${_nvcc_version}")
set(_cuda_version "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}")
if(NOT CMAKE_MATCH_1 OR _cuda_version VERSION_LESS 12.8)
  xla_fp4_without_cuda("${CMAKE_CUDA_COMPILER} is CUDA '${_cuda_version}'; the FP4 types need CUDA 12.8 or newer")
endif()
set(_cuda_major "${CMAKE_MATCH_1}")

set(XLA_FP4_CUBLAS_ROOT "" CACHE PATH "Folder with include/cublasLt.h and lib/libcublasLt.so* (default: the wheel)")
if(NOT XLA_FP4_CUBLAS_ROOT)
  # nvidia-cublas (CUDA 13: nvidia/cu13/) or nvidia-cublas-cu12 (nvidia/cublas/), matching the toolkit's major version.
  # Prints the folder and its package path (nvidia/cu13), which is where the wheel puts it in any site-packages.
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "
import importlib, os, sys, sysconfig
packages = ('nvidia/cu${_cuda_major}', 'nvidia/cublas')
target = [sysconfig.get_paths()[k] for k in ('purelib', 'platlib')]
build = []
for name in packages:
    try:
        build += list(importlib.import_module(name.replace('/', '.')).__path__)
    except ImportError:
        pass
for root in target + build:
    for package in packages:
        folder = root if root.endswith(package) else os.path.join(root, package)
        if os.path.exists(os.path.join(folder, 'include', 'cublasLt.h')):
            print(folder + ';' + package)
            sys.exit()
"
    OUTPUT_VARIABLE _cublas_wheel OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_cublas_wheel)
    list(GET _cublas_wheel 0 XLA_FP4_CUBLAS_ROOT)
    list(GET _cublas_wheel 1 _cublas_package_path)
  endif()
endif()

if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  # sm_90 SASS + PTX (Hopper), sm_100 SASS + PTX: Blackwell 10.0 (B200, GB200) and 10.3 (B300, GB300) run the sm_100
  # SASS (a cubin runs on its major version's later minors; the kernels use nothing arch-specific, so no "a" variant,
  # whose SASS loads on 10.0 only), later GPUs JIT the compute_100 PTX (12.x: the kernels run, the FP4 GEMM's gate
  # refuses, so the emulate backend runs). -DCMAKE_CUDA_ARCHITECTURES or the CUDAARCHS environment variable overrides.
  if(DEFINED ENV{CUDAARCHS})
    set(CMAKE_CUDA_ARCHITECTURES "$ENV{CUDAARCHS}")
  else()
    set(CMAKE_CUDA_ARCHITECTURES "90;100")
  endif()
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

if(XLA_FP4_CUBLAS_ROOT)
  find_library(XLA_FP4_CUBLASLT_LIBRARY
    NAMES cublasLt "libcublasLt.so.${CUDAToolkit_VERSION_MAJOR}"
    PATHS "${XLA_FP4_CUBLAS_ROOT}/lib" NO_DEFAULT_PATH)
  if(NOT XLA_FP4_CUBLASLT_LIBRARY)
    xla_fp4_without_cuda("${XLA_FP4_CUBLAS_ROOT} has include/cublasLt.h but no lib/libcublasLt.so*")
  endif()
  add_library(xla_fp4_cublaslt SHARED IMPORTED)
  set_target_properties(xla_fp4_cublaslt PROPERTIES
    IMPORTED_LOCATION "${XLA_FP4_CUBLASLT_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${XLA_FP4_CUBLAS_ROOT}/include")
  message(STATUS "cuBLASLt: ${XLA_FP4_CUBLASLT_LIBRARY}")
elseif(TARGET CUDA::cublasLt)
  add_library(xla_fp4_cublaslt ALIAS CUDA::cublasLt)
  message(STATUS "cuBLASLt: the CUDA toolkit's")
else()
  # One argument: the macro takes one reason (a second string would be dropped, as it once was, mid-sentence).
  set(_reason "cuBLASLt was not found: install NVIDIA's wheel into the environment (CUDA 13: pip install ")
  string(APPEND _reason "'nvidia-cublas==${_cuda_version}.*'; CUDA 12: nvidia-cublas-cu12), or set XLA_FP4_CUBLAS_ROOT")
  xla_fp4_without_cuda("${_reason}")
endif()
message(STATUS "CUDA ${CUDAToolkit_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}")

# The kernels and the GEMM: xla_fp4/cuda/CMakeLists.txt (a folder of its own, as the CPU kernels: reinstalls reuse
# them); its include folders come with it.
add_subdirectory(xla_fp4/cuda)

nanobind_add_module(_xla_fp4_cuda NB_STATIC STABLE_ABI xla_fp4/cuda/bindings.cc)
target_link_libraries(_xla_fp4_cuda PRIVATE xla_fp4_cuda)
if(XLA_FP4_CUBLASLT_LIBRARY)
  # Installed, site-packages/xla_fp4/_xla_fp4_cuda.so finds the wheel's site-packages/nvidia/cu13/lib (where JAX's CUDA
  # plugin loads it from too); the configure-time folder is the fallback.
  get_filename_component(_cublas_dir "${XLA_FP4_CUBLASLT_LIBRARY}" DIRECTORY)
  set(_rpath "${_cublas_dir}")
  if(_cublas_package_path)
    set(_rpath "$ORIGIN/../${_cublas_package_path}/lib;${_rpath}")
  endif()
  set_target_properties(_xla_fp4_cuda PROPERTIES BUILD_RPATH "${_cublas_dir}" INSTALL_RPATH "${_rpath}")
endif()
install(TARGETS _xla_fp4_cuda LIBRARY DESTINATION xla_fp4)
string(REPLACE ";" ", sm_" _archs "${CMAKE_CUDA_ARCHITECTURES}")
set(XLA_FP4_CUDA_STATUS "built for sm_${_archs} with CUDA ${CUDAToolkit_VERSION}")
