# Read by CTest (see cmake/suite_tests.cmake): registers one test per suite
# of the binary ${attnkit_suite_exe}, from the list in ${attnkit_suite_list},
# which is written again from `--gtest_list_tests` whenever the binary is newer.
cmake_policy(PUSH)
cmake_policy(SET CMP0057 NEW)  # if(... IN_LIST ...); CTest sets no policies
string(REPLACE "|" ";" attnkit_suite_labels "${attnkit_suite_labels}")
string(REPLACE "|" ";" attnkit_suite_per_isa "${attnkit_suite_per_isa}")
string(REPLACE "|" ";" attnkit_suite_apart "${attnkit_suite_apart}")

if(NOT EXISTS "${attnkit_suite_exe}")
  # Not built: one test that fails and says so, as gtest_discover_tests does.
  add_test("${attnkit_suite_target}_NOT_BUILT" "${attnkit_suite_target}_NOT_BUILT")
  cmake_policy(POP)
  return()
endif()

if(NOT EXISTS "${attnkit_suite_list}" OR "${attnkit_suite_exe}" IS_NEWER_THAN "${attnkit_suite_list}")
  execute_process(COMMAND "${attnkit_suite_exe}" --gtest_list_tests
                  OUTPUT_VARIABLE listing ERROR_VARIABLE listing_errors RESULT_VARIABLE listed
                  TIMEOUT 120)
  if(NOT listed EQUAL 0)
    message(FATAL_ERROR "${attnkit_suite_exe} --gtest_list_tests failed (${listed}):\n${listing}\n${listing_errors}")
  endif()
  # Suite lines: "Suite." or "Instance/Suite." at the line's start (a typed
  # suite adds "  # TypeParam = ..."); test lines are indented.
  string(REPLACE ";" "\\;" listing "${listing}")
  string(REPLACE "\n" ";" lines "${listing}")
  set(suites "")
  set(suite "")
  set(generated "")
  foreach(line IN LISTS lines)
    if(line MATCHES "^([A-Za-z0-9_/]+)\\.( +#.*)?$")
      set(suite "${CMAKE_MATCH_1}")
      list(APPEND suites "${suite}")
      set(tests_of_${suite} "")
    elseif(line MATCHES "^  ([A-Za-z0-9_/]+)( +#.*)?$" AND suite)
      list(APPEND tests_of_${suite} "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  if(NOT suites)
    message(FATAL_ERROR "${attnkit_suite_exe} --gtest_list_tests listed no suite:\n${listing}")
  endif()
  foreach(suite IN LISTS suites)
    string(REGEX REPLACE "^.*/" "" bare "${suite}")
    set(labels ${attnkit_suite_labels})
    if(bare IN_LIST attnkit_suite_per_isa)
      list(APPEND labels per_isa)
    endif()
    string(REPLACE ";" "\\;" labels "${labels}")
    set(left_out "")
    set(kept 0)
    foreach(test IN LISTS tests_of_${suite})
      if("${suite}.${test}" IN_LIST attnkit_suite_apart)
        string(APPEND left_out ":${suite}.${test}")
        string(APPEND generated
               "add_test([=[${suite}.${test}]=] [=[${attnkit_suite_exe}]=] [=[--gtest_filter=${suite}.${test}]=])\n"
               "set_tests_properties([=[${suite}.${test}]=] PROPERTIES LABELS \"${labels}\\;apart\" TIMEOUT 1800)\n")
      else()
        math(EXPR kept "${kept} + 1")
      endif()
    endforeach()
    if(kept EQUAL 0)
      continue()
    endif()
    set(filter "${suite}.*")
    if(left_out)
      string(SUBSTRING "${left_out}" 1 -1 left_out)
      string(APPEND filter "-${left_out}")
    endif()
    string(APPEND generated
           "add_test([=[${suite}]=] [=[${attnkit_suite_exe}]=] [=[--gtest_filter=${filter}]=])\n"
           "set_tests_properties([=[${suite}]=] PROPERTIES LABELS \"${labels}\" TIMEOUT 1800)\n")
  endforeach()
  file(WRITE "${attnkit_suite_list}" "${generated}")
endif()
include("${attnkit_suite_list}")
cmake_policy(POP)
