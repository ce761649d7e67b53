# `attnkit-experiments node-classify` as a user runs it, on the package graph that
# scripts/package-graph makes from tests/data/packages-fixture.txt, with a tiny
# model: a run's files for every structure and attention kind, --resume (which
# must end where an uninterrupted run ends, to the bit: the same best/test values
# and the same tensors in the last checkpoint), a run written before --structure
# existed (resumed, and ending where a run of today's flags ends), the old form
# --attention input|input+random, refusals that exit non-zero and change nothing.
# Variables: CLI (the attnkit-experiments binary), PYTHON, PACKAGE_GRAPH (scripts/package-graph),
# FIXTURE (tests/data/packages-fixture.txt), OUT_DIR (scratch).
cmake_policy(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/../../tests/cli/common.cmake)

file(REMOVE_RECURSE ${OUT_DIR})
file(MAKE_DIRECTORY ${OUT_DIR})
set(data ${OUT_DIR}/data)

# Fails unless `text` contains `needle` literally (attention specs hold regex
# characters such as '+').
function(require_contains text needle what)
  string(FIND "${text}" "${needle}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${what}: expected '${needle}' in:\n${text}")
  endif()
endfunction()

# A kind of run: a structure ("input", "input+random...") or an attention
# mechanism ("full", "sac..."). Sets `kind_flags` (its flags), `kind_structure`,
# `kind_attention` (as result.json stores them) and `kind_line` (how the
# program's first line names them).
function(kind_of kind)
  if(kind MATCHES "^input" OR kind STREQUAL "self")
    set(kind_flags --structure ${kind} PARENT_SCOPE)
    set(kind_structure "${kind}" PARENT_SCOPE)
    set(kind_attention "" PARENT_SCOPE)
    set(kind_line "structure ${kind}, attention over the structure" PARENT_SCOPE)
  else()
    set(kind_flags --attention ${kind} PARENT_SCOPE)
    set(kind_structure "input" PARENT_SCOPE)
    set(kind_attention "${kind}" PARENT_SCOPE)
    set(kind_line "structure input, attention ${kind}" PARENT_SCOPE)
  endif()
endfunction()

# Runs ARGN; it must exit non-zero with `needle` (literal) in its output.
function(run_refused_with needle)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc)
    message(FATAL_ERROR "'${ARGN}' should fail with '${needle}' but exited 0: ${out}${err}")
  endif()
  require_contains("${out}${err}" "${needle}" "'${ARGN}' (exit ${rc})")
endfunction()

# Sets `var` to the unsigned little-endian integer of `bytes` bytes at
# `offset` of `path`.
function(read_le path offset bytes var)
  file(READ ${path} hex OFFSET ${offset} LIMIT ${bytes} HEX)
  set(be "")
  math(EXPR last "${bytes} - 1")
  foreach(i RANGE ${last})
    math(EXPR at "2 * ${i}")
    string(SUBSTRING "${hex}" ${at} 2 pair)
    set(be "${pair}${be}")
  endforeach()
  math(EXPR value "0x${be}")
  set(${var} ${value} PARENT_SCOPE)
endfunction()

# Sets `header` to the JSON header of the checkpoint `path` (the container of
# include/attnkit/train/checkpoint.h: magic, version, H, P, header, payload,
# CRC) and `payload_digest` to checkpoint_digest.py's digest of the tensors in
# its payload. Not the payload's bytes: libtorch keys the optimiser's state by
# TensorImpl addresses, so two processes that end in the same state write
# differently ordered and named archives (two uninterrupted runs of the same
# command differ in their bytes); the digest covers the bytes of every stored
# tensor (weights, optimiser moments, generator state), in any order.
function(read_checkpoint path)
  file(READ ${path} magic LIMIT 8 HEX)
  if(NOT magic STREQUAL "41544e4b434b5054")  # "ATNKCKPT"
    message(FATAL_ERROR "${path}: not a checkpoint (magic '${magic}')")
  endif()
  read_le(${path} 12 8 H)
  read_le(${path} 20 8 P)
  file(SIZE ${path} size)
  math(EXPR expected "28 + ${H} + ${P} + 4")
  if(NOT size EQUAL expected)
    message(FATAL_ERROR "${path}: ${size} bytes, the container says ${expected}")
  endif()
  file(READ ${path} header OFFSET 28 LIMIT ${H})
  run_ok(${PYTHON} ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/../../tests/cli/checkpoint_digest.py ${path})
  if(NOT out MATCHES "^[1-9][0-9]* [0-9a-f]+\n$")
    message(FATAL_ERROR "checkpoint_digest.py ${path}: '${out}'")
  endif()
  set(header "${header}" PARENT_SCOPE)
  set(payload_digest "${out}" PARENT_SCOPE)
