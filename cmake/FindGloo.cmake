# Finds Debian's libgloo-dev (headers in /usr/include/gloo, libgloo.so in /usr/lib).
# Defines Gloo_FOUND and the imported target Gloo::gloo.
find_path(Gloo_INCLUDE_DIR gloo/allreduce.h)
find_library(Gloo_LIBRARY NAMES gloo PATHS /usr/lib /usr/lib/x86_64-linux-gnu)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Gloo DEFAULT_MSG Gloo_LIBRARY Gloo_INCLUDE_DIR)
if(Gloo_FOUND AND NOT TARGET Gloo::gloo)
  add_library(Gloo::gloo UNKNOWN IMPORTED)
  set_target_properties(Gloo::gloo PROPERTIES
    IMPORTED_LOCATION "${Gloo_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${Gloo_INCLUDE_DIR}")
endif()
mark_as_advanced(Gloo_INCLUDE_DIR Gloo_LIBRARY)
