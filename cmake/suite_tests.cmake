# One CTest test per GoogleTest suite, not per test (ATTNKIT_TEST_PER_SUITE).
#
# gtest_discover_tests gives every test a process of its own. Under
# AddressSanitizer a process of the test binary is slow to start (loading
# libtorch, whose static registrations run through the sanitizer's
# allocator), so the sanitized unit suite spent most of its time starting
# processes (docs/RELIABILITY.md, section 7, "A process per suite under the
# sanitizers"). A process per suite pays that about 140 times instead of 600.
#
# attnkit_add_suite_tests(TARGET target LABELS labels...
#                         [PER_ISA_SUITES suites...] [APART tests...])
#   Registers, when CTest reads the tests (so the suites are those the built
#   binary lists, never a guess from the sources), one test per suite that
#   `target --gtest_list_tests` prints: named as the suite ("Suite" or
#   "Instance/Suite" for a parameterised one), running `--gtest_filter=Suite.*`
#   with labels LABELS, plus `per_isa` when the suite's name (without the
#   instance) is in PER_ISA_SUITES. Each test of APART (full names, e.g.
#   "TrainOverfit.TinyModelLearnsTheShippedText") is taken out of its suite's
#   process and registered alone with the extra label `apart`, for a runner to
#   include or leave out (scripts/test --sanitize leaves them out).
# The list is kept in a file next to the CTest files and made again whenever
# the binary is newer or the arguments changed. A binary that is not built or
# cannot list its tests gets one failing test in place of its suites.
function(attnkit_add_suite_tests)
  cmake_parse_arguments(arg "" "TARGET" "LABELS;PER_ISA_SUITES;APART" ${ARGN})
  set(include_file "${CMAKE_CURRENT_BINARY_DIR}/${arg_TARGET}_suites_include.cmake")
  set(list_file "${CMAKE_CURRENT_BINARY_DIR}/${arg_TARGET}_suites.cmake")
  # Lists pass through as strings with "|" (a ";" would split the set()).
  string(REPLACE ";" "|" labels "${arg_LABELS}")
  string(REPLACE ";" "|" per_isa "${arg_PER_ISA_SUITES}")
  string(REPLACE ";" "|" apart "${arg_APART}")
  file(GENERATE OUTPUT "${include_file}" CONTENT
"set(attnkit_suite_exe \"$<TARGET_FILE:${arg_TARGET}>\")
set(attnkit_suite_target \"${arg_TARGET}\")
set(attnkit_suite_cmake \"${CMAKE_COMMAND}\")
set(attnkit_suite_list \"${list_file}\")
set(attnkit_suite_labels \"${labels}\")
set(attnkit_suite_per_isa \"${per_isa}\")
set(attnkit_suite_apart \"${apart}\")
include(\"${PROJECT_SOURCE_DIR}/cmake/suite_tests_ctest.cmake\")
")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${include_file}")
endfunction()
