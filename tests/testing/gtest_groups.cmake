# Writes the CTest entries of one gtest binary, one entry per test suite (a
# suite with SHARDS gets that many entries, gtest's own sharding), instead of
# gtest_discover_tests' one process per case. Run by ctest as it starts,
# whenever the binary, this script or its settings are newer than CTEST_FILE
# (tests/CMakeLists.txt, gtopk_gtest_groups); CTest then reads CTEST_FILE.
#
# A failing case is still named: gtest prints "[  FAILED  ] Suite.Case" for
# each, and ctest --output-on-failure shows it; a crash or a hang ends the
# entry after the "[ RUN      ] Suite.Case" it was in.
#
# Skips: an entry is "Skipped" only when every case in it skipped and none
# failed (the GPU tests without a device). gtest_discover_tests' regex
# "\[  SKIPPED \]" cannot be used for a group: CTest lets a matching skip
# regex override a failure, so one skipped case would hide another's failure.
# The regex below matches only gtest's final summary of a run in which no
# case passed or failed: "[  PASSED  ] 0 tests.", then the skipped list to
# the end of the output (a failed case would be listed after it).
#
# An entry whose filter selects no case (a suite renamed since the list was
# made) fails: gtest would exit 0 having run nothing ("Running 0 tests from").
#
# Settings: ARGS_FILE (-D), written by gtopk_gtest_groups at configure time:
# EXECUTABLE, TARGET (entry names: TARGET.Suite[SUFFIX]), SUFFIX, CTEST_FILE,
# WORKING_DIR, DISCOVERY_TIMEOUT, SHARDS ("Suite=N" items), EXCLUDE (a gtest
# negative filter, "Pattern:Pattern": the cases these entries leave out),
# LABELS, ENVIRONMENT, TIMEOUT, COST, RESOURCE_GROUPS (each entry's).
cmake_minimum_required(VERSION 3.25)
include("${ARGS_FILE}")

set(list_filter)
if(EXCLUDE)
  set(list_filter "--gtest_filter=*-${EXCLUDE}")
endif()
execute_process(
  COMMAND "${EXECUTABLE}" --gtest_list_tests ${list_filter}
  WORKING_DIRECTORY "${WORKING_DIR}"
  TIMEOUT ${DISCOVERY_TIMEOUT}
  OUTPUT_VARIABLE output
  RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "${EXECUTABLE} --gtest_list_tests: ${result}\n${output}")
endif()

# Suites in the order gtest lists them, with their number of cases.
string(REPLACE ";" "\\;" output "${output}")
string(REPLACE "\n" ";" lines "${output}")
set(suites)
set(suite "")
foreach(line IN LISTS lines)
  if(line MATCHES "^Running main\\(\\)" OR line STREQUAL "")
    continue()
  elseif(line MATCHES "^  ")
    if(suite STREQUAL "")
      message(FATAL_ERROR "${EXECUTABLE}: a case before any suite: ${line}")
    endif()
    math(EXPR "count_${suite}" "${count_${suite}} + 1")
  else()
    string(REGEX REPLACE "\\.( *#.*)?$" "" suite "${line}")
    if(suite MATCHES "[^A-Za-z0-9_/]")
      message(FATAL_ERROR "${EXECUTABLE}: unexpected suite name '${suite}'")
    endif()
    list(APPEND suites "${suite}")
    set("count_${suite}" 0)
  endif()
endforeach()

set(skip_regex "\\[  PASSED  \\] 0 tests\\.\n\\[  SKIPPED \\] [0-9]+ tests?, listed below:\n(\\[  SKIPPED \\] [^\n]*\n)*$")

set(script "")
foreach(suite IN LISTS suites)
  set(filter "--gtest_filter=${suite}.*")
  if(EXCLUDE)
    string(APPEND filter "-${EXCLUDE}")
  endif()
  set(shards 1)
  foreach(spec IN LISTS SHARDS)
    if(spec MATCHES "^(.*)=([0-9]+)$" AND CMAKE_MATCH_1 STREQUAL suite)
      set(shards ${CMAKE_MATCH_2})
    endif()
  endforeach()
  if(shards GREATER count_${suite})
    set(shards ${count_${suite}})
  endif()
  foreach(i RANGE 1 ${shards})
    set(name "${TARGET}.${suite}${SUFFIX}")
    set(env ${ENVIRONMENT})
    if(shards GREATER 1)
      string(APPEND name ".${i}of${shards}")
      math(EXPR index "${i} - 1")
      list(APPEND env "GTEST_TOTAL_SHARDS=${shards}" "GTEST_SHARD_INDEX=${index}")
    endif()
    string(APPEND script
      "add_test([==[${name}]==] [==[${EXECUTABLE}]==] [==[${filter}]==])\n"
      "set_tests_properties([==[${name}]==] PROPERTIES\n"
      "  WORKING_DIRECTORY [==[${WORKING_DIR}]==]\n"
      "  SKIP_REGULAR_EXPRESSION [==[${skip_regex}]==]\n"
      "  FAIL_REGULAR_EXPRESSION [==[Running 0 tests from]==]\n"
      "  LABELS [==[${LABELS}]==]\n")
    if(TIMEOUT)
      string(APPEND script "  TIMEOUT ${TIMEOUT}\n")
    endif()
    if(COST)
      string(APPEND script "  COST ${COST}\n")
    endif()
    if(RESOURCE_GROUPS)
      string(APPEND script "  RESOURCE_GROUPS [==[${RESOURCE_GROUPS}]==]\n")
    endif()
    if(env)
      string(APPEND script "  ENVIRONMENT [==[${env}]==]\n")
    endif()
    string(APPEND script ")\n")
  endforeach()
endforeach()
file(WRITE "${CTEST_FILE}" "${script}")
