# `attnkit bench-model` at tiny sizes: the three measurements run, the table
# and the JSON have what docs/PERFORMANCE.md describes, the FLOP count matches
# a count by hand and the libtorch baseline is the same model.
include(${CMAKE_CURRENT_LIST_DIR}/common.cmake)

run_ok(${CLI} bench-model --help)
foreach(option "--what" "--attention" "--contexts" "--memory-contexts" "--memory-batch" "--json")
  if(NOT out MATCHES "${option}")
    message(FATAL_ERROR "bench-model --help lacks ${option}:\n${out}")
  endif()
endforeach()
if(out MATCHES "--child")
  message(FATAL_ERROR "bench-model --help shows the hidden --child option:\n${out}")
endif()

# Bad values are refused before any work, naming what is wrong.
run_refused("nosuch" ${CLI} bench-model --what train,nosuch)
run_refused("nosuch" ${CLI} bench-model --attention nosuch)
run_refused("multiple of --heads" ${CLI} bench-model --width 30 --heads 4)
run_refused("generate needs --architecture decoder" ${CLI} bench-model --what generate --architecture encoder)
run_refused("'x' is not a positive integer" ${CLI} bench-model --what generate --contexts 64,x)

# One block of width 16 (2 heads of 8), ffn 32, vocabulary 27, context 32, batch 2.
file(REMOVE ${OUT})
run_ok(${CLI} bench-model --layers 1 --width 16 --heads 2 --ffn 32 --context 32 --batch 2
       --repeats 1 --threads 1 --contexts 64,128 --steps 4 --memory-contexts 64,128
       --memory-batch 256 --json ${OUT})
foreach(fragment "== train" "== generate" "== memory" "MFU%" "torch \\(composite full attention\\)"
        "libtorch's matmul: " "faster than the libtorch baseline" "prefill tok/s" "step MiB")
  if(NOT out MATCHES "${fragment}")
    message(FATAL_ERROR "bench-model output lacks '${fragment}':\n${out}")
  endif()
endforeach()
# The machine header comes first.
if(NOT out MATCHES "^cpu: ")
  message(FATAL_ERROR "bench-model output does not start with the machine header:\n${out}")
endif()

file(READ ${OUT} json)
read_fields("${json}" machine cpu threads sgemm_gflops torch_blas)
if(NOT threads EQUAL 1 OR sgemm_gflops LESS_EQUAL 0 OR torch_blas STREQUAL "")
  message(FATAL_ERROR "bad machine record: ${cpu} ${threads} ${sgemm_gflops} ${torch_blas}")
endif()

# train: the five default mechanisms, every field positive.
require_length("${json}" 5 "train results" train results)
set(expected_attention full causal-linear agglomerative sparse-local-causal:span=64 linear)
foreach(i RANGE 4)
  list(GET expected_attention ${i} expected)
  read_fields("${json}" "train;results;${i}" attention spec params ms tokens_per_s flops dense_flops
              attention_flops gflops mfu)
  if(NOT attention STREQUAL expected)
    message(FATAL_ERROR "train result ${i} is ${attention}, expected ${expected}")
  endif()
  foreach(field params ms tokens_per_s flops dense_flops attention_flops gflops mfu)
    if(NOT ${field} GREATER 0)
      message(FATAL_ERROR "train result ${i} (${attention}) has ${field} = ${${field}}")
    endif()
  endforeach()
  set(dense_${i} ${dense_flops})
  set(attention_${i} ${attention_flops})
  set(params_${i} ${params})
