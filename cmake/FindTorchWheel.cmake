# Locate LibTorch: -DTorch_DIR / $Torch_DIR, $LIBTORCH, or the torch wheel of
# TITAN_PYTHON (the set-up venv). Works around the wheel's CUDA config pitfalls so that it
# configures and links on a machine without a GPU.
if(NOT Torch_DIR AND DEFINED ENV{Torch_DIR})
  set(Torch_DIR $ENV{Torch_DIR})
endif()
if(NOT Torch_DIR AND DEFINED ENV{LIBTORCH})
  set(Torch_DIR $ENV{LIBTORCH}/share/cmake/Torch)
endif()
if(NOT Torch_DIR)
  if(NOT TITAN_PYTHON)
    set(TITAN_PYTHON $ENV{TITAN_PYTHON} CACHE FILEPATH "Python whose torch wheel provides LibTorch")
  endif()
  if(NOT TITAN_PYTHON)
    message(FATAL_ERROR "LibTorch not found: run scripts/setup.sh, or pass -DTorch_DIR=<libtorch>/share/cmake/Torch")
  endif()
  execute_process(COMMAND ${TITAN_PYTHON} -c "import torch,os;print(os.path.join(torch.utils.cmake_prefix_path,'Torch'))"
    OUTPUT_VARIABLE _titan_torch_dir OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${TITAN_PYTHON} cannot import torch; run scripts/setup.sh")
  endif()
  set(Torch_DIR ${_titan_torch_dir} CACHE PATH "LibTorch's share/cmake/Torch" FORCE)
endif()
get_filename_component(TITAN_TORCH_ROOT "${Torch_DIR}/../../.." ABSOLUTE)
set(TITAN_TORCH_LIB_DIR "${TITAN_TORCH_ROOT}/lib")

if(NOT TORCH_CUDA_ARCH_LIST)
  set(TORCH_CUDA_ARCH_LIST "8.0;9.0")  # keeps nvcc from building for a dozen targets
endif()

# Pitfall 1: CUDA 13 has no libnvToolsExt; the config then wants the header-only nvtx3.
# Point it at the toolkit's (or the wheel's nvidia-nvtx) copy.
if(NOT nvtx3_dir)
  find_path(nvtx3_dir NAMES nvtx3/nvToolsExt.h
    PATHS /usr/local/cuda/include ${TITAN_TORCH_ROOT}/../nvidia/cu13/include NO_DEFAULT_PATH)
endif()
# Pitfall 2: it asks for cuDNN / cuSPARSELt / NVSHMEM only as optional extras; keep them off.
set(CAFFE2_USE_CUDNN OFF CACHE BOOL "")
set(CAFFE2_USE_CUSPARSELT OFF CACHE BOOL "")
set(USE_NVSHMEM OFF CACHE BOOL "")

find_package(Torch REQUIRED CONFIG)
message(STATUS "LibTorch ${Torch_VERSION} from ${TITAN_TORCH_ROOT}")

# TORCH_CXX_FLAGS carries the ABI define; split it into a list for target_compile_options.
separate_arguments(TITAN_TORCH_CXX_FLAGS UNIX_COMMAND "${TORCH_CXX_FLAGS}")

# Pitfall 3: ProcessGroupNCCL's headers include nccl.h, which must be the version the wheel
# was built with. Prefer the wheel's nvidia-nccl headers over the toolkit's.
find_path(TITAN_NCCL_INCLUDE nccl.h
  PATHS ${TITAN_TORCH_ROOT}/../nvidia/nccl/include /usr/local/cuda/include NO_DEFAULT_PATH)
if(TITAN_NCCL_INCLUDE)
  file(STRINGS ${TITAN_NCCL_INCLUDE}/nccl.h _titan_nccl_v REGEX "#define NCCL_(MAJOR|MINOR|PATCH) ")
  string(REGEX REPLACE "[^0-9;]" "" _titan_nccl_v "${_titan_nccl_v}")
  string(REPLACE ";" "." _titan_nccl_v "${_titan_nccl_v}")
  message(STATUS "nccl.h ${_titan_nccl_v} from ${TITAN_NCCL_INCLUDE}")
endif()

# The wheel's libraries find their CUDA dependencies through their own RUNPATH; on a
# machine without a GPU the linker only needs to see them.
foreach(d cu13 nccl cudnn cusparselt nvshmem)
  if(EXISTS ${TITAN_TORCH_ROOT}/../nvidia/${d}/lib)
    list(APPEND TITAN_TORCH_RPATH_LINK ${TITAN_TORCH_ROOT}/../nvidia/${d}/lib)
  endif()
endforeach()
foreach(d ${TITAN_TORCH_RPATH_LINK})
  string(APPEND CMAKE_EXE_LINKER_FLAGS " -Wl,-rpath-link,${d}")
  string(APPEND CMAKE_SHARED_LINKER_FLAGS " -Wl,-rpath-link,${d}")
endforeach()
