# `attnkit train`, `eval` and `generate` as a user runs them, with tiny models:
# a run and its files, refusals that change nothing, SIGINT mid-run (exit 0,
# a loadable checkpoint, --resume finishes the run), swap-in eval, generation.
# Variables: CLI (the attnkit binary), TEXT (a small text file), OUT_DIR (scratch).
cmake_policy(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/common.cmake)

file(REMOVE_RECURSE ${OUT_DIR})
file(MAKE_DIRECTORY ${OUT_DIR})
set(data ${OUT_DIR}/data)
set(run ${OUT_DIR}/run)

# Help lists the commands and their flags.
run_ok(${CLI} --help)
foreach(sub train eval generate)
  if(NOT out MATCHES "\n  ${sub} ")
    message(FATAL_ERROR "'attnkit --help' does not list ${sub}:\n${out}")
  endif()
endforeach()
run_ok(${CLI} train --help)
foreach(flag --task --data --attention --layers --width --heads --ffn --context --batch --steps --lr
             --dropout --positions --seed --threads --out --resume --warmup --clip --checkpoint-every --dtype)
  if(NOT out MATCHES "${flag}")
    message(FATAL_ERROR "'attnkit train --help' lacks ${flag}:\n${out}")
  endif()
endforeach()

run_ok(${CLI} data char-lm --input ${TEXT} --out ${data})

set(model --task char-lm --data ${data} --layers 2 --width 32 --heads 2 --ffn 64 --context 32 --batch 4
          --dropout 0.1 --positions sinusoidal --seed 1 --threads 1 --lr 3e-3 --warmup 2)

# ---------------------------------------------------------------------------
# A run: 8 steps, checkpoints every 3 (the last two kept: 6 and 8), one
# metrics.jsonl record per 2 steps.
run_ok(${CLI} train ${model} --attention full --steps 8 --checkpoint-every 3 --log-every 2
       --eval-batches 2 --out ${run})
if(NOT out MATCHES "trained to step 8 of 8; checkpoint .*checkpoint-00000008.ckpt; valid loss")
  message(FATAL_ERROR "train's summary line:\n${out}")
endif()
expect_checkpoints(${run} 6 8)
read_metrics(${run} 4)  # steps 2, 4, 6, 8
list(GET records 3 last)
read_fields("${last}" "" step loss bpc accuracy lr tokens_per_s elapsed valid_loss valid_bpc)
if(NOT step EQUAL 8)
  message(FATAL_ERROR "the last record is of step ${step}, not 8")
endif()

# ---------------------------------------------------------------------------
# Refusals change nothing in the run directory.
directory_hashes(${run} hashes_before)
run_refused("already holds checkpoints" ${CLI} train ${model} --steps 8 --out ${run})
require_unchanged(${run} "${hashes_before}" "a fresh run into a used directory")
run_refused("model width: checkpoint 32, now 64" ${CLI} train --width 64 --heads 2 --steps 9 --out ${run} --resume)
require_unchanged(${run} "${hashes_before}" "a resume with other model flags")
# Position schemes compose with '+'; the refusals name what is wrong.
run_refused("unknown position scheme 'rotary'; expected one of conv, sinusoidal, learned, relative"
            ${CLI} train --data ${data} --positions conv+rotary --steps 2 --out ${OUT_DIR}/positions-refused)
run_refused("two absolute tables"
            ${CLI} train --data ${data} --positions sinusoidal+learned --steps 2 --out ${OUT_DIR}/positions-refused)

