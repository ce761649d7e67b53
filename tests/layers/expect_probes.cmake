# cmake -DBUILD_DIR=... -DCONTROL=target -DPROBES="t1;t2" -DHEADERS="h1;h2" -P expect_probes.cmake
# Builds CONTROL, which must compile, then each probe of PROBES, which must
# fail because its header (the same position in HEADERS) is not found.
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${CONTROL}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the control probe ${CONTROL} does not compile, so the layer's include "
                      "root is broken and the probes below prove nothing:\n${out}")
endif()
list(LENGTH PROBES count)
math(EXPR last "${count} - 1")
foreach(i RANGE ${last})
  list(GET PROBES ${i} probe)
  list(GET HEADERS ${i} header)
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${probe}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(rc EQUAL 0)
    message(FATAL_ERROR "${probe} compiled: a lower layer can include ${header}")
  endif()
  string(FIND "${out}" "${header}: No such file or directory" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${probe} failed, but not because ${header} is out of reach:\n${out}")
  endif()
  message(STATUS "${probe}: ${header} is out of reach, as it should be")
endforeach()