endfunction()

# Fails unless the JSON number `value` lies in [0, 1].
function(require_unit value what)
  if(NOT value MATCHES "^(0|0\\.[0-9]+|1|1\\.0+)(e-[0-9]+)?$")
    message(FATAL_ERROR "${what} = ${value}, not in [0, 1]")
  endif()
endfunction()

# --- The dataset ------------------------------------------------------------------------
run_ok(${PYTHON} ${PACKAGE_GRAPH} --input ${FIXTURE} --sections games,graphics,sound --train-per-class 2
       --valid 6 --test 10 --min-count 2 --out ${data})
file(READ ${data}/meta.json meta)
read_fields("${meta}" "" nodes edges features)
read_fields("${meta}" "split_counts" train valid test)
string(JSON classes LENGTH "${meta}" classes)
if(NOT classes EQUAL 3 OR nodes LESS 10)
  message(FATAL_ERROR "the fixture's graph: ${meta}")
endif()
# Full attention's share of same-class pairs, sum c (c - 1) / (n (n - 1)), to 6
# decimals (truncated), from meta.json's class counts.
set(pairs 0)
math(EXPR last "${classes} - 1")
foreach(c RANGE ${last})
  string(JSON count GET "${meta}" class_counts ${c})
  math(EXPR pairs "${pairs} + ${count} * (${count} - 1)")
endforeach()
math(EXPR full_same_class "${pairs} * 1000000 / (${nodes} * (${nodes} - 1))")
# The input graph's edges per node: both directions plus self-edges.
math(EXPR input_slots "${nodes} + 2 * ${edges}")

# --- Help ---------------------------------------------------------------------------------
run_ok(${CLI} --help)
if(NOT out MATCHES "\n  node-classify ")
  message(FATAL_ERROR "'attnkit-experiments --help' does not list node-classify:\n${out}")
endif()
run_ok(${CLI} node-classify --help)
foreach(flag --data --structure --attention --epochs --patience --eval-every --seed --threads --out --resume --width --heads
             --layers --residual --samples --dropout --lr --weight-decay --clip)
  if(NOT out MATCHES "${flag}")
    message(FATAL_ERROR "'attnkit-experiments node-classify --help' lacks ${flag}:\n${out}")
  endif()
endforeach()

# --- One run of every attention kind -----------------------------------------------------
set(model --data ${data} --width 8 --heads 2 --epochs 4 --eval-every 2 --threads 1)
set(record_keys step loss accuracy valid_loss valid_accuracy test_loss test_accuracy edges_per_node same_class
                elapsed)
