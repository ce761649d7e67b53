# `attnkit-experiments cloze` as a user runs it, with a tiny reader on the shipped text: a
# run's files, --resume (which must end where an uninterrupted run ends, to the
# bit), refusals that change nothing.
# Variables: CLI (the attnkit-experiments binary), ATTNKIT (the attnkit binary, which
# prepares the text), TEXT (a small text file), OUT_DIR (scratch).
cmake_policy(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/../../tests/cli/common.cmake)

file(REMOVE_RECURSE ${OUT_DIR})
file(MAKE_DIRECTORY ${OUT_DIR})
set(data ${OUT_DIR}/data)

run_ok(${CLI} --help)
if(NOT out MATCHES "\n  cloze ")
  message(FATAL_ERROR "'attnkit-experiments --help' does not list cloze:\n${out}")
endif()
run_ok(${CLI} cloze --help)
foreach(flag --data --readout --steps --batch --seed --threads --out --resume --embedding --hidden
             --paragraph --query --eval-every)
  if(NOT out MATCHES "${flag}")
    message(FATAL_ERROR "'attnkit-experiments cloze --help' lacks ${flag}:\n${out}")
  endif()
endforeach()

run_ok(${ATTNKIT} data char-lm --input ${TEXT} --out ${data})

set(model --data ${data} --paragraph 30 --query 8 --min-count 2 --stop-words 20 --embedding 8
          --hidden 8 --batch 4 --seed 1 --threads 1 --valid-examples 16 --test-examples 16)

foreach(readout none linear gated softmax)
  # 4 steps, a record and a checkpoint every 2; then --resume to 6. The gated
  # reader shares one GRU between document and query.
  set(run ${OUT_DIR}/${readout})
  set(extra "")
  if(readout STREQUAL "gated")
    set(extra --shared-encoder)
  endif()
  run_ok(${CLI} cloze ${model} ${extra} --readout ${readout} --steps 4 --eval-every 2 --out ${run})
  if(NOT out MATCHES "readout ${readout}, seed 1" OR NOT out MATCHES "step 2/4 .* ETA [0-9]"
     OR NOT out MATCHES "trained to step 4 of 4; test accuracy")
    message(FATAL_ERROR "cloze ${readout}'s output:\n${out}")
  endif()
  expect_checkpoints(${run} 2 4)
  read_metrics(${run} 2)
  list(GET records 1 last)
  read_fields("${last}" "" step loss accuracy valid_loss valid_accuracy elapsed)
  if(NOT step EQUAL 4)
    message(FATAL_ERROR "the last record is of step ${step}, not 4")
  endif()
  file(READ ${run}/result.json result)
  read_fields("${result}" "" readout test_accuracy test_examples baselines train_seconds session)
  read_fields("${result}" "baselines;test" frequency random mean_candidates)
  read_fields("${result}" "session" loadavg_start loadavg_end)
  if(NOT test_examples EQUAL 16 OR test_accuracy LESS 0 OR test_accuracy GREATER 1)
    message(FATAL_ERROR "result.json: ${result}")
  endif()

  run_ok(${CLI} cloze --steps 6 --out ${run} --resume)
  if(NOT out MATCHES "resuming .*checkpoint-00000004.ckpt at step 4" OR NOT out MATCHES "trained to step 6 of 6")
    message(FATAL_ERROR "cloze --resume's output:\n${out}")
  endif()
  read_metrics(${run} 3)  # after --resume
  list(GET records 2 resumed)
  read_fields("${resumed}" "" step valid_loss)
  set(resumed_loss ${valid_loss})

  # The same 6 steps without interruption end with the same weights.
  run_ok(${CLI} cloze ${model} ${extra} --readout ${readout} --steps 6 --eval-every 2 --out ${run}-straight)
  file(STRINGS ${run}-straight/metrics.jsonl records)
  list(GET records 2 straight)
  read_fields("${straight}" "" step valid_loss)
  if(NOT valid_loss STREQUAL resumed_loss)
    message(FATAL_ERROR "${readout}: resumed run's valid loss ${resumed_loss} != uninterrupted ${valid_loss}")
  endif()
endforeach()

# Refusals change nothing in the run directory.
set(run ${OUT_DIR}/softmax)
directory_hashes(${run} hashes_before)
run_refused("already holds checkpoints" ${CLI} cloze ${model} --steps 8 --out ${run})
run_refused("--readout: checkpoint \"softmax\", now \"linear\"" ${CLI} cloze --readout linear --steps 8 --out ${run} --resume)
run_refused("--hidden: checkpoint 8, now 16" ${CLI} cloze --hidden 16 --steps 8 --out ${run} --resume)
require_unchanged(${run} "${hashes_before}" "a refusal")
run_refused("holds no checkpoint to resume" ${CLI} cloze --steps 8 --out ${OUT_DIR}/empty --resume)
run_refused("data directory '${OUT_DIR}/missing' does not exist" ${CLI} cloze --data ${OUT_DIR}/missing --out ${OUT_DIR}/x)
run_refused("--readout: attention not in" ${CLI} cloze --data ${data} --readout attention --out ${OUT_DIR}/x)
run_refused("paragraph \\(words per paragraph, 5\\) must be >= query" ${CLI} cloze --data ${data} --paragraph 5 --query 8 --out ${OUT_DIR}/x)
