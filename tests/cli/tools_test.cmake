# Runs the CLI's other subcommands as a user would, with tiny sizes, and checks
# their help, their refusals and their JSON (fields, mechanism names from the
# registry: "full", never "exact"; identities that tie the numbers to the
# mechanisms). Variables: CLI (the attnkit binary), OUT_DIR (scratch folder).
include(${CMAKE_CURRENT_LIST_DIR}/common.cmake)

function(require_no_exact json what)
  string(FIND "${json}" "exact" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "${what} names a mechanism 'exact' (the registry says 'full'):\n${json}")
  endif()
endfunction()

file(MAKE_DIRECTORY ${OUT_DIR})
set(subcommands bench bench-dense mechanisms figure-agglomerative figure-clustered approx bench-lookup)

# Help: the tool lists every subcommand, and each has its own help.
run_ok(${CLI} --help)
foreach(sub ${subcommands})
  if(NOT out MATCHES "\n  ${sub} ")
    message(FATAL_ERROR "'attnkit --help' does not list ${sub}:\n${out}")
  endif()
endforeach()
foreach(sub ${subcommands})
  run_ok(${CLI} ${sub} --help)
  if(NOT out MATCHES "Usage: .*${sub}")
    message(FATAL_ERROR "'attnkit ${sub} --help' is not its help:\n${out}")
  endif()
endforeach()

# ---------------------------------------------------------------------------
# figure-clustered: the default mechanisms (the registry's full, clustered,
# improved-clustered) over two tiny lengths.
set(fig ${OUT_DIR}/figure-clustered.json)
file(REMOVE ${fig})
run_ok(${CLI} figure-clustered --lengths 64,32 --heads 2 --dim 8 --repeats 1 --max-seconds 60
       --threads 1 --json ${fig})
file(READ ${fig} json)
require_no_exact("${json}" "figure-clustered's JSON")
read_fields("${json}" config N H E attention threads load_average_at_start load_average_at_end)
require_length("${json}" 3 "figure-clustered config.attention" config attention)
string(JSON first GET "${json}" config attention 0)
string(JSON improved GET "${json}" config attention 2)
if(NOT first STREQUAL "full" OR NOT improved MATCHES "^improved-clustered:.*topk=32")
  message(FATAL_ERROR "figure-clustered config.attention: '${first}', '${improved}'")
endif()
# 3 mechanisms x 2 lengths.
require_length("${json}" 6 "figure-clustered rows" rows)
set(expected full clustered improved-clustered full clustered improved-clustered)
foreach(i RANGE 5)
  read_fields("${json}" "rows;${i}" attention L ms us_per_element peak_bytes bytes_per_element runs)
  list(GET expected ${i} want)
  if(NOT attention STREQUAL want OR ms LESS_EQUAL 0 OR peak_bytes LESS_EQUAL 0)
    message(FATAL_ERROR "figure-clustered row ${i}: ${attention} (want ${want}) L=${L} ms=${ms} peak=${peak_bytes}")
  endif()
  if(i LESS 3 AND NOT L EQUAL 32)
    message(FATAL_ERROR "figure-clustered: rows not sorted by length (row ${i} has L = ${L})")
  endif()
endforeach()
foreach(m clustered improved-clustered)
  string(JSON crossover ERROR_VARIABLE missing GET "${json}" summary crossover ${m})
  if(missing)
    message(FATAL_ERROR "figure-clustered summary lacks the crossover of ${m}: ${missing}")
  endif()
endforeach()
# Settings come from spec strings; a bad one is refused before any work.
run_refused("accepted: clusters" ${CLI} figure-clustered --attention full,clustered:topk=3)
run_refused("nosuch" ${CLI} figure-clustered --attention nosuch)

# ---------------------------------------------------------------------------
# approx: the default sweep shape over tiny sizes. improved-clustered with
# topk = S attends to every key exactly, so it must equal full attention.
set(approx ${OUT_DIR}/approx.json)
file(REMOVE ${approx})
run_ok(${CLI} approx --length 32 --heads 2 --dim 8 --clusters 4,8,64 --topk 4,32,64 --threads 1
       --json ${approx})
file(READ ${approx} json)
require_no_exact("${json}" "approx's JSON")
read_fields("${json}" config H L E centres seed)
# C in {4, 8} (64 > L is left out) x (clustered, improved k = 4, 32; 64 > L
# left out) x 2 input sets.
require_length("${json}" 12 "approx rows" rows)
foreach(i RANGE 11)
  read_fields("${json}" "rows;${i}" inputs attention spec clusters topk rel_err row_l1)
  set(row "approx row ${i} (${spec})")
  if(NOT spec MATCHES "^${attention}:clusters=[48],bits=63,iterations=10")
    message(FATAL_ERROR "${row}: spec does not match attention '${attention}'")
  endif()
  if(attention STREQUAL "clustered")
    if(NOT topk EQUAL 0 OR NOT rel_err GREATER 1e-3 OR NOT row_l1 GREATER 1e-3)
      message(FATAL_ERROR "${row}: clustered with C < L should be off full attention: topk=${topk} rel=${rel_err} l1=${row_l1}")
    endif()
  elseif(attention STREQUAL "improved-clustered" AND topk EQUAL 32)
    if(NOT rel_err LESS 1e-5 OR NOT row_l1 LESS 1e-5)
      message(FATAL_ERROR "${row}: topk = S must equal full attention: rel=${rel_err} l1=${row_l1}")
    endif()
  elseif(NOT (attention STREQUAL "improved-clustered" AND topk EQUAL 4))
    message(FATAL_ERROR "${row}: unexpected row")
  endif()
endforeach()
# Any comparable spec: full itself is full attention to float32 rounding.
run_ok(${CLI} approx --length 16 --heads 1 --dim 4 --attention full --threads 1 --json ${approx})
file(READ ${approx} json)
read_fields("${json}" "rows;0" rel_err)
string(JSON clusters TYPE "${json}" rows 0 clusters)
if(NOT rel_err LESS 1e-5 OR NOT clusters STREQUAL "NULL")
  message(FATAL_ERROR "approx --attention full: rel_err ${rel_err}, clusters ${clusters}")
endif()
run_refused("excludes|Excludes" ${CLI} approx --attention clustered --clusters 4)
run_refused("approx compares mechanisms on q, k, v" ${CLI} approx --length 16 --attention agglomerative)
run_refused("every cluster count exceeds" ${CLI} approx --length 16 --clusters 32)

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
