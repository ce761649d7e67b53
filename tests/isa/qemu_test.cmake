# The installed tree on an emulated CPU: qemu-x86_64 (user mode) with a CPU
# model whose instruction set is a level's (Haswell: avx2; Nehalem: SSE4.2,
# baseline) runs the CLI and the Python package, so every kernel that runs
# must be one that CPU has: anything else is SIGILL. Checks that
#   (a) `attnkit --version` reports the level the CPU model has;
#   (b) `attnkit bench` over every mechanism of the registry, forward and
#       forward_backward, float32 and bfloat16, runs each row on that level
#       (the kernels' dispatch_isa) within the bench's own error bounds;
#   (c) tests/isa/smoke.py: the Python ops against float64 composites.
#
#   cmake -DBUILD_DIR=<build> -DPREFIX=<scratch prefix> [-DQEMU=<qemu-x86_64>]
#         -DCPU=Haswell -DEXPECT=avx2 -DPYTHON=/usr/bin/python3 -P tests/isa/qemu_test.cmake
#
# BUILD_DIR is installed into PREFIX first (cmake --install); without it PREFIX
# must already hold an installed tree. Without QEMU, qemu-x86_64 is searched
# for on the PATH; not finding it fails the test.
cmake_minimum_required(VERSION 3.25)  # policies of a -P script (IN_LIST)
include(${CMAKE_CURRENT_LIST_DIR}/../cli/common.cmake)
foreach(var PREFIX CPU EXPECT PYTHON)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "qemu_test.cmake needs -D${var}=...")
  endif()
endforeach()
if(NOT QEMU)  # not given, or not found when CMake configured: search again
  find_program(QEMU qemu-x86_64)
endif()
if(NOT QEMU)
  message(FATAL_ERROR "qemu-x86_64 not found: run scripts/install-deps (Debian package qemu-user)")
endif()

if(DEFINED BUILD_DIR)
  file(REMOVE_RECURSE ${PREFIX})
  execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${PREFIX}
                  RESULT_VARIABLE rc OUTPUT_QUIET)
  if(rc)
    message(FATAL_ERROR "cmake --install ${BUILD_DIR} --prefix ${PREFIX} failed: ${rc}")
  endif()
endif()
set(cli ${PREFIX}/bin/attnkit)
set(python_path ${PREFIX}/lib/attnkit/python)
if(NOT EXISTS ${cli} OR NOT EXISTS ${python_path}/attnkit/__init__.py)
  message(FATAL_ERROR "${PREFIX} is not an installed tree: no bin/attnkit or "
                      "lib/attnkit/python/attnkit")
endif()

