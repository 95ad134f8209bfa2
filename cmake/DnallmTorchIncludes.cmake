# Note [Torch's bundled fmt]
# LibTorch 2.x installs the fmt headers it was built with (fmt 12 in torch 2.11) in
# <torch>/include/fmt, the same folder as ATen/, c10/ and torch/. Putting that folder on the
# include path makes every `#include <fmt/...>` find torch's copy before the system fmt that
# spdlog was built with (fmt 9 on Debian 12 / Ubuntu 24.04): spdlog/common.h then fails
# ("'basic_format_string' is not a member of 'fmt'"), and mixing two fmt versions in one
# program would break the ODR anyway. LibTorch's own headers do not need fmt, so we hide it:
# for each torch include folder holding fmt/ (other than the folder the system fmt lives
# in, as with Debian's LibTorch in /usr/include), a "shadow" folder in the build tree gets a
# symbolic link to every entry of the torch folder except fmt, and replaces the torch folder
# in TORCH_INCLUDE_DIRS and in the include directories of every imported LibTorch target.
# The torch install is never modified. Re-run CMake after changing LibTorch.
#
# dnallm_shadow_torch_fmt(): call right after find_package(Torch) and find_package(fmt), in
# the same directory scope (imported targets are directory-scoped).
function(dnallm_shadow_torch_fmt)
  # Where the fmt we link against lives: never shadow that folder.
  set(_keep)
  if(TARGET fmt::fmt)
    get_target_property(_fmt_inc fmt::fmt INTERFACE_INCLUDE_DIRECTORIES)
    if(_fmt_inc)
      foreach(_d IN LISTS _fmt_inc)
        if(NOT _d MATCHES "\\$<")
          get_filename_component(_r "${_d}" REALPATH)
          list(APPEND _keep "${_r}")
        endif()
      endforeach()
    endif()
  endif()
  foreach(_d IN LISTS CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES)
    get_filename_component(_r "${_d}" REALPATH)
    list(APPEND _keep "${_r}")
  endforeach()

  # torch include folders that bundle fmt -> their shadow
  set(_from)
  set(_to)
  set(_index 0)
  foreach(_dir IN LISTS TORCH_INCLUDE_DIRS)
    get_filename_component(_real "${_dir}" REALPATH)
    if(NOT IS_DIRECTORY "${_real}/fmt")
      continue()
    endif()
    list(FIND _keep "${_real}" _kept)
    if(NOT _kept EQUAL -1)
      continue()
    endif()
    set(_shadow "${CMAKE_BINARY_DIR}/torch-include-shadow/${_index}")
    math(EXPR _index "${_index} + 1")
    file(REMOVE_RECURSE "${_shadow}")
    file(MAKE_DIRECTORY "${_shadow}")
    file(GLOB _entries RELATIVE "${_real}" "${_real}/*")
    foreach(_e IN LISTS _entries)
      if(NOT _e STREQUAL "fmt")
        file(CREATE_LINK "${_real}/${_e}" "${_shadow}/${_e}" SYMBOLIC)
      endif()
    endforeach()
    list(APPEND _from "${_real}")
    list(APPEND _to "${_shadow}")
    message(STATUS "LibTorch bundles fmt in ${_real}/fmt: using ${_shadow} (the same folder "
                   "without fmt/) so the system fmt that spdlog needs is found; see "
                   "Note [Torch's bundled fmt] in cmake/DnallmTorchIncludes.cmake")
  endforeach()
  if(NOT _from)
    return()
  endif()

  # Replaces shadowed folders in a list of include directories (entries compared by real path;
  # generator expressions are kept as they are).
  macro(_dnallm_replace_dirs _in _out)
    set(${_out})
    foreach(_x IN LISTS ${_in})
      set(_y "${_x}")
      if(NOT _x MATCHES "\\$<")
        get_filename_component(_rx "${_x}" REALPATH)
        list(FIND _from "${_rx}" _at)
        if(NOT _at EQUAL -1)
          list(GET _to ${_at} _y)
        endif()
      endif()
      list(APPEND ${_out} "${_y}")
    endforeach()
  endmacro()

  _dnallm_replace_dirs(TORCH_INCLUDE_DIRS _new_dirs)
  set(TORCH_INCLUDE_DIRS "${_new_dirs}" PARENT_SCOPE)

  set(_targets)
  if(NOT CMAKE_VERSION VERSION_LESS 3.21)
    get_directory_property(_targets IMPORTED_TARGETS)
  endif()
  list(APPEND _targets torch torch_cpu torch_cuda c10 c10_cuda torch_cpu_library
       torch_cuda_library torch_library)
  list(REMOVE_DUPLICATES _targets)
  foreach(_t IN LISTS _targets)
    if(NOT TARGET ${_t})
      continue()
    endif()
    get_target_property(_inc ${_t} INTERFACE_INCLUDE_DIRECTORIES)
    if(NOT _inc)
      continue()
    endif()
    _dnallm_replace_dirs(_inc _new_inc)
    if(NOT _new_inc STREQUAL _inc)
      set_target_properties(${_t} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_new_inc}")
    endif()
    get_target_property(_sys ${_t} INTERFACE_SYSTEM_INCLUDE_DIRECTORIES)
    if(_sys)
      _dnallm_replace_dirs(_sys _new_sys)
      set_target_properties(${_t} PROPERTIES INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${_new_sys}")
    endif()
  endforeach()
endfunction()
