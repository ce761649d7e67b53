# Runs the CLI as a user would and checks its output and JSON schema.
include(${CMAKE_CURRENT_LIST_DIR}/common.cmake)

run_ok(${CLI} --version)
if(NOT out MATCHES "^attnkit [0-9]+\\.[0-9]+\\.[0-9]+")
  message(FATAL_ERROR "unexpected --version output: ${out}")
endif()
run_ok(${CLI} bench --help)
if(NOT out MATCHES "--attention" OR NOT out MATCHES "--json")
  message(FATAL_ERROR "bench --help lacks options: ${out}")
endif()

# A bad value is refused with a message naming it, and a non-zero exit.
execute_process(COMMAND ${CLI} bench --attention nosuch RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_VARIABLE out)
if(NOT rc OR NOT "${out}${err}" MATCHES "nosuch")
  message(FATAL_ERROR "bench --attention nosuch: rc=${rc} output: ${out}${err}")
endif()

# The registry's table, from both entry points.
foreach(args "mechanisms" "bench;--list")
  run_ok(${CLI} ${args})
  foreach(fragment "full" "improved-clustered" "topk=32" "sparse-local" "span=32" "agglomerative")
    if(NOT out MATCHES "${fragment}")
      message(FATAL_ERROR "'attnkit ${args}' lacks '${fragment}':\n${out}")
    endif()
  endforeach()
endforeach()
# A spec with an unknown option is refused naming the accepted ones.
execute_process(COMMAND ${CLI} bench --attention clustered:topk=3 RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_VARIABLE out)
if(NOT rc OR NOT "${out}${err}" MATCHES "accepted: clusters")
  message(FATAL_ERROR "bench --attention clustered:topk=3: rc=${rc} output: ${out}${err}")
endif()

file(REMOVE ${OUT})
run_ok(${CLI} bench --attention full,linear,agglomerative,clustered:clusters=8,bits=16
       --impl fast,reference,torch,torch-composite --pass forward,forward_backward --lengths 33,64 --heads 2
       --head-dim 16 --repeats 1 --threads 1 --json ${OUT})
if(NOT out MATCHES "full +torch-composite")
  message(FATAL_ERROR "bench table lacks the torch-composite row:\n${out}")
endif()
if(NOT out MATCHES "approx_err +max" OR NOT out MATCHES "err +max")
  message(FATAL_ERROR "bench table lacks the column legend:\n${out}")
endif()
file(READ ${OUT} json)
read_fields("${json}" machine cpu threads sgemm_gflops torch_version torch_blas)
if(NOT threads EQUAL 1 OR sgemm_gflops LESS_EQUAL 0 OR torch_blas STREQUAL "" OR
   NOT torch_version MATCHES "^[0-9]+\\.[0-9]+")
  message(FATAL_ERROR "bad machine record: ${cpu} ${threads} ${sgemm_gflops} ${torch_version} ${torch_blas}")
endif()
# `torch`: torch's own scaled_dot_product_attention where libtorch has one
# (torch 2), else the composite, as the header says.
if(torch_version VERSION_GREATER_EQUAL 2)
  set(torch_impl torch-sdpa)
  set(torch_header "`torch` rows: torch's scaled_dot_product_attention")
else()
  set(torch_impl torch-composite)
  set(torch_header "has no public scaled_dot_product_attention")
endif()
string(FIND "${out}" "${torch_header}" at)
if(at LESS 0 OR NOT out MATCHES "full +${torch_impl} ")
  message(FATAL_ERROR "torch ${torch_version}: the header or the ${torch_impl} row is missing:\n${out}")
endif()
# 2 lengths x (full: fast, reference, torch, torch-composite; linear,
# agglomerative, clustered: fast, reference) x 2 passes = 40 rows.
require_length("${json}" 40 "bench results" results)
set(torch_rows 0)
foreach(i RANGE 39)
  read_fields("${json}" "results;${i}" attention run impl dispatch_reason pass N H L S E M causal
              threads ms gflops peak_bytes err approx_err)
  string(JSON approx_type TYPE "${json}" results ${i} approx_err)
  set(row "result ${i} (${attention} ${run} -> ${impl})")
  if(ms LESS_EQUAL 0 OR peak_bytes LESS_EQUAL 0)
    message(FATAL_ERROR "${row} has ms=${ms} peak_bytes=${peak_bytes}")
  endif()
  # impl says what ran: the op's kernel on float32, the composite for
  # --impl reference, plain libtorch for torch.
  if(run STREQUAL "fast" AND NOT impl STREQUAL "kernel")
    message(FATAL_ERROR "${row}: the float32 op should run its kernel")
  endif()
  if((run STREQUAL "reference" AND NOT impl STREQUAL "composite") OR
     (run STREQUAL "torch" AND NOT impl STREQUAL torch_impl) OR
     (run STREQUAL "torch-composite" AND NOT impl STREQUAL "torch-composite"))
    message(FATAL_ERROR "${row}: wrong impl")
  endif()
  if(run STREQUAL "torch")
    math(EXPR torch_rows "${torch_rows} + 1")
  endif()
  # err: each mechanism against its own float64 definition, float32 rounding only.
  if(NOT err LESS 1e-4)
    message(FATAL_ERROR "${row} is off its float64 definition: err ${err}")
  endif()
  # approx_err only for approximations of exact attention.
  if(attention MATCHES "^clustered")
    if(NOT approx_type STREQUAL "NUMBER")
      message(FATAL_ERROR "${row} lacks approx_err")
    endif()
  elseif(NOT approx_type STREQUAL "NULL")
    message(FATAL_ERROR "${row} has an approx_err but does not approximate exact attention")
  endif()