# Runs ARGN under qemu with the CPU model, in an environment where nothing but
# the CPU decides the level (no cap, the installed library only, and OpenBLAS,
# libtorch's BLAS, choosing its kernels from the emulated CPU: an
# OPENBLAS_CORETYPE left in the caller's environment, e.g. Haswell, would run
# AVX2 code on an emulated Nehalem and fail the test for OpenBLAS's sake). Sets `out`
# to the stdout; fails the test, saying what happened, unless the exit is 0.
function(run_emulated what)
  string(TIMESTAMP start "%s")
  execute_process(
    COMMAND ${CMAKE_COMMAND} -E env --unset=ATTNKIT_MAX_ISA --unset=ONEDNN_MAX_CPU_ISA
            --unset=DNNL_MAX_CPU_ISA --unset=ATTNKIT_LIBRARY --unset=LD_LIBRARY_PATH --unset=OPENBLAS_CORETYPE
            PYTHONPATH=${python_path} ${QEMU} -cpu ${CPU} ${ARGN}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(TIMESTAMP end "%s")
  math(EXPR seconds "${end} - ${start}")
  # qemu warns about every CPUID bit of the model that TCG cannot emulate
  # (pcid, x2apic, ...): none of them is an instruction set extension.
  string(REGEX REPLACE "qemu-x86_64: warning: TCG doesn't support requested feature[^\n]*\n" ""
         err "${err}")
  if(NOT rc STREQUAL "0")
    if(rc MATCHES "^[0-9]+$" AND NOT err MATCHES "uncaught target signal")
      set(why "exit status ${rc}")
    elseif(rc MATCHES "Illegal instruction" OR err MATCHES "uncaught target signal 4 ")
      string(CONCAT why "SIGILL: it ran an instruction a ${CPU} CPU does not have (a kernel "
             "above the level ${EXPECT}, or code outside the level namespaces compiled for one: "
             "tests/isa/no_stray_instructions.py names such code)")
    else()
      set(why "killed by a signal: ${rc}")
    endif()
    string(JOIN " " command ${ARGN})
    message(FATAL_ERROR "${what} under qemu-x86_64 -cpu ${CPU} failed after ${seconds} s, ${why}:\n"
                        "${command}\n${out}\n${err}")
  endif()
  message(STATUS "${what} under qemu -cpu ${CPU}: ${seconds} s")
  set(out "${out}" PARENT_SCOPE)
endfunction()

# (a) The level the CPU model has.
run_emulated("attnkit --version" ${cli} --version)
if(NOT out MATCHES "^attnkit [0-9]+\\.[0-9]+\\.[0-9]+\nisa: ${EXPECT}( |\n|$)")
  message(FATAL_ERROR "attnkit --version on a ${CPU} CPU should report 'isa: ${EXPECT} ...':\n${out}")
endif()
message(STATUS "${out}")

# (b) The bench over every mechanism the registry lists: `attnkit mechanisms`
# prints one line per mechanism, `  <name>  <supports: one letter or '-' per
# field of nn::support_fields()>  <summary>`, its options indented further.
# The letter count follows the registry's field list, so it is not fixed here.
run_emulated("attnkit mechanisms" ${cli} mechanisms)
string(REGEX MATCHALL "\n  [^ \n]+ +[A-Za-z-]+  " lines "${out}")
set(mechanisms "")
foreach(line IN LISTS lines)
  string(REGEX REPLACE "^\n  ([^ ]+) .*" "\\1" name "${line}")
  list(APPEND mechanisms ${name})
endforeach()
foreach(name full linear agglomerative clustered sparse-local)
  if(NOT name IN_LIST mechanisms)
    message(FATAL_ERROR "'${name}' is not among the mechanisms read from `attnkit mechanisms` "
                        "(has its format changed?): ${mechanisms}\n${out}")
  endif()
endforeach()
list(LENGTH mechanisms count)
string(JOIN "," attention ${mechanisms})
set(json ${PREFIX}/bench-${CPU}.json)
file(REMOVE ${json})
# Length 31: odd, as sparse-bp-tree needs (2t - 1 nodes); not a multiple of
# the 8 or 16 lanes, so the kernels' vector loops and their tails both run.
run_emulated("attnkit bench (${count} mechanisms)" ${cli} bench --attention ${attention} --impl fast
             --pass forward,forward_backward --dtype float32,bfloat16 --lengths 31 --heads 2 --no-peak
             --head-dim 16 --threads 1 --repeats 1 --json ${json})
set(bench_table "${out}")
file(READ ${json} doc)
read_fields("${doc}" machine isa)
if(NOT isa STREQUAL EXPECT)
  message(FATAL_ERROR "bench: the machine record says isa '${isa}', expected '${EXPECT}'")
endif()
# One row per mechanism, pass and dtype: a row the bench skipped (an error, a
# refusal) is missing from the JSON and shows in the table as "skipped".
math(EXPR rows "${count} * 4")
string(JSON n LENGTH "${doc}" results)
if(NOT n EQUAL rows)
  message(FATAL_ERROR "bench: ${n} rows in ${json}, expected ${rows} (${count} mechanisms x 2 passes "
                      "x 2 dtypes):\n${bench_table}")
endif()
math(EXPR last "${rows} - 1")
foreach(i RANGE ${last})
  read_fields("${doc}" "results;${i}" attention run impl dispatch_isa pass dtype ms err)
  set(row "row ${i} (${attention} ${pass} ${dtype}: ${impl} ${dispatch_isa})")
  if(NOT ms GREATER 0)
    message(FATAL_ERROR "${row} has ms=${ms}")
  endif()
  # Every float32 row runs a kernel (but `none`, the control without
  # attention, which copies the values), and a kernel runs at the CPU's level.
  if(dtype STREQUAL "float32" AND NOT impl STREQUAL "kernel" AND NOT attention STREQUAL "none")
    message(FATAL_ERROR "${row}: the float32 op should run its kernel")
  endif()
  if(impl STREQUAL "kernel" AND NOT dispatch_isa STREQUAL EXPECT)
    message(FATAL_ERROR "${row}: a kernel ran at '${dispatch_isa}' on a ${CPU} CPU (${EXPECT})")
  endif()
  # err: against the mechanism's own float64 definition on the same inputs.
  # float32: rounding only, tests/cli/bench_test.cmake's bound. bfloat16: the
  # results rounded to 8 significant bits (2^-9 relative), and on the
  # composite paths (agglomerative, clustered) every intermediate too.
  # Measured on avx2 and baseline: at most 6e-3 on the kernels' paths, 1.3e-2
  # on the composite ones; a kernel that is wrong anywhere is off by O(1).
  if(dtype STREQUAL "float32")
    set(bound 1e-4)
  else()
    set(bound 5e-2)
  endif()
  if(NOT err LESS bound)
    message(FATAL_ERROR "${row} is off its float64 definition: err ${err} (bound ${bound})\n"
                        "${bench_table}")
  endif()
endforeach()
message(STATUS "bench: ${rows} rows of ${count} mechanisms on ${EXPECT}, within their bounds")

# (c) The Python ops, from the installed package with the installed library.
run_emulated("tests/isa/smoke.py" ${PYTHON} ${CMAKE_CURRENT_LIST_DIR}/smoke.py ${EXPECT})
message(STATUS "${out}")
string(FIND "${out}" ", ${PREFIX}/lib/libattnkit.so" at)
if(at EQUAL -1)
  message(FATAL_ERROR "smoke.py should have loaded ${PREFIX}/lib/libattnkit.so:\n${out}")
endif()
