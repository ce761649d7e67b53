# A checkpoint written into a full disk (issue 15, "faults while training"):
# under a file-size limit (ulimit -f, which an unprivileged test can set, where
# a small tmpfs would need root) the write fails. The run must stop with an
# error that names the file and the reason, leave no temporary file, keep the
# previous checkpoint intact, and continue from it with --resume once there is
# room again, ending where an uninterrupted run ends.
# --resume takes every option from the checkpoint but --threads (a session's
# own), so each resume passes the whole run's --threads 1: float rounding may
# depend on the thread count (on torch 2.6 it does, in libtorch's own CPU ops).
# Variables: CLI (the attnkit binary), TEXT (a small text file), OUT_DIR (scratch).
cmake_policy(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/common.cmake)

find_program(BASH bash REQUIRED)
file(REMOVE_RECURSE ${OUT_DIR})
file(MAKE_DIRECTORY ${OUT_DIR})
set(data ${OUT_DIR}/data)
run_ok(${CLI} data char-lm --input ${TEXT} --out ${data})
set(model --task char-lm --data ${data} --layers 1 --width 32 --heads 2 --ffn 64 --context 32 --batch 4
          --dropout 0 --seed 3 --threads 1 --lr 3e-3 --warmup 1 --eval-batches 1 --checkpoint-every 2
          --log-every 2 --display plain)

# The reference: 6 steps without interruption.
set(whole ${OUT_DIR}/whole)
run_ok(${CLI} train ${model} --steps 6 --out ${whole})

# 2 steps, then the same run continued under a limit smaller than a checkpoint.
set(run ${OUT_DIR}/limited)
run_ok(${CLI} train ${model} --steps 2 --out ${run})
file(SIZE ${run}/checkpoint-00000002.ckpt size)
file(SHA256 ${run}/checkpoint-00000002.ckpt before)
math(EXPR blocks "${size} / 1024 / 2")  # half a checkpoint, in ulimit's 1024-byte blocks
if(blocks LESS 1)
  message(FATAL_ERROR "a checkpoint of ${size} bytes is too small for this test")
endif()
execute_process(COMMAND ${BASH} -c "ulimit -f ${blocks}; exec \"$@\"" limited
                        ${CLI} train --out ${run} --resume --steps 6 --threads 1
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR rc MATCHES "[A-Za-z]")
  message(FATAL_ERROR "the limited run should fail with an error exit, got '${rc}':\n${out}\n${err}")
endif()
if(NOT err MATCHES "checkpoint-00000004.ckpt" OR NOT err MATCHES "File too large")
  message(FATAL_ERROR "the error should name the checkpoint and the reason:\n${err}")
endif()
file(GLOB leftovers ${run}/.*tmp*)
if(leftovers)
  message(FATAL_ERROR "temporary files left behind: ${leftovers}")
endif()
expect_checkpoints(${run} 2)
file(SHA256 ${run}/checkpoint-00000002.ckpt after)
if(NOT before STREQUAL after)
  message(FATAL_ERROR "the previous checkpoint changed")
endif()

# Room again: the run continues from step 2 and ends where the whole run ended.
run_ok(${CLI} train --out ${run} --resume --steps 6 --threads 1)
if(NOT out MATCHES "trained to step 6 of 6")
  message(FATAL_ERROR "resume after the failed write:\n${out}")
endif()
run_ok(${CLI} eval --run ${whole} --split valid --max-batches 2 --threads 1 --json ${OUT_DIR}/whole.json)
run_ok(${CLI} eval --run ${run} --split valid --max-batches 2 --threads 1 --json ${OUT_DIR}/limited.json)
file(READ ${OUT_DIR}/whole.json whole_json)
file(READ ${OUT_DIR}/limited.json limited_json)
read_fields("${whole_json}" "" value)
set(whole_value ${value})
read_fields("${limited_json}" "" value)
if(NOT whole_value STREQUAL value)
  message(FATAL_ERROR "resumed run's validation metric ${value} differs from the whole run's ${whole_value}")
endif()
