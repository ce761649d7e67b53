# Runs the CLI's subcommands as a user would: each is listed and has its own
# help; bench-lookup with tiny sizes, its refusals and its JSON. Variables: CLI
# (the attnkit binary), OUT_DIR (scratch folder).
include(${CMAKE_CURRENT_LIST_DIR}/common.cmake)

file(MAKE_DIRECTORY ${OUT_DIR})
# Help: the tool lists every subcommand, and each has its own help.
require_subcommands(${CLI} attnkit bench bench-dense mechanisms bench-lookup data train eval generate bench-model)
# The experiments' commands live in attnkit-experiments (experiments/), not here.
foreach(sub cloze node-classify figure-agglomerative figure-clustered approx)
  if(out MATCHES "\n  ${sub} ")
    message(FATAL_ERROR "'attnkit --help' lists the experiment command ${sub}:\n${out}")
  endif()
endforeach()

# ---------------------------------------------------------------------------
# bench-lookup on the thread CPU clock (the public sgemm_peak_gflops(Clock)).
set(lookup ${OUT_DIR}/lookup.json)
file(REMOVE ${lookup})
run_ok(${CLI} bench-lookup --n 32 --k 8 --queries 2,16 --repeats 1 --threads 1 --clock cpu
       --json ${lookup})
file(READ ${lookup} json)
read_fields("${json}" "" clock n k encode_ms predicted_speedup flop_ratio results load_average)
read_fields("${json}" machine sgemm_gflops threads)
if(NOT clock STREQUAL "thread_cpu" OR NOT sgemm_gflops GREATER 0 OR NOT threads EQUAL 1 OR
   NOT predicted_speedup EQUAL 4)
  message(FATAL_ERROR "bench-lookup: clock ${clock}, peak ${sgemm_gflops}, threads ${threads}, n/k ${predicted_speedup}")
endif()
require_length("${json}" 2 "bench-lookup results" results)
foreach(i 0 1)
  read_fields("${json}" "results;${i}" m softmax_ms softmax_best_ms softmax_gflops memory_ms
              memory_best_ms memory_gflops memory_fraction_of_peak speedup speedup_best)
  if(NOT softmax_ms GREATER 0 OR NOT memory_ms GREATER 0)
    message(FATAL_ERROR "bench-lookup result ${i}: softmax_ms ${softmax_ms}, memory_ms ${memory_ms}")
  endif()
endforeach()
string(JSON m GET "${json}" results 1 m)
if(NOT m EQUAL 16)
  message(FATAL_ERROR "bench-lookup: the second result is m = ${m}, not 16")
endif()
run_refused("add --threads 1" ${CLI} bench-lookup --clock cpu --threads 2)
