# Read by CTest (see cmake/suite_tests.cmake): registers one test per suite
# of the binary ${attnkit_suite_exe}, from the list in ${attnkit_suite_list},
# which is written again from `--gtest_list_tests` whenever the binary is
# newer or what the list was made from (labels, suites, this file) changed.
cmake_policy(PUSH)
cmake_policy(SET CMP0057 NEW)  # if(... IN_LIST ...); CTest sets no policies
string(REPLACE "|" ";" attnkit_suite_labels "${attnkit_suite_labels}")
string(REPLACE "|" ";" attnkit_suite_per_isa "${attnkit_suite_per_isa}")
string(REPLACE "|" ";" attnkit_suite_apart "${attnkit_suite_apart}")

# A test that fails, with the suites' labels so that `-L unit` still runs it:
# a binary that is missing or cannot list its tests must not pass as a run
# that found nothing to do.
function(attnkit_suite_failing_test name)
  add_test("${name}" "${attnkit_suite_cmake}" -E false)
  set_tests_properties("${name}" PROPERTIES LABELS "${attnkit_suite_labels}")
endfunction()

string(MD5 attnkit_suite_signature
       "${attnkit_suite_exe}|${attnkit_suite_labels}|${attnkit_suite_per_isa}|${attnkit_suite_apart}")
file(MD5 "${CMAKE_CURRENT_LIST_FILE}" attnkit_suite_parser)
set(attnkit_suite_signature "# made from ${attnkit_suite_signature} ${attnkit_suite_parser}")
set(attnkit_suite_current FALSE)
if(EXISTS "${attnkit_suite_list}" AND NOT "${attnkit_suite_exe}" IS_NEWER_THAN "${attnkit_suite_list}")
  file(STRINGS "${attnkit_suite_list}" attnkit_suite_first LIMIT_COUNT 1)
  if(attnkit_suite_first STREQUAL attnkit_suite_signature)
    set(attnkit_suite_current TRUE)
  endif()
endif()

if(NOT EXISTS "${attnkit_suite_exe}")
  attnkit_suite_failing_test("${attnkit_suite_target}_NOT_BUILT")
elseif(attnkit_suite_current)
  include("${attnkit_suite_list}")
else()
  execute_process(COMMAND "${attnkit_suite_exe}" --gtest_list_tests
                  OUTPUT_VARIABLE listing ERROR_VARIABLE listing_errors RESULT_VARIABLE listed
                  TIMEOUT 120)
  # Suite lines: "Suite." or "Instance/Suite." at the line's start; test
  # lines are indented. Comments (" # GetParam() = ...", which may hold any
  # characters, brackets and semicolons too) go before the text is split.
  string(REGEX REPLACE " +#[^\n]*" "" names "${listing}")
  string(REPLACE ";" "" names "${names}")
  string(REPLACE "\n" ";" lines "${names}")
  set(suites "")
  set(suite "")
  foreach(line IN LISTS lines)
    if(line MATCHES "^([A-Za-z0-9_/]+)\\.$")
      set(suite "${CMAKE_MATCH_1}")
      list(APPEND suites "${suite}")
      set(tests_of_${suite} "")
    elseif(line MATCHES "^  ([A-Za-z0-9_/]+)$" AND NOT suite STREQUAL "")
      list(APPEND tests_of_${suite} "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  list(LENGTH suites suite_count)
  if(NOT listed EQUAL 0 OR suite_count EQUAL 0)
    message(WARNING "${attnkit_suite_exe} --gtest_list_tests (exit ${listed}) listed no suites; "
                    "${attnkit_suite_target}_LIST_FAILED fails in their place:\n${listing}\n${listing_errors}")
    attnkit_suite_failing_test("${attnkit_suite_target}_LIST_FAILED")
  else()
    set(generated "${attnkit_suite_signature}\n")
    foreach(suite IN LISTS suites)
      set(labels ${attnkit_suite_labels})
      string(REPLACE "/" ";" parts "${suite}")  # Instance/Suite, Suite/0 (typed)
      foreach(part IN LISTS parts)
        if(part IN_LIST attnkit_suite_per_isa)
          list(APPEND labels per_isa)
          break()
        endif()
      endforeach()
      set(left_out "")
      set(kept 0)
      foreach(test IN LISTS tests_of_${suite})
        if("${suite}.${test}" IN_LIST attnkit_suite_apart)
          string(APPEND left_out ":${suite}.${test}")
          string(APPEND generated
                 "add_test([=[${suite}.${test}]=] [=[${attnkit_suite_exe}]=] [=[--gtest_filter=${suite}.${test}]=])\n"
                 "set_tests_properties([=[${suite}.${test}]=] PROPERTIES LABELS \"${labels};apart\" TIMEOUT 1800)\n")
        else()
          math(EXPR kept "${kept} + 1")
        endif()
      endforeach()
      if(kept EQUAL 0)
        continue()
      endif()
      set(filter "${suite}.*")
      if(NOT left_out STREQUAL "")
        string(SUBSTRING "${left_out}" 1 -1 left_out)
        string(APPEND filter "-${left_out}")
      endif()
      string(APPEND generated
             "add_test([=[${suite}]=] [=[${attnkit_suite_exe}]=] [=[--gtest_filter=${filter}]=])\n"
             "set_tests_properties([=[${suite}]=] PROPERTIES LABELS \"${labels}\" TIMEOUT 1800)\n")
    endforeach()
    # Written whole, then renamed: another CTest reading meanwhile sees the
    # old list or the new one.
    file(WRITE "${attnkit_suite_list}.new" "${generated}")
    file(RENAME "${attnkit_suite_list}.new" "${attnkit_suite_list}")
    include("${attnkit_suite_list}")
  endif()
endif()
cmake_policy(POP)
