# `attnkit-experiments translate` as a user runs it, with a tiny encoder-decoder
# on the German number words (experiments/tests/data/numbers-deu-eng): a run's
# files for every score function, --resume ending where an uninterrupted run
# ends (to the bit), refusals that change nothing.
# Variables: CLI (the attnkit-experiments binary), DATA (the fixture), OUT_DIR (scratch).
cmake_policy(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/../../tests/cli/common.cmake)

file(REMOVE_RECURSE ${OUT_DIR})
file(MAKE_DIRECTORY ${OUT_DIR})

run_ok(${CLI} --help)
if(NOT out MATCHES "\n  translate ")
  message(FATAL_ERROR "'attnkit-experiments --help' does not list translate:\n${out}")
endif()
run_ok(${CLI} translate --help)
foreach(flag --data --score --steps --batch --seed --threads --out --resume --embedding --hidden
             --max-source --max-target --eval-every --valid-examples --test-examples --attention-examples)
  if(NOT out MATCHES "${flag}")
    message(FATAL_ERROR "'attnkit-experiments translate --help' lacks ${flag}:\n${out}")
  endif()
endforeach()

set(model --data ${DATA} --embedding 8 --hidden 8 --batch 8 --seed 1 --threads 1 --valid-examples 12
          --test-examples 20 --attention-examples 2)

foreach(score none additive general dot scaled-dot location)
  # 4 steps, a record and a checkpoint every 2; then --resume to 6.
  set(run ${OUT_DIR}/${score})
  run_ok(${CLI} translate ${model} --score ${score} --steps 4 --eval-every 2 --out ${run})
  if(NOT out MATCHES "score ${score}, seed 1, [0-9]+/[0-9]+/[0-9]+ train/valid/test sources"
     OR NOT out MATCHES "step 2/4 .* valid exact [0-9.]+ .* ETA [0-9]"
     OR NOT out MATCHES "trained to step 4 of 4; test exact match [0-9.]+, character error rate [0-9.]+ \\(20 sources\\)")
    message(FATAL_ERROR "translate ${score}'s output:\n${out}")
  endif()
  expect_checkpoints(${run} 2 4)
  read_metrics(${run} 2)
  list(GET records 1 last)
  read_fields("${last}" "" step loss valid_loss valid_exact valid_cer elapsed)
  if(NOT step EQUAL 4)
    message(FATAL_ERROR "the last record is of step ${step}, not 4")
  endif()
  file(READ ${run}/result.json result)
  read_fields("${result}" "" score test valid test_by_source_length attention_examples sources train_seconds session)
  read_fields("${result}" "test" examples exact cer loss)
  if(NOT examples EQUAL 20 OR exact LESS 0 OR exact GREATER 1 OR cer LESS 0)
    message(FATAL_ERROR "result.json: ${result}")
  endif()
  string(JSON n_examples LENGTH "${result}" attention_examples)
  # Weights only with attention (ERROR_VARIABLE reads NOTFOUND when they are there).
  string(JSON first ERROR_VARIABLE weights_missing GET "${result}" attention_examples 0 weights)
  set(has_weights NO)
  if(weights_missing STREQUAL "NOTFOUND")
    set(has_weights YES)
  endif()
  set(wants_weights YES)
  if(score STREQUAL "none")
    set(wants_weights NO)
  endif()
  if(NOT n_examples EQUAL 2 OR NOT has_weights STREQUAL wants_weights)
    message(FATAL_ERROR "${score}: attention examples (weights only with attention): ${result}")
  endif()

  run_ok(${CLI} translate --steps 6 --out ${run} --resume)
  if(NOT out MATCHES "resuming .*checkpoint-00000004.ckpt at step 4" OR NOT out MATCHES "trained to step 6 of 6")
    message(FATAL_ERROR "translate --resume's output:\n${out}")
  endif()
  read_metrics(${run} 3)
  list(GET records 2 resumed)
  read_fields("${resumed}" "" valid_loss)
  set(resumed_loss ${valid_loss})

  # The same 6 steps without interruption end with the same weights.
  run_ok(${CLI} translate ${model} --score ${score} --steps 6 --eval-every 2 --out ${run}-straight)
  file(STRINGS ${run}-straight/metrics.jsonl records)
  list(GET records 2 straight)
  read_fields("${straight}" "" valid_loss)
  if(NOT valid_loss STREQUAL resumed_loss)
    message(FATAL_ERROR "${score}: resumed run's valid loss ${resumed_loss} != uninterrupted ${valid_loss}")
  endif()
endforeach()

# Refusals change nothing in the run directory.
set(run ${OUT_DIR}/additive)
directory_hashes(${run} hashes_before)
run_refused("already holds checkpoints" ${CLI} translate ${model} --steps 8 --out ${run})
run_refused("--score: checkpoint \"additive\", now \"dot\"" ${CLI} translate --score dot --steps 8 --out ${run} --resume)
run_refused("--hidden: checkpoint 8, now 16" ${CLI} translate --hidden 16 --steps 8 --out ${run} --resume)
require_unchanged(${run} "${hashes_before}" "a refusal")
run_refused("holds no checkpoint to resume" ${CLI} translate --steps 8 --out ${OUT_DIR}/empty --resume)
run_refused("no directory '${OUT_DIR}/missing'" ${CLI} translate --data ${OUT_DIR}/missing --out ${OUT_DIR}/x)
run_refused("--score: concat not in" ${CLI} translate --data ${DATA} --score concat --out ${OUT_DIR}/x)
run_refused("--data .* is required" ${CLI} translate --out ${OUT_DIR}/x)
