# dnallm_target_warnings(<target>): the project's warning set, applied per target so that
# third-party headers (included as SYSTEM) stay quiet.
function(dnallm_target_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wno-unused-parameter)
  # GCC 12 in C++20 mode warns -Wrestrict inside std::string assignments of literals (GCC bug
  # 105651, a false positive fixed in GCC 13).
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
    target_compile_options(${target} PRIVATE -Wno-restrict)
  endif()
endfunction()

# dnallm_executable(<name> SOURCES ... LINK ...): a thin main, placed in <build>/bin.
function(dnallm_executable name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LINK" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LINK})
  dnallm_target_warnings(${name})
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
endfunction()

# dnallm_library(<name> SOURCES ... [PUBLIC ...] [PRIVATE ...]): a module's library, its
# headers included from the project root, linking what PUBLIC and PRIVATE name.
function(dnallm_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC;PRIVATE" ${ARGN})
  add_library(${name} ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PUBLIC ${ARG_PUBLIC} PRIVATE ${ARG_PRIVATE})
  dnallm_target_warnings(${name})
  # Note [Unity batches]: the modules without LibTorch too (each unit parses spdlog, fmt, CLI11,
  # nlohmann/json or Boost.Asio again, 5-15 s of a unit's time).
  dnallm_unity_build(${name} BATCH ${DNALLM_LIBRARY_UNITY_BATCH})
endfunction()

# Note [Unity batches]: each LibTorch unit re-instantiates and re-optimises the same inline
# LibTorch code (torch::nn holders, TensorOptions, ...), which is most of its 15-65 s even with
# the precompiled header. A target's units compiled in batches (the source list's order, so one
# folder's files together) do that work once a batch: the worker library took 345 s in 14 steps
# where its 55 units took 15-64 s each (docs/build.md). A changed file rebuilds its batch only.
# DNALLM_UNITY_BATCH=0 (-D at configure) turns it off, e.g. to find which file of a batch an
# error is in. The units keep their helpers in anonymous namespaces: two files of one batch may
# not define the same helper name.
set(DNALLM_UNITY_BATCH 6 CACHE STRING "LibTorch units a unity batch (0: no unity builds)")
set(DNALLM_LIBRARY_UNITY_BATCH 8 CACHE STRING "units a unity batch in the libraries without LibTorch")

# dnallm_unity_build(<target> [BATCH n]): compile the target's units in batches of n
# (default DNALLM_UNITY_BATCH), unless DNALLM_UNITY_BATCH is 0.
function(dnallm_unity_build target)
  cmake_parse_arguments(ARG "" "BATCH" "" ${ARGN})
  if(NOT ARG_BATCH)
    set(ARG_BATCH ${DNALLM_UNITY_BATCH})
  endif()
  if(DNALLM_UNITY_BATCH GREATER 0)
    set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE ${ARG_BATCH})
  endif()
endfunction()