foreach(kind input full input+random:alpha=1 input+oracle:seed=1 self sac:alpha=1,variant=all-connected,hidden=8)
  string(MAKE_C_IDENTIFIER "${kind}" name)
  set(run ${OUT_DIR}/${name})
  kind_of(${kind})
  run_ok(${CLI} node-classify ${model} ${kind_flags} --out ${run})
  require_contains("${out}" "${kind_line}, seed 1; ${nodes} nodes, ${edges} edges, ${features} features, 3 classes; train/valid/test ${train}/${valid}/${test} nodes" "${kind}'s output")
  require_contains("${out}" "node-classify after 4 epochs" "${kind}'s output")
  if(NOT out MATCHES "epoch 2/4  loss [0-9.]+ .* ETA [0-9]")
    message(FATAL_ERROR "${kind}'s output lacks the epoch-2 line:\n${out}")
  endif()
  expect_checkpoints(${run} 2 4)
  read_metrics(${run} 2)
  set(i 0)
  foreach(expected_step 2 4)
    list(GET records ${i} record)
    read_fields("${record}" "" ${record_keys})
    if(kind MATCHES "^sac")
      read_fields("${record}" "" sac_reward sac_baseline)
    else()
      string(JSON has ERROR_VARIABLE none GET "${record}" sac_reward)
      if(NOT none)
        message(FATAL_ERROR "${kind}: a SAC field in a record of another kind: ${record}")
      endif()
    endif()
    if(NOT step EQUAL expected_step)
      message(FATAL_ERROR "${kind}: record ${i} is of step ${step}, not ${expected_step}")
    endif()
    require_unit(${valid_accuracy} "${kind} step ${step} valid_accuracy")
    require_unit(${test_accuracy} "${kind} step ${step} test_accuracy")
    math(EXPR i "${i} + 1")
  endforeach()

  file(READ ${run}/result.json result)
  read_fields("${result}" "" structure attention seed settings epochs_run stopped_early parameters nodes classes best
              test_accuracy input_graph train_seconds seconds_per_epoch session)
  read_fields("${result}" "best" epoch valid_accuracy valid_loss test_loss edges_per_node same_class)
  string(JSON best_test GET "${result}" best test_accuracy)
  read_fields("${result}" "session" resumed_from start_epoch wall_seconds loadavg_start loadavg_end finished_utc
              threads)
  string(JSON input_epn GET "${result}" input_graph edges_per_node)
  string(JSON input_same GET "${result}" input_graph same_class)
  if(NOT attention STREQUAL kind_attention OR NOT structure STREQUAL kind_structure OR NOT epochs_run EQUAL 4 OR NOT seed EQUAL 1 OR NOT stopped_early STREQUAL "OFF"
     OR NOT resumed_from STREQUAL "" OR NOT start_epoch EQUAL 0 OR NOT threads EQUAL 1
     OR NOT test_accuracy STREQUAL best_test OR NOT (epoch EQUAL 2 OR epoch EQUAL 4))
    message(FATAL_ERROR "${kind}: result.json:\n${result}")
  endif()
  require_unit(${test_accuracy} "${kind} test_accuracy")
  # The best epoch's record holds the best's values.
  math(EXPR best_index "${epoch} / 2 - 1")
  list(GET records ${best_index} best_record)
  string(JSON record_valid_loss GET "${best_record}" valid_loss)
  string(JSON record_test_accuracy GET "${best_record}" test_accuracy)
  if(NOT record_valid_loss STREQUAL valid_loss OR NOT record_test_accuracy STREQUAL test_accuracy)
    message(FATAL_ERROR "${kind}: best (epoch ${epoch}) disagrees with its record ${best_record}:\n${result}")
  endif()
  # The structure: the input graph's edges per node is (n + 2 m) / n.
  math(EXPR whole "${input_slots} / ${nodes}")
  math(EXPR tenths "${input_slots} * 10 / ${nodes} % 10")
  if(NOT input_epn MATCHES "^${whole}(\\.${tenths}|$)")
    message(FATAL_ERROR "${kind}: input_graph.edges_per_node ${input_epn}, expected ${input_slots}/${nodes}")
  endif()
  if(kind STREQUAL "input")
    if(NOT edges_per_node STREQUAL input_epn OR NOT same_class STREQUAL input_same)
      message(FATAL_ERROR "input: the structure (${edges_per_node}, ${same_class}) is not the input graph's "
                          "(${input_epn}, ${input_same})")
    endif()
  elseif(kind STREQUAL "self")
    # Only self-edges: no pair of distinct nodes to be of one class.
    if(NOT edges_per_node MATCHES "^1(\\.0*)?$" OR NOT same_class MATCHES "^0(\\.0*)?$")
      message(FATAL_ERROR "self: edges_per_node ${edges_per_node}, same_class ${same_class}; expected 1 and 0")
    endif()
  elseif(kind STREQUAL "full")
    string(REGEX MATCH "^0\\.([0-9][0-9][0-9][0-9][0-9][0-9])" digits "${same_class}")
    set(digits "${CMAKE_MATCH_1}")  # before the MATCHES below resets CMAKE_MATCH_1
    if(NOT edges_per_node MATCHES "^${nodes}(\\.0*)?$" OR NOT digits EQUAL full_same_class)
      message(FATAL_ERROR "full: edges_per_node ${edges_per_node} (expected ${nodes}), same_class ${same_class} "
                          "(expected 0.${full_same_class}...)")
    endif()
  else()
    # Input edges plus at most alpha = 1 more per node.
    math(EXPR at_most "${whole} + 1")
    if(NOT edges_per_node GREATER input_epn OR edges_per_node GREATER at_most)
      message(FATAL_ERROR "${kind}: edges_per_node ${edges_per_node}, expected in (${input_epn}, ${at_most}]")
    endif()
    # The oracle's edges join nodes of one class: more of the structure's pairs are.
    if(kind MATCHES "^input\\+oracle" AND NOT same_class GREATER input_same)
      message(FATAL_ERROR "${kind}: same_class ${same_class}, not above the input graph's ${input_same}")
    endif()
  endif()
endforeach()

