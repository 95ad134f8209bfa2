// Precompiled header of dnallm_worker: LibTorch is heavy, so every worker translation unit
// (and the worker tests and mains, through REUSE_FROM) shares one compiled copy.
#pragma once

#include <torch/torch.h>
#include <torch/version.h>
