# What the CLI tests (cmake -P scripts) share: running the tool and checking
# its JSON. include() it from a test script.

# Runs ARGN; fails the test on a non-zero exit. Sets `out` to the stdout and
# `err` to the stderr.
function(run_ok)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc)
    message(FATAL_ERROR "'${ARGN}' failed (${rc}):\n${out}\n${err}")
  endif()
  set(out "${out}" PARENT_SCOPE)
  set(err "${err}" PARENT_SCOPE)
endfunction()

# Runs ARGN; it must be refused: a non-zero exit and a message matching `pattern`.
function(run_refused pattern)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc OR NOT "${out}${err}" MATCHES "${pattern}")
    message(FATAL_ERROR "'${ARGN}' should fail with '${pattern}': rc=${rc} output: ${out}${err}")
  endif()
endfunction()

# Sets a variable named after each key of ARGN to that member of the JSON
# object at `path` (a list, e.g. "rows;3"; "" for the top level) of `json`;
# a missing member fails the test.
function(read_fields json path)
  foreach(key ${ARGN})
    string(JSON value ERROR_VARIABLE missing GET "${json}" ${path} ${key})
    if(missing)
      message(FATAL_ERROR "JSON at '${path}' lacks '${key}': ${missing}")
    endif()
    set(${key} "${value}" PARENT_SCOPE)
  endforeach()
endfunction()

# The JSON array at the path ARGN of `json` has `expected` elements; `what`
# names it in the error.
function(require_length json expected what)
  string(JSON n LENGTH "${json}" ${ARGN})
  if(NOT n EQUAL expected)
    message(FATAL_ERROR "${what}: expected ${expected} elements, got ${n}:\n${json}")
  endif()
endfunction()

# Fails unless the run directory `run` holds exactly the checkpoints
# checkpoint-<step, 8 digits>.ckpt of the steps in ARGN (ascending).
function(expect_checkpoints run)
  file(GLOB found RELATIVE ${run} ${run}/checkpoint-*.ckpt)
  list(SORT found)
  set(expected "")
  foreach(step ${ARGN})
    string(LENGTH "${step}" digits)
    math(EXPR zeros "8 - ${digits}")
    string(REPEAT "0" ${zeros} pad)
    list(APPEND expected "checkpoint-${pad}${step}.ckpt")
  endforeach()
  if(NOT "${found}" STREQUAL "${expected}")
    message(FATAL_ERROR "${run}: expected the checkpoints of steps ${ARGN}, found: ${found}")
  endif()
endfunction()

# Sets `records` to the lines of run/metrics.jsonl; fails unless there are `count`.
function(read_metrics run count)
  file(STRINGS ${run}/metrics.jsonl lines)
  list(LENGTH lines n)
  if(NOT n EQUAL count)
    message(FATAL_ERROR "${run}/metrics.jsonl: expected ${count} records, got ${n}:\n${lines}")
  endif()
  set(records "${lines}" PARENT_SCOPE)
endfunction()

# Sets `var` to "file=sha256" of every file under `dir`: a fingerprint of a
# run directory, to check that a refused command changed nothing.
function(directory_hashes dir var)
  file(GLOB_RECURSE files ${dir}/*)
  set(hashes "")
  foreach(f ${files})
    file(SHA256 ${f} h)
    list(APPEND hashes "${f}=${h}")
  endforeach()
  set(${var} "${hashes}" PARENT_SCOPE)
endfunction()

# Fails, naming `what`, unless `dir` still has the fingerprint `before`
# (from directory_hashes).
function(require_unchanged dir before what)
  directory_hashes(${dir} now)
  if(NOT now STREQUAL before)
    message(FATAL_ERROR "${what} changed ${dir}:\nbefore ${before}\nafter ${now}")
  endif()
endfunction()

# A mechanism's name in JSON comes from the registry: "full", never "exact".
function(require_no_exact json what)
  string(FIND "${json}" "exact" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "${what} names a mechanism 'exact' (the registry says 'full'):\n${json}")
  endif()
endfunction()

# `tool --help` (the binary `cli`) lists each subcommand of ARGN, and each has
# its own help; sets `out` to the tool's help.
function(require_subcommands cli tool)
  run_ok(${cli} --help)
  set(help "${out}")
  foreach(sub ${ARGN})
    if(NOT help MATCHES "\n  ${sub} ")
      message(FATAL_ERROR "'${tool} --help' does not list ${sub}:\n${help}")
    endif()
  endforeach()
  foreach(sub ${ARGN})
    run_ok(${cli} ${sub} --help)
    if(NOT out MATCHES "Usage: .*${sub}")
      message(FATAL_ERROR "'${tool} ${sub} --help' is not its help:\n${out}")
    endif()
  endforeach()
  set(out "${help}" PARENT_SCOPE)
endfunction()