# --- Interrupted and resumed = uninterrupted ---------------------------------------------
# 2 epochs, then --resume to 4, against 4 straight epochs: the same best and
# test values, the same records, the same weights, optimiser state and
# generator (every tensor of checkpoint 4's payload, bitwise). Dropout 0.6 (the default) draws from
# the generator every epoch, SAC samples from it too.
foreach(kind input sac:alpha=1,variant=all-connected,hidden=8)
  string(MAKE_C_IDENTIFIER "${kind}" name)
  set(split ${OUT_DIR}/resume-${name})
  set(straight ${OUT_DIR}/straight-${name})
  kind_of(${kind})
  run_ok(${CLI} node-classify --data ${data} --width 8 --heads 2 --epochs 2 --eval-every 2 --threads 1
         ${kind_flags} --out ${split})
  expect_checkpoints(${split} 2)
  read_metrics(${split} 1)
  run_ok(${CLI} node-classify --epochs 4 --eval-every 2 --threads 1 --out ${split} --resume)
  if(NOT out MATCHES "resuming [^\n]*checkpoint-00000002\\.ckpt at epoch 2" OR NOT out MATCHES "after 4 epochs")
    message(FATAL_ERROR "${kind}: --resume's output:\n${out}")
  endif()
  require_contains("${out}" "${kind_line}" "${kind}: --resume takes the settings from the checkpoint")
  expect_checkpoints(${split} 2 4)
  read_metrics(${split} 2)
  set(split_records "${records}")
  run_ok(${CLI} node-classify ${model} ${kind_flags} --out ${straight})
  read_metrics(${straight} 2)

  file(READ ${split}/result.json a)
  file(READ ${straight}/result.json b)
  string(JSON a_resumed GET "${a}" session resumed_from)
  string(JSON a_start GET "${a}" session start_epoch)
  if(NOT a_resumed MATCHES "checkpoint-00000002\\.ckpt$" OR NOT a_start EQUAL 2)
    message(FATAL_ERROR "${kind}: the resumed run's session: ${a}")
  endif()
  foreach(path "best;epoch" "best;valid_accuracy" "best;valid_loss" "best;test_accuracy" "best;test_loss"
               "best;edges_per_node" "best;same_class" "test_accuracy" "epochs_run" "settings")
    string(JSON va GET "${a}" ${path})
    string(JSON vb GET "${b}" ${path})
    if(NOT va STREQUAL vb)
      message(FATAL_ERROR "${kind}: result.json ${path}: resumed ${va}, uninterrupted ${vb}")
    endif()
  endforeach()
  foreach(i 0 1)
    list(GET split_records ${i} ra)
    list(GET records ${i} rb)
    foreach(key step loss accuracy valid_loss test_loss edges_per_node same_class)
      string(JSON va GET "${ra}" ${key})
      string(JSON vb GET "${rb}" ${key})
      if(NOT va STREQUAL vb)
        message(FATAL_ERROR "${kind}: record ${i} ${key}: resumed ${va}, uninterrupted ${vb}")
      endif()
    endforeach()
  endforeach()
  read_checkpoint(${split}/checkpoint-00000004.ckpt)
  set(a_payload "${payload_digest}")
  set(a_header "${header}")
  read_checkpoint(${straight}/checkpoint-00000004.ckpt)
  if(NOT a_payload STREQUAL payload_digest)
    message(FATAL_ERROR "${kind}: checkpoint 4's tensors differ between the resumed (${a_payload}) and the "
                        "uninterrupted run (${payload_digest})")
  endif()
  foreach(key step settings best tensors)
    string(JSON va GET "${a_header}" ${key})
    string(JSON vb GET "${header}" ${key})
    if(NOT va STREQUAL vb)
      message(FATAL_ERROR "${kind}: checkpoint 4's header '${key}': resumed ${va}, uninterrupted ${vb}")
    endif()
  endforeach()
endforeach()
# The comparison can fail: another seed ends elsewhere.
run_ok(${CLI} node-classify ${model} --structure input --seed 2 --out ${OUT_DIR}/seed-2)
read_checkpoint(${OUT_DIR}/seed-2/checkpoint-00000004.ckpt)
set(seed2 "${payload_digest}")
read_checkpoint(${OUT_DIR}/straight-input/checkpoint-00000004.ckpt)
if(seed2 STREQUAL payload_digest)
  message(FATAL_ERROR "seeds 1 and 2 end with the same checkpoint payload")
endif()