# A corrupted and a truncated newest checkpoint, in a copy of the run.
foreach(damage flip truncate)
  set(bad ${OUT_DIR}/bad-${damage})
  file(REMOVE_RECURSE ${bad})
  file(COPY ${run}/ DESTINATION ${bad})
  set(target ${bad}/checkpoint-00000008.ckpt)
  file(SIZE ${target} size)
  if(damage STREQUAL "flip")
    # Flip bit 2 of the byte in the middle, in place (dd conv=notrunc; printf's octal escape).
    math(EXPR at "${size} / 2")
    file(READ ${target} byte OFFSET ${at} LIMIT 1 HEX)
    math(EXPR flipped "0x${byte} ^ 4")
    math(EXPR o1 "${flipped} / 64")
    math(EXPR o2 "(${flipped} / 8) % 8")
    math(EXPR o3 "${flipped} % 8")
    execute_process(COMMAND sh -c "printf '\\${o1}${o2}${o3}' | dd of='${target}' bs=1 seek=${at} conv=notrunc status=none"
                    RESULT_VARIABLE rc)
    set(expect "CRC-32 mismatch")
  else()
    math(EXPR keep "${size} / 2")
    execute_process(COMMAND truncate -s ${keep} ${target} RESULT_VARIABLE rc)
    set(expect "truncated")
  endif()
  file(SIZE ${target} size_after)
  if(damage STREQUAL "flip")
    file(READ ${target} byte_after OFFSET ${at} LIMIT 1 HEX)
    if(rc OR NOT size_after EQUAL size OR byte_after STREQUAL byte)
      message(FATAL_ERROR "could not flip a bit of ${target}: rc=${rc}, ${byte} -> ${byte_after}")
    endif()
  elseif(rc OR NOT size_after EQUAL keep)
    message(FATAL_ERROR "could not truncate ${target}: rc=${rc}, ${size_after} bytes")
  endif()
  file(SHA256 ${bad}/checkpoint-00000008.ckpt damaged_hash)
  run_refused("checkpoint-00000008.ckpt' refused: [a-z]*:? ?${expect}" ${CLI} eval --run ${bad})
  run_refused("${expect}.*checkpoint-00000006.ckpt" ${CLI} train --out ${bad} --resume --steps 10)
  file(SHA256 ${bad}/checkpoint-00000008.ckpt hash_after)
  if(NOT damaged_hash STREQUAL hash_after OR EXISTS ${bad}/checkpoint-00000010.ckpt)
    message(FATAL_ERROR "a refused resume wrote into ${bad}")
  endif()
endforeach()

# ---------------------------------------------------------------------------
# eval: the trained attention and swapped-in mechanisms; JSON written.
run_ok(${CLI} eval --run ${run} --split test --threads 1 --json ${OUT_DIR}/eval.json)
if(NOT out MATCHES "attention full \\(trained\\): test bpc [0-9.]+")
  message(FATAL_ERROR "eval's line:\n${out}")
endif()
file(READ ${OUT_DIR}/eval.json json)
read_fields("${json}" "" checkpoint step split metric value loss bpc scored swapped seconds positions)
if(NOT step EQUAL 8 OR NOT metric STREQUAL "bpc" OR NOT split STREQUAL "test" OR swapped
   OR NOT positions GREATER_EQUAL scored OR NOT seconds GREATER 0)
  message(FATAL_ERROR "eval.json: ${json}")
endif()
if(NOT out MATCHES "s for ${positions} positions: [0-9.]+ us per position")
  message(FATAL_ERROR "eval's timing line:\n${out}")
endif()
run_ok(${CLI} eval --run ${run} --attention causal-linear --threads 1 --json ${OUT_DIR}/swap.json)
if(NOT out MATCHES "attention causal-linear \\(swapped in\\): valid bpc")
  message(FATAL_ERROR "eval --attention causal-linear:\n${out}")
endif()
run_refused("agglomerative" ${CLI} eval --run ${run} --attention agglomerative)

# generate: the same seed gives the same text, which starts with the prompt.
run_ok(${CLI} generate --run ${run} --prompt "the " --tokens 12 --seed 5 --top-k 3 --threads 1)
set(first "${out}")
run_ok(${CLI} generate --run ${run} --prompt "the " --tokens 12 --seed 5 --top-k 3 --threads 1)
if(NOT out STREQUAL first OR NOT out MATCHES "^the ")
  message(FATAL_ERROR "generate: '${first}' then '${out}'")
endif()

# ---------------------------------------------------------------------------
# --shared-weights (a universal transformer): one block's parameters however
# many layers, kept by a resume that does not repeat the flag, refused on a
# run made without it and with one --attention spec per block.
function(checkpoint_header ckpt)  # sets `header` to the checkpoint's JSON header
  file(STRINGS ${ckpt} lines REGEX "\"parameters\":[0-9]+")
  list(LENGTH lines n)
  if(NOT n EQUAL 1)
    message(FATAL_ERROR "${ckpt}: expected one JSON header with \"parameters\", found ${n}")
  endif()
  string(REGEX MATCH "{.*}" json "${lines}")
  set(header "${json}" PARENT_SCOPE)
endfunction()
run_ok(${CLI} train --help)
if(NOT out MATCHES "--shared-weights")
  message(FATAL_ERROR "'attnkit train --help' lacks --shared-weights:\n${out}")
