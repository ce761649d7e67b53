# Compiles the torch-free code (src/base, src/kernels) for aarch64 with Debian's cross
# compiler, as CMakeLists.txt builds them on a CPU that is not x86-64: the
# sources compiled once as they are, the float32 level sources once, at
# isa_baseline (their scalar paths), the amx level sources not at all. Compile
# only: nothing is linked or run. It fails on any error, which is what an
# x86-only include or intrinsic outside an `#if defined(__x86_64__)` (or a
# __AVX2__ / __AVX512F__ test) gives.
#
#   cmake -DSOURCE_DIR=<repository> -DWORK_DIR=<scratch dir> [-DCXX=aarch64-linux-gnu-g++]
#         -P tests/isa/aarch64_compile.cmake
#
# The source lists are read from CMakeLists.txt itself, and must cover every
# file of src/base, src/kernels and src/kernels/common (as CMakeLists.txt also checks):
# a file this script does not know of fails it rather than going unchecked.
cmake_minimum_required(VERSION 3.25)  # policies of a -P script (IN_LIST)
foreach(var SOURCE_DIR WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "aarch64_compile.cmake needs -D${var}=...")
  endif()
endforeach()
if(NOT CXX)
  find_program(CXX aarch64-linux-gnu-g++)
endif()
if(NOT CXX)
  message(FATAL_ERROR "aarch64-linux-gnu-g++ not found: run scripts/install-deps "
                      "(Debian package g++-aarch64-linux-gnu)")
endif()

# The list `name` of CMakeLists.txt: `set(name  # comment\n  a b\n  c)`.
file(READ ${SOURCE_DIR}/CMakeLists.txt top)
function(read_source_list name)
  string(REGEX MATCH "\nset\\(${name}[ \t\n][^)]*\\)" block "${top}")
  if(NOT block)
    message(FATAL_ERROR "CMakeLists.txt has no set(${name} ...): has the list been renamed?")
  endif()
  string(REGEX REPLACE "#[^\n]*" "" block "${block}")  # comments
  string(REGEX REPLACE "^\nset\\(${name}|\\)$" "" block "${block}")
  string(REGEX MATCHALL "[^ \t\n]+" files "${block}")
  if(NOT files)
    message(FATAL_ERROR "CMakeLists.txt: ${name} is empty")
  endif()
  set(${name} ${files} PARENT_SCOPE)
endfunction()
read_source_list(ATTNKIT_ONCE_SOURCES)           # compiled once: isa_generic
read_source_list(ATTNKIT_FLOAT32_LEVEL_SOURCES)  # at isa_baseline only
read_source_list(ATTNKIT_AMX_LEVEL_SOURCES)      # not built on other architectures

file(GLOB on_disk RELATIVE ${SOURCE_DIR} ${SOURCE_DIR}/src/base/*.cpp ${SOURCE_DIR}/src/kernels/*.cpp
     ${SOURCE_DIR}/src/kernels/common/*.cpp)
set(listed ${ATTNKIT_ONCE_SOURCES} ${ATTNKIT_FLOAT32_LEVEL_SOURCES} ${ATTNKIT_AMX_LEVEL_SOURCES})
foreach(file IN LISTS on_disk)
  if(NOT file IN_LIST listed)
    message(FATAL_ERROR "${file} is in none of the kernel source lists read from CMakeLists.txt")
  endif()
endforeach()
foreach(file IN LISTS listed)
  if(NOT file IN_LIST on_disk)
    message(FATAL_ERROR "CMakeLists.txt lists ${file}, which is not in src/base or src/kernels")
  endif()
endforeach()

# oneDNN's headers are architecture-independent (dnnl_config.h holds only
# the runtime choices), but live in the host's /usr/include, which a cross
# compiler must not search: a directory holding only them.
file(REMOVE_RECURSE ${WORK_DIR})
set(onednn_include ${WORK_DIR}/onednn-include)
file(MAKE_DIRECTORY ${onednn_include})
file(GLOB onednn_headers /usr/include/dnnl*.h /usr/include/dnnl*.hpp)
if(NOT EXISTS /usr/include/oneapi/dnnl/dnnl_config.h OR NOT onednn_headers)
  message(FATAL_ERROR "oneDNN's headers are missing (libdnnl-dev): run scripts/install-deps")
endif()
file(CREATE_LINK /usr/include/oneapi ${onednn_include}/oneapi SYMBOLIC)
foreach(header IN LISTS onednn_headers)
  get_filename_component(name ${header} NAME)
  file(CREATE_LINK ${header} ${onednn_include}/${name} SYMBOLIC)
endforeach()

set(failed "")
set(compiled 0)
foreach(file IN LISTS ATTNKIT_ONCE_SOURCES ATTNKIT_FLOAT32_LEVEL_SOURCES)
  set(defines "")
  if(file IN_LIST ATTNKIT_FLOAT32_LEVEL_SOURCES)
    set(defines -DATTNKIT_ISA_NAMESPACE=isa_baseline)
  endif()
  string(MAKE_C_IDENTIFIER ${file} object)
  execute_process(
    COMMAND ${CXX} -std=c++17 -O1 -Wall -Wextra -fopenmp -c -I ${SOURCE_DIR}/src
            -isystem ${onednn_include} ${defines} ${SOURCE_DIR}/${file} -o ${WORK_DIR}/${object}.o
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc)
    list(APPEND failed ${file})
    message("FAIL ${file}:\n${out}${err}")
  else()
    math(EXPR compiled "${compiled} + 1")
    message("ok   ${file} ${defines}")
    if(err)  # warnings: shown, not fatal (the build does not use -Werror)
      message("${err}")
    endif()
  endif()
endforeach()
list(LENGTH ATTNKIT_AMX_LEVEL_SOURCES skipped)
if(failed)
  message(FATAL_ERROR "these kernel sources do not compile for aarch64: ${failed}")
endif()
message("all ${compiled} kernel sources compile for aarch64 "
        "(${skipped} amx level sources skipped, as on any non-x86 CPU: ${ATTNKIT_AMX_LEVEL_SOURCES})")
