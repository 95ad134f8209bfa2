# The oldest LibTorch dnallm-dist builds against: the one inside PyTorch 2.4.
# Why 2.4: autocast's device-generic API (at::autocast::set_autocast_enabled(device, ...),
# worker/train/autocast.hpp) appeared there, and it is the newest of the APIs the worker
# needs (at::scaled_dot_product_attention: 2.0; the fused AdamW kernels: 2.1). No source
# branches on TORCH_VERSION below it. Tested: torch 2.14.1 (requirements.txt, CI: the CUDA
# flavour compiled, the suite run on the CPU) and 2.11 (the GPU node, docs/gpu.md).
# scripts/python-env.sh names the same minimum for install-deps.sh.
set(DNALLM_MIN_TORCH_VERSION 2.4)

# dnallm_check_torch_version(): call right after find_package(Torch).
function(dnallm_check_torch_version)
  if(NOT Torch_VERSION)
    message(WARNING "LibTorch did not report its version; dnallm-dist needs ${DNALLM_MIN_TORCH_VERSION} or newer")
  elseif(Torch_VERSION VERSION_LESS DNALLM_MIN_TORCH_VERSION)
    message(FATAL_ERROR
      "LibTorch ${Torch_VERSION} (${Torch_DIR}) is older than ${DNALLM_MIN_TORCH_VERSION}, the oldest "
      "dnallm-dist supports. Run scripts/install-deps.sh (it installs the torch pinned in "
      "requirements.txt into the project's Python environment) or pass a newer one with "
      "scripts/build.sh --libtorch PATH.")
  endif()
endfunction()