endforeach()
if(NOT torch_rows EQUAL 4)
  message(FATAL_ERROR "expected 4 `torch` rows, got ${torch_rows}")
endif()
# Causal torch rows with L != S: torch's is_causal is top-left, ours
# bottom-right; the row must still match our float64 definition (err), in
# both passes.
set(torch_causal_out ${OUT}.torch-causal.json)
run_ok(${CLI} bench --attention full --impl torch,torch-composite --pass forward,forward_backward --causal
       --queries 5 --lengths 16 --heads 2 --head-dim 8 --repeats 1 --threads 1 --no-peak
       --json ${torch_causal_out})
file(READ ${torch_causal_out} json)
require_length("${json}" 4 "causal torch bench results" results)
foreach(i RANGE 3)
  read_fields("${json}" "results;${i}" run impl L S causal err)
  if(NOT L EQUAL 5 OR NOT S EQUAL 16 OR NOT causal OR NOT err LESS 1e-4)
    message(FATAL_ERROR "causal torch row ${i} (${run} -> ${impl}): L=${L} S=${S} causal=${causal} err=${err}")
  endif()
endforeach()
file(REMOVE ${torch_causal_out})

# --rounds 3: every row timed in each round, the rows in turn; a row's ms is
# the median of its three rounds' times, which the JSON lists; errors are
# checked (once) as without rounds.
set(rounds_out ${OUT}.rounds.json)
run_ok(${CLI} bench --attention full,linear --impl fast,torch --pass forward,forward_backward --lengths 24,40
       --heads 2 --head-dim 8 --repeats 1 --rounds 3 --threads 1 --no-peak --json ${rounds_out})
foreach(fragment "round 1 of 3" "round 3 of 3" "medians over 3 rounds")
  string(FIND "${out}" "${fragment}" at)
  if(at LESS 0)
    message(FATAL_ERROR "bench --rounds 3 output lacks '${fragment}':\n${out}")
  endif()
endforeach()
file(READ ${rounds_out} json)
string(JSON rounds GET "${json}" rounds)
if(NOT rounds EQUAL 3)
  message(FATAL_ERROR "bench --rounds 3 JSON records rounds=${rounds}")
endif()
# 2 lengths x (full: fast, torch; linear: fast) x 2 passes = 12 rows.
require_length("${json}" 12 "bench --rounds results" results)
foreach(i RANGE 11)
  read_fields("${json}" "results;${i}" attention run ms err)
  require_length("${json}" 3 "round times of result ${i}" results ${i} round_ms)
  set(times "")
  foreach(k RANGE 2)
    string(JSON t GET "${json}" results ${i} round_ms ${k})
    if(NOT t GREATER 0)
      message(FATAL_ERROR "result ${i} (${attention} ${run}): round ${k} took ${t} ms")
    endif()
    list(APPEND times ${t})
  endforeach()
  # ms is the middle one of the three (CMake compares numbers as doubles).
  list(GET times 0 a)
  list(GET times 1 b)
  list(GET times 2 c)
  set(below 0)
  set(above 0)
  foreach(t ${a} ${b} ${c})
    if(t LESS ms)
      math(EXPR below "${below} + 1")
    elseif(t GREATER ms)
      math(EXPR above "${above} + 1")
    endif()
  endforeach()
  if(below GREATER 1 OR above GREATER 1 OR NOT (ms EQUAL a OR ms EQUAL b OR ms EQUAL c))
    message(FATAL_ERROR "result ${i} (${attention} ${run}): ms ${ms} is not the median of ${times}")
  endif()
  if(NOT err LESS 1e-4)
    message(FATAL_ERROR "result ${i} (${attention} ${run}) with rounds: err ${err}")
  endif()
endforeach()
file(REMOVE ${rounds_out})

# --dim, --head-dim's name before the naming pass, still works with one
# warning line; neither is a flag of another meaning.
run_ok(${CLI} bench --attention full --impl fast --pass forward --lengths 16 --heads 1 --dim 8 --repeats 1
       --threads 1 --check-limit 0 --no-peak)
if(NOT err STREQUAL "attnkit bench: --dim is deprecated, use --head-dim (same meaning)\n")
  message(FATAL_ERROR "bench --dim's warning:\n${err}")
endif()
run_ok(${CLI} bench --help)
if(NOT out MATCHES "--head-dim" OR out MATCHES "--dim ")
  message(FATAL_ERROR "'attnkit bench --help' should list --head-dim and not --dim:\n${out}")
endif()

# `causal` in a row says whether what ran was causal: the flag, or a mechanism
# that is causal by construction (causal-linear, the causal sparse patterns),
# which the flag does not mention.
set(causal_out ${OUT}.causal.json)
run_ok(${CLI} bench --attention causal-linear,sparse-local-causal:span=4,linear --impl fast
       --pass forward --lengths 16 --heads 1 --head-dim 8 --repeats 1 --threads 1 --check-limit 0
       --json ${causal_out})
file(READ ${causal_out} json)
require_length("${json}" 3 "causal bench results" results)
foreach(i RANGE 2)
  read_fields("${json}" "results;${i}" attention causal)
  if(attention STREQUAL "linear")
    set(expected OFF)
  else()
    set(expected ON)
  endif()
  if((causal AND NOT expected) OR (NOT causal AND expected))
    message(FATAL_ERROR "bench JSON row ${i} (${attention}) records causal=${causal}")
  endif()
endforeach()
file(REMOVE ${causal_out})