# --- A warm start ----------------------------------------------------------------------
# --init-from copies the network's weights of another run's newest checkpoint:
# with a learning rate of 1e-12 the run's first evaluation is the source's last.
run_ok(${CLI} node-classify --data ${data} --width 8 --heads 2 --epochs 2 --eval-every 2 --threads 1
       --structure input --lr 1e-12 --init-from ${OUT_DIR}/input --out ${OUT_DIR}/warm)
require_contains("${out}" "warm start: 8 tensors of the network from ${OUT_DIR}/input/checkpoint-00000004.ckpt (epoch 4)"
                 "--init-from's output")
read_metrics(${OUT_DIR}/input 2)
list(GET records 1 source_last)
read_metrics(${OUT_DIR}/warm 1)
foreach(key valid_accuracy test_accuracy)
  string(JSON va GET "${source_last}" ${key})
  string(JSON vb GET "${records}" ${key})
  if(NOT va STREQUAL vb)
    message(FATAL_ERROR "--init-from: ${key} ${vb} after 2 epochs at lr 1e-12, the source ended at ${va}")
  endif()
endforeach()
file(READ ${OUT_DIR}/warm/result.json warm_result)
string(JSON warm_from GET "${warm_result}" settings init_from)
if(NOT warm_from STREQUAL "${OUT_DIR}/input")
  message(FATAL_ERROR "--init-from is not in the run's settings: ${warm_result}")
endif()
# SAC from a trained GAT: the predictor starts fresh, the network does not.
run_ok(${CLI} node-classify --data ${data} --width 8 --heads 2 --epochs 2 --eval-every 2 --threads 1
       --attention sac:alpha=1,variant=all-connected,hidden=8 --init-from ${OUT_DIR}/input --out ${OUT_DIR}/warm-sac)
require_contains("${out}" "warm start: 8 tensors of the network" "SAC's warm start")
run_refused_with("--init-from: ${OUT_DIR}/input has width 8, heads 2, layers 2; this run 16, 2, 2"
                 ${CLI} node-classify --data ${data} --width 16 --heads 2 --epochs 2 --init-from ${OUT_DIR}/input
                 --out ${OUT_DIR}/warm-refused)
run_refused_with("${OUT_DIR}/absent"
                 ${CLI} node-classify --data ${data} --width 8 --heads 2 --epochs 2 --init-from ${OUT_DIR}/absent
                 --out ${OUT_DIR}/warm-refused)

# --- Refusals: a non-zero exit, a clear message, nothing changed -------------------------
set(run ${OUT_DIR}/input)
directory_hashes(${run} hashes_before)
run_refused_with("already holds checkpoints" ${CLI} node-classify ${model} --out ${run})
run_refused_with("pass --resume" ${CLI} node-classify --data ${data} --epochs 6 --out ${run})
run_refused_with("--resume: --attention: checkpoint \"\", now \"full\""
                 ${CLI} node-classify --attention full --epochs 6 --out ${run} --resume)
run_refused_with("--resume: --structure: checkpoint \"input\", now \"input+random\""
                 ${CLI} node-classify --structure input+random --epochs 6 --out ${run} --resume)
run_refused_with("--resume: --structure: checkpoint \"input\", now \"input+random\""
                 ${CLI} node-classify --attention input+random --epochs 6 --out ${run} --resume)
run_refused_with("--resume: --width: checkpoint 8, now 16"
                 ${CLI} node-classify --width 16 --epochs 6 --out ${run} --resume)
require_unchanged(${run} "${hashes_before}" "a refusal")

