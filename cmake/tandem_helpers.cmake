# tandem_cc_library / tandem_cc_test / tandem_cc_binary: one helper each, in the
# spirit of Abseil's absl_cc_library. Every library is used through its
# tandem::<name> alias.

set(TANDEM_WARNINGS -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers)

function(tandem_cc_library)
  cmake_parse_arguments(T "" "NAME" "SRCS;HDRS;DEPS;PUBLIC_DEPS" ${ARGN})
  if(T_SRCS)
    add_library(tandem_${T_NAME} STATIC ${T_SRCS} ${T_HDRS})
    target_compile_options(tandem_${T_NAME} PRIVATE ${TANDEM_WARNINGS})
    target_include_directories(tandem_${T_NAME} PUBLIC ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
    target_link_libraries(tandem_${T_NAME} PUBLIC ${T_DEPS} ${T_PUBLIC_DEPS})
  else()
    add_library(tandem_${T_NAME} INTERFACE)
    target_include_directories(tandem_${T_NAME} INTERFACE ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
    target_link_libraries(tandem_${T_NAME} INTERFACE ${T_DEPS} ${T_PUBLIC_DEPS})
  endif()
  add_library(tandem::${T_NAME} ALIAS tandem_${T_NAME})
endfunction()

# Unit tests sit beside the code; each test binary is discovered by ctest.
function(tandem_cc_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT;FIXTURES_REQUIRED" "SRCS;DEPS;LABELS" ${ARGN})
  if(NOT TANDEM_BUILD_TESTS)
    return()
  endif()
  add_executable(${T_NAME} ${T_SRCS})
  target_compile_options(${T_NAME} PRIVATE ${TANDEM_WARNINGS})
  target_link_libraries(${T_NAME} PRIVATE ${T_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set(props TIMEOUT ${T_TIMEOUT})
  if(T_LABELS)
    # One label: gtest_discover_tests flattens a list into property names.
    list(LENGTH T_LABELS n_labels)
    if(n_labels GREATER 1)
      message(FATAL_ERROR "${T_NAME}: one label per test (got ${T_LABELS})")
    endif()
    list(APPEND props LABELS "${T_LABELS}")
  endif()
  # A ctest fixture (e.g. test data fetched by a setup test) run first.
  if(T_FIXTURES_REQUIRED)
    list(APPEND props FIXTURES_REQUIRED "${T_FIXTURES_REQUIRED}")
  endif()
  # Tests that start worker processes find the binary through TANDEM_BIN.
  gtest_discover_tests(${T_NAME} DISCOVERY_TIMEOUT 60
    PROPERTIES ${props} ENVIRONMENT "TANDEM_BIN=$<TARGET_FILE:tandem>")
endfunction()

# A libFuzzer target beside the code it fuzzes (`foo_fuzzer.cc`), built only
# with TANDEM_FUZZ. CORPUS is its seed folder in the source tree, DICT an
# optional libFuzzer dictionary, MAX_LEN the largest input in bytes and
# TIMEOUT the seconds one input may take. scripts/run_fuzzers.sh reads them
# from the build tree's fuzzers.txt.
function(tandem_cc_fuzzer)
  cmake_parse_arguments(T "" "NAME;CORPUS;DICT;MAX_LEN;TIMEOUT" "SRCS;DEPS" ${ARGN})
  if(NOT TANDEM_FUZZ)
    return()
  endif()
  add_executable(${T_NAME} ${T_SRCS})
  target_compile_options(${T_NAME} PRIVATE ${TANDEM_WARNINGS})
  target_link_libraries(${T_NAME} PRIVATE ${T_DEPS})
  target_link_options(${T_NAME} PRIVATE -fsanitize=fuzzer)
  set_target_properties(${T_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY "${PROJECT_BINARY_DIR}/fuzz")
  add_dependencies(fuzzers ${T_NAME})
  if(NOT T_MAX_LEN)
    set(T_MAX_LEN 4096)
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 10)
  endif()
  if(T_DICT)
    set(T_DICT "${CMAKE_CURRENT_SOURCE_DIR}/${T_DICT}")
  else()
    set(T_DICT "-")
  endif()
  # name binary corpus dict max_len timeout
  file(APPEND "${PROJECT_BINARY_DIR}/fuzzers.txt"
       "${T_NAME} ${PROJECT_BINARY_DIR}/fuzz/${T_NAME} ${CMAKE_CURRENT_SOURCE_DIR}/${T_CORPUS} ${T_DICT} ${T_MAX_LEN} ${T_TIMEOUT}\n")
endfunction()