endforeach()
# FLOPs by hand, 64 tokens, forward + backward = 6 x params of the matrices per token:
# full: q, k, v, out 4 x 16 x 16 + ffn 2 x 16 x 32 + tied output 27 x 16 = 2480;
# agglomerative: W_q, W_r 2 x 16 x 2 + P, Q 2 x 16 x 16 + ffn 1024 + output 432 = 2032.
# Causal full attention: 2 (E + M) per visible pair, L (L + 1) / 2 pairs per (n, h):
# 2 x 2 x 2 x (32 x 33 / 2) x 16, x3.
math(EXPR full_dense "6 * 2480 * 64")
math(EXPR agglomerative_dense "6 * 2032 * 64")
math(EXPR full_attention "3 * 2 * 2 * 2 * (32 * 33 / 2) * 16")
if(NOT dense_0 EQUAL full_dense OR NOT dense_2 EQUAL agglomerative_dense OR NOT attention_0 EQUAL full_attention)
  message(FATAL_ERROR "FLOP counts: full dense ${dense_0} (expected ${full_dense}), attention "
                      "${attention_0} (expected ${full_attention}); agglomerative dense ${dense_2} "
                      "(expected ${agglomerative_dense})")
endif()
# The baseline is the same model as attnkit's full: the same parameters.
read_fields("${json}" "train;baseline" impl torch_blas params ms tokens_per_s flops mfu speedup_of_full)
if(NOT impl STREQUAL "torch" OR NOT params EQUAL params_0 OR NOT flops GREATER 0 OR NOT ms GREATER 0
   OR NOT speedup_of_full GREATER 0 OR torch_blas STREQUAL "")
  message(FATAL_ERROR "bad baseline: impl ${impl}, params ${params} (full: ${params_0}), ms ${ms}, "
                      "speed-up ${speedup_of_full}, blas '${torch_blas}'")
endif()

# generate: 3 mechanisms x 2 contexts.
require_length("${json}" 6 "generate results" generate results)
foreach(i RANGE 5)
  read_fields("${json}" "generate;results;${i}" attention context prefill_ms prefill_tokens_per_s
              step_ms_median tokens_per_s)
  foreach(field context prefill_ms prefill_tokens_per_s step_ms_median tokens_per_s)
    if(NOT ${field} GREATER 0)
      message(FATAL_ERROR "generate result ${i} (${attention}) has ${field} = ${${field}}")
    endif()
  endforeach()
endforeach()

# memory: 5 mechanisms x 2 contexts, each a child process; a step holds more
# at 128 tokens than at 64. Batch 256: a step then adds about 30 MiB (64
# tokens) to the process's peak RSS; at batch 32 it added about 4 MiB, within
# the difference between two processes' peaks on a loaded machine (one run
# under ctest -j2 read -1.4 MiB).
require_length("${json}" 10 "memory results" memory results)
foreach(i RANGE 9)
  read_fields("${json}" "memory;results;${i}" attention context step_mib tensor_peak_mib peak_rss_mib
              idle_rss_mib ru_maxrss_mib)
  foreach(field step_mib tensor_peak_mib peak_rss_mib idle_rss_mib ru_maxrss_mib)
    if(NOT ${field} GREATER 0)
      message(FATAL_ERROR "memory result ${i} (${attention}, ${context}) has ${field} = ${${field}}")
    endif()
  endforeach()
  if(context EQUAL 64)
    set(tensors_64 ${tensor_peak_mib})
  elseif(NOT tensor_peak_mib GREATER tensors_64)
    message(FATAL_ERROR "memory of ${attention}: ${tensor_peak_mib} MiB of tensors at 128 tokens, "
                        "${tensors_64} at 64")
  endif()
endforeach()

# One measurement alone, one mechanism given twice (repeated option and comma list).
file(REMOVE ${OUT})
run_ok(${CLI} bench-model --what generate --attention full --attention causal-linear,agglomerative
       --layers 1 --width 16 --heads 2 --ffn 32 --contexts 8 --steps 2 --threads 1 --json ${OUT})
file(READ ${OUT} json)
require_length("${json}" 3 "generate results" generate results)
string(JSON train_type ERROR_VARIABLE missing TYPE "${json}" train)
if(NOT missing)
  message(FATAL_ERROR "--what generate also ran train:\n${json}")
endif()
