# Optional Parquet input: Apache Arrow C++ (libarrow, libparquet and their headers) from the
# pyarrow wheel in TITAN_PYTHON's environment. Debian 12 packages no Arrow. The wheel's
# libraries carry versioned names only (libarrow.so.2600), so we link those files directly.
#
# Sets TITAN_HAVE_PARQUET (ON/OFF), TITAN_ARROW_INCLUDE, TITAN_ARROW_LIB_DIR and
# TITAN_ARROW_LIBRARIES. Turn off with -DTITAN_ENABLE_PARQUET=OFF.
option(TITAN_ENABLE_PARQUET "Read Parquet input through the pyarrow wheel's Arrow C++" ON)
set(TITAN_HAVE_PARQUET OFF)
set(_why "")
if(NOT TITAN_ENABLE_PARQUET)
  set(_why "TITAN_ENABLE_PARQUET=OFF")
elseif(NOT TITAN_PYTHON)
  set(_why "no TITAN_PYTHON given")
else()
  execute_process(
    COMMAND "${TITAN_PYTHON}" -c
      "import pyarrow; print(pyarrow.get_include()); print(pyarrow.get_library_dirs()[0]); print(pyarrow.__version__)"
    OUTPUT_VARIABLE _out RESULT_VARIABLE _rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT _rc EQUAL 0)
    set(_why "${TITAN_PYTHON} cannot import pyarrow")
  else()
    string(REPLACE "\n" ";" _out "${_out}")
    list(GET _out 0 TITAN_ARROW_INCLUDE)
    list(GET _out 1 TITAN_ARROW_LIB_DIR)
    list(GET _out 2 _pyarrow_version)
    # libarrow.so.NNNN and libparquet.so.NNNN (not the libarrow_python.* bindings).
    file(GLOB _arrow "${TITAN_ARROW_LIB_DIR}/libarrow.so.[0-9]*")
    file(GLOB _parquet "${TITAN_ARROW_LIB_DIR}/libparquet.so.[0-9]*")
    list(SORT _arrow)
    list(SORT _parquet)
    if(NOT _arrow OR NOT _parquet OR NOT EXISTS "${TITAN_ARROW_INCLUDE}/parquet/arrow/reader.h")
      set(_why "pyarrow ${_pyarrow_version} ships no libarrow/libparquet with headers")
    else()
      list(GET _arrow 0 _arrow)
      list(GET _parquet 0 _parquet)
      set(TITAN_ARROW_LIBRARIES "${_parquet};${_arrow}")
      # The wheel must use the same C++ ABI as LibTorch (_GLIBCXX_USE_CXX11_ABI from
      # TORCH_CXX_FLAGS; empty means the compiler's default, the C++11 ABI): linking a call
      # that takes a std::string proves it. Arrow 26's headers need C++20 (std::span), so
      # the one file that includes them is compiled as C++20 (see CMakeLists.txt).
      include(CheckCXXSourceCompiles)
      set(_std ${CMAKE_CXX_STANDARD})
      set(CMAKE_CXX_STANDARD 20)  # try_compile would otherwise add the project's -std=c++17
      set(CMAKE_REQUIRED_FLAGS "${TORCH_CXX_FLAGS}")
      set(CMAKE_REQUIRED_INCLUDES "${TITAN_ARROW_INCLUDE}")
      set(CMAKE_REQUIRED_LIBRARIES "${TITAN_ARROW_LIBRARIES}")
      check_cxx_source_compiles([[
        #include <parquet/arrow/reader.h>
        int main() {
          parquet::arrow::FileReaderBuilder b;
          return b.OpenFile(std::string("x.parquet")).ok() ? 0 : 1;
        }]] TITAN_ARROW_ABI_OK)
      set(CMAKE_CXX_STANDARD ${_std})
      unset(CMAKE_REQUIRED_FLAGS)
      unset(CMAKE_REQUIRED_INCLUDES)
      unset(CMAKE_REQUIRED_LIBRARIES)
      if(TITAN_ARROW_ABI_OK)
        set(TITAN_HAVE_PARQUET ON)
      else()
        set(_why "pyarrow ${_pyarrow_version}'s libparquet does not compile and link as C++20 with LibTorch's ABI flags ('${TORCH_CXX_FLAGS}'); see CMakeFiles/CMakeError.log")
      endif()
    endif()
  endif()
endif()
if(TITAN_HAVE_PARQUET)
  message(STATUS "Parquet input: ON (Arrow C++ from pyarrow ${_pyarrow_version}: ${TITAN_ARROW_LIB_DIR})")
else()
  message(STATUS "Parquet input: OFF (${_why}); .parquet inputs will be refused")
endif()
