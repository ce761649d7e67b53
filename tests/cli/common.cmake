# What the CLI tests (cmake -P scripts) share: running the tool and checking
# its JSON. include() it from a test script.

# Runs ARGN; fails the test on a non-zero exit. Sets `out` to the stdout.
function(run_ok)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc)
    message(FATAL_ERROR "'${ARGN}' failed (${rc}):\n${out}\n${err}")
  endif()
  set(out "${out}" PARENT_SCOPE)
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