endif()
set(small --task char-lm --data ${data} --width 32 --heads 2 --ffn 64 --context 32 --batch 4 --seed 1
          --threads 1 --warmup 1 --eval-batches 1)
run_ok(${CLI} train ${small} --layers 3 --shared-weights --steps 2 --out ${OUT_DIR}/universal)
run_ok(${CLI} train ${small} --layers 1 --steps 2 --out ${OUT_DIR}/one-layer)
run_ok(${CLI} train ${small} --layers 3 --steps 2 --out ${OUT_DIR}/three-layers)
checkpoint_header(${OUT_DIR}/universal/checkpoint-00000002.ckpt)
read_fields("${header}" "" parameters)
read_fields("${header}" "model" shared_weights layers)
set(universal_parameters ${parameters})
if(NOT shared_weights STREQUAL "ON" OR NOT layers EQUAL 3)
  message(FATAL_ERROR "the universal run's model options: shared_weights ${shared_weights}, layers ${layers}")
endif()
checkpoint_header(${OUT_DIR}/one-layer/checkpoint-00000002.ckpt)
read_fields("${header}" "" parameters)
set(one_layer_parameters ${parameters})
checkpoint_header(${OUT_DIR}/three-layers/checkpoint-00000002.ckpt)
read_fields("${header}" "" parameters)
if(NOT universal_parameters EQUAL one_layer_parameters OR NOT parameters GREATER universal_parameters)
  message(FATAL_ERROR "parameters: universal 3 layers ${universal_parameters}, 1 layer ${one_layer_parameters}, "
                      "3 layers ${parameters} (expected universal == 1 layer < 3 layers)")
endif()
run_ok(${CLI} train --out ${OUT_DIR}/universal --resume --steps 3 --display plain)
if(NOT out MATCHES "trained to step 3 of 3")
  message(FATAL_ERROR "resume of the universal run:\n${out}")
endif()
checkpoint_header(${OUT_DIR}/universal/checkpoint-00000003.ckpt)
read_fields("${header}" "model" shared_weights)
if(NOT shared_weights STREQUAL "ON")
  message(FATAL_ERROR "a resume without --shared-weights lost it: ${header}")
endif()
run_ok(${CLI} eval --run ${OUT_DIR}/universal --max-batches 1 --threads 1)
run_refused("model shared_weights: checkpoint false, now true"
            ${CLI} train --out ${OUT_DIR}/three-layers --resume --shared-weights --steps 3)
if(EXISTS ${OUT_DIR}/three-layers/checkpoint-00000003.ckpt)
  message(FATAL_ERROR "a refused --shared-weights resume trained")
endif()
run_refused("shared" ${CLI} train ${small} --layers 2 --shared-weights --attention full --attention causal-linear
            --steps 2 --out ${OUT_DIR}/universal-two-specs)

