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
endfunction()