file(MAKE_DIRECTORY ${OUT_DIR}/empty)
run_refused_with("holds no checkpoint to resume" ${CLI} node-classify --epochs 4 --out ${OUT_DIR}/empty --resume)
file(GLOB left ${OUT_DIR}/empty/*)
if(left)
  message(FATAL_ERROR "--resume on an empty directory wrote ${left}")
endif()
run_refused_with("holds no checkpoint to resume" ${CLI} node-classify --epochs 4 --out ${OUT_DIR}/absent --resume)
run_refused_with("'${OUT_DIR}/missing' is not a directory"
                 ${CLI} node-classify --data ${OUT_DIR}/missing --out ${OUT_DIR}/no-data)
run_refused_with("--data (a dataset directory, e.g. from scripts/package-graph) is required"
                 ${CLI} node-classify --out ${OUT_DIR}/no-data)
run_refused_with("unknown attention 'sparse'"
                 ${CLI} node-classify --data ${data} --attention sparse --out ${OUT_DIR}/no-data)
run_refused_with("unknown structure 'random'"
                 ${CLI} node-classify --data ${data} --structure random --out ${OUT_DIR}/no-data)
run_refused_with("it takes structure 'input', got 'input+random'"
                 ${CLI} node-classify --data ${data} --structure input+random --attention full --out ${OUT_DIR}/no-data)
run_refused_with("'input' is a structure: give it as --structure"
                 ${CLI} node-classify --data ${data} --structure input --attention input --out ${OUT_DIR}/no-data)
foreach(dir absent no-data)
  if(EXISTS ${OUT_DIR}/${dir})
    message(FATAL_ERROR "a refused run created ${OUT_DIR}/${dir}")
  endif()
endforeach()

# --- Names before --structure ---------------------------------------------------------------
# The old form --attention input+random:... still runs (one warning line on
# stderr) and is the run --structure gives, to the bit.
set(old_form ${OUT_DIR}/old-form)
run_ok(${CLI} node-classify ${model} --attention input+random:alpha=1 --out ${old_form})
require_contains("${err}" "--attention input+random:alpha=1 is deprecated, use --structure input+random:alpha=1"
                 "the old form's warning")
require_contains("${out}" "structure input+random:alpha=1, attention over the structure, seed 1;" "the old form")
read_checkpoint(${old_form}/checkpoint-00000004.ckpt)
set(old_form_payload "${payload_digest}")
read_checkpoint(${OUT_DIR}/input_random_alpha_1/checkpoint-00000004.ckpt)
if(NOT old_form_payload STREQUAL payload_digest)
  message(FATAL_ERROR "--attention input+random:alpha=1 and --structure input+random:alpha=1 end differently")
endif()

# A run directory written before --structure existed (its settings hold the
# structure in "attention"; experiments/tests/data/node-classify-before-rename,
# 2 epochs of `--attention input+random:alpha=1` with --data data): it resumes,
# and a second copy resumed with today's flag (--structure) ends at the same
# place, bitwise. (Not a fresh run of today's flags: its first two epochs
# would be bitwise the fixture's only at the ISA level it was written at.)
set(before ${OUT_DIR}/before-rename)
file(COPY ${CMAKE_CURRENT_LIST_DIR}/data/node-classify-before-rename/ DESTINATION ${before})
execute_process(COMMAND ${CLI} node-classify --epochs 4 --eval-every 2 --threads 1 --out ${before} --resume
                WORKING_DIRECTORY ${OUT_DIR} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc OR NOT out MATCHES "resuming [^\n]*checkpoint-00000002\\.ckpt at epoch 2")
  message(FATAL_ERROR "resuming the run written before --structure: exit ${rc}\n${out}${err}")
endif()
require_contains("${out}" "structure input+random:alpha=1, attention over the structure, seed 1;"
                 "the old run's settings, read with today's names")
run_refused_with("--resume: --structure: checkpoint \"input+random:alpha=1\", now \"input\""
                 ${CLI} node-classify --structure input --epochs 6 --out ${before} --resume)
set(today ${OUT_DIR}/before-rename-today)
file(COPY ${CMAKE_CURRENT_LIST_DIR}/data/node-classify-before-rename/ DESTINATION ${today})
execute_process(COMMAND ${CLI} node-classify --structure input+random:alpha=1 --epochs 4 --eval-every 2
                        --threads 1 --out ${today} --resume
                WORKING_DIRECTORY ${OUT_DIR} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc)
  message(FATAL_ERROR "resuming the old run with today's flag: exit ${rc}\n${out}${err}")
endif()
file(READ ${before}/result.json a)
file(READ ${today}/result.json b)
foreach(path "best;epoch" "best;valid_accuracy" "best;valid_loss" "best;test_accuracy" "best;test_loss"
             "best;edges_per_node" "test_accuracy" "epochs_run" "settings" "structure" "attention")
  string(JSON va GET "${a}" ${path})
  string(JSON vb GET "${b}" ${path})
  if(NOT va STREQUAL vb)
    message(FATAL_ERROR "result.json ${path}: resumed without flags ${va}, with --structure ${vb}")
  endif()
endforeach()
read_checkpoint(${before}/checkpoint-00000004.ckpt)
set(before_payload "${payload_digest}")
read_checkpoint(${today}/checkpoint-00000004.ckpt)
if(NOT before_payload STREQUAL payload_digest)
  message(FATAL_ERROR "checkpoint 4's tensors differ between the old run resumed without flags and with --structure")
endif()