# ---------------------------------------------------------------------------
# SIGINT mid-run: the run stops after the current step with a checkpoint and
# exit 0; eval loads it; --resume (no other flags) finishes the run.
set(sig ${OUT_DIR}/sigint)
file(WRITE ${OUT_DIR}/sigint.sh "
\"$1\" train --task char-lm --data '${data}' --layers 2 --width 32 --heads 2 --ffn 64 --context 32 \\
    --batch 4 --threads 1 --steps 100000 --log-every 1 --checkpoint-every 100000 --display plain \\
    --out '${sig}' > '${OUT_DIR}/sigint.out' 2> '${OUT_DIR}/sigint.err' &
pid=$!
i=0
until grep -q '^step 2/' '${OUT_DIR}/sigint.err' 2>/dev/null; do
  i=$((i + 1))
  if [ $i -gt 600 ]; then kill -9 $pid; echo 'no progress line within 60 s'; exit 3; fi
  sleep 0.1
done
kill -INT $pid
wait $pid
echo \"exit=$?\"
")
execute_process(COMMAND sh ${OUT_DIR}/sigint.sh ${CLI} OUTPUT_VARIABLE sh_out RESULT_VARIABLE sh_rc)
file(READ ${OUT_DIR}/sigint.out sig_out)
file(READ ${OUT_DIR}/sigint.err sig_err)
if(NOT sh_out MATCHES "exit=0")
  message(FATAL_ERROR "SIGINT: expected exit 0, got '${sh_out}'\nstdout: ${sig_out}\nstderr: ${sig_err}")
endif()
if(NOT sig_err MATCHES "stopped by SIGINT after step ([0-9]+); checkpoint ([^ ]+) \\(continue with --resume\\)")
  message(FATAL_ERROR "SIGINT: no stop message:\n${sig_err}")
endif()
set(stopped_at ${CMAKE_MATCH_1})
if(NOT EXISTS ${CMAKE_MATCH_2} OR NOT sig_out MATCHES "interrupted at step ${stopped_at} of 100000")
  message(FATAL_ERROR "SIGINT: checkpoint '${CMAKE_MATCH_2}' / summary:\n${sig_out}")
endif()
run_ok(${CLI} eval --run ${sig} --max-batches 1 --threads 1)
math(EXPR more "${stopped_at} + 2")
run_ok(${CLI} train --out ${sig} --resume --steps ${more} --display plain)
if(NOT out MATCHES "trained to step ${more} of ${more}")
  message(FATAL_ERROR "resume after SIGINT:\n${out}")
endif()

# ---------------------------------------------------------------------------
# masked-char: an encoder on the same data; clustered attention swaps in (it
# has no causal form, so only a bidirectional model takes it).
# (attnkit-experiments approx --run on such a run: experiments/tests/tools_test.cmake.)
set(masked ${OUT_DIR}/masked)
run_ok(${CLI} train --task masked-char --data ${data} --layers 2 --width 32 --heads 2 --ffn 64 --context 32
       --batch 4 --steps 3 --warmup 1 --eval-batches 1 --seed 2 --threads 1 --out ${masked})
checkpoint_header(${masked}/checkpoint-00000003.ckpt)
read_fields("${header}" "model" architecture vocab_size)
if(NOT architecture STREQUAL "encoder" OR NOT vocab_size EQUAL 28)
  message(FATAL_ERROR "masked-char should train a 28-token encoder: ${header}")
endif()
run_ok(${CLI} eval --run ${masked} --attention improved-clustered:clusters=4,topk=8 --max-batches 2 --threads 1)
if(NOT out MATCHES "attention improved-clustered:clusters=4,topk=8 \\(swapped in\\): valid bpc [0-9.]+")
  message(FATAL_ERROR "masked-char swap-in eval:\n${out}")
endif()

# ---------------------------------------------------------------------------
# --dtype bf16: mixed precision. The header records it, the checkpoint holds
# float32 weights (eval reads it as any run), --resume keeps the dtype and
# refuses another; a bad value is refused naming the accepted ones.
set(bf16 ${OUT_DIR}/bf16)
run_refused("dtype must be float32, bf16 or bfloat16, got 'fp16'" ${CLI} train ${model} --steps 2 --dtype fp16
            --out ${bf16})
if(EXISTS ${bf16})
  message(FATAL_ERROR "a refused --dtype created the run directory")
endif()
run_ok(${CLI} train ${model} --steps 3 --dtype bf16 --eval-batches 1 --out ${bf16})
if(NOT out MATCHES "trained to step 3 of 3; checkpoint .*; valid loss [0-9.]+, bpc [0-9.]+")
  message(FATAL_ERROR "train --dtype bf16's summary line:\n${out}")
endif()
checkpoint_header(${bf16}/checkpoint-00000003.ckpt)
read_fields("${header}" "trainer" dtype)
if(NOT dtype STREQUAL "bf16")
  message(FATAL_ERROR "the bf16 run's header says dtype '${dtype}': ${header}")
endif()
if(header MATCHES "\"dtype\":\"BFloat16\"" OR NOT header MATCHES "\"dtype\":\"Float\"")
  message(FATAL_ERROR "the bf16 run's checkpoint should hold float32 tensors: ${header}")
endif()
run_ok(${CLI} eval --run ${bf16} --max-batches 1 --threads 1)
run_refused("trainer dtype: checkpoint \"bf16\", now \"float32\"" ${CLI} train --out ${bf16} --resume --steps 4
            --dtype float32)
run_ok(${CLI} train --out ${bf16} --resume --steps 4 --display quiet)
expect_checkpoints(${bf16} 3 4)

# ---------------------------------------------------------------------------
# Flags renamed by the naming pass: the old name still works, hidden from
# --help, with one warning line on stderr; the run is the new name's, and its
# checkpoint stores today's key (task.copy_length).
run_ok(${CLI} train --help)
if(NOT out MATCHES "--copy-length" OR out MATCHES "--length[ =]")
  message(FATAL_ERROR "'attnkit train --help' should list --copy-length and not --length:\n${out}")
endif()
set(copy_model --task copy --layers 1 --width 16 --heads 2 --ffn 32 --batch 4 --steps 2 --eval-batches 1
               --threads 1 --display quiet)
run_ok(${CLI} train ${copy_model} --copy-length 5 --out ${OUT_DIR}/copy-new)
if(NOT err STREQUAL "")
  message(FATAL_ERROR "--copy-length warned:\n${err}")
endif()
run_ok(${CLI} train ${copy_model} --length 5 --out ${OUT_DIR}/copy-old)
if(NOT err STREQUAL "attnkit train: --length is deprecated, use --copy-length (same meaning)\n")
  message(FATAL_ERROR "--length's warning:\n${err}")
endif()
foreach(name copy-new copy-old)
  checkpoint_header(${OUT_DIR}/${name}/checkpoint-00000002.ckpt)
  read_fields("${header}" "task" copy_length)
  string(JSON old_key ERROR_VARIABLE absent GET "${header}" task length)
  if(NOT copy_length EQUAL 5 OR NOT absent)
    message(FATAL_ERROR "${name}: the task options should hold copy_length 5 only: ${header}")
  endif()
endforeach()
run_refused("copy_length: checkpoint 5, now 6" ${CLI} train --out ${OUT_DIR}/copy-old --resume --steps 3 --length 6)

# ---------------------------------------------------------------------------
# --block llama: the modern decoder block (RMSNorm, SwiGLU, no biases, rope)
# with one key/value head (multi-query) trains, stores its options, resumes
# without the flag, refuses the classic block on resume, evaluates and
# generates.
set(llama ${OUT_DIR}/llama)
run_ok(${CLI} train ${small} --layers 2 --kv-heads 1 --block llama --steps 2 --out ${llama})
checkpoint_header(${llama}/checkpoint-00000002.ckpt)
read_fields("${header}" "model" normalization feed_forward bias positions kv_heads)
if(NOT normalization STREQUAL "rms" OR NOT feed_forward STREQUAL "swiglu" OR NOT bias STREQUAL "OFF"
   OR NOT positions STREQUAL "rope" OR NOT kv_heads EQUAL 1)
  message(FATAL_ERROR "the llama run's model options: ${header}")
endif()
run_ok(${CLI} train --out ${llama} --resume --steps 3 --display quiet)
expect_checkpoints(${llama} 2 3)
run_refused("model normalization: checkpoint \"rms\", now absent \\(the default\\)"
            ${CLI} train --out ${llama} --resume --block classic --steps 4)
run_ok(${CLI} eval --run ${llama} --max-batches 1 --threads 1)
run_ok(${CLI} generate --run ${llama} --prompt "the " --tokens 8 --seed 3 --threads 1)
if(NOT out MATCHES "^the ")
  message(FATAL_ERROR "generate from the llama run: '${out}'")
endif()
# Each part alone, and the block refined by a flag given beside it.
run_ok(${CLI} train ${small} --layers 1 --block llama --positions conv+rope --steps 1 --out ${OUT_DIR}/llama-conv)
checkpoint_header(${OUT_DIR}/llama-conv/checkpoint-00000001.ckpt)
read_fields("${header}" "model" positions)
if(NOT positions STREQUAL "conv+rope")
  message(FATAL_ERROR "--block llama --positions conv+rope stored positions '${positions}'")
endif()
run_ok(${CLI} train ${small} --layers 1 --normalization rms --feed-forward swiglu --no-bias --steps 1
       --out ${OUT_DIR}/modern-parts)
run_refused("bias = false" ${CLI} train ${small} --layers 1 --no-bias --attention agglomerative --steps 1
            --out ${OUT_DIR}/agglomerative-no-bias)

# --max-length: the rows of the position table, stored; a context past them is refused up front.
run_ok(${CLI} train ${small} --layers 1 --max-length 40 --steps 1 --out ${OUT_DIR}/max-length)
checkpoint_header(${OUT_DIR}/max-length/checkpoint-00000001.ckpt)
read_fields("${header}" "model" max_length)
if(NOT max_length EQUAL 40)
  message(FATAL_ERROR "--max-length 40 stored max_length ${max_length}")
endif()
run_refused("sequences of 32 tokens exceed the model's max_length 16"
            ${CLI} train ${small} --layers 1 --max-length 16 --steps 1 --out ${OUT_DIR}/max-length-short)
