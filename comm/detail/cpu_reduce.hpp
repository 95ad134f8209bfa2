// Element-wise CPU reductions shared by the gloo and mpi backends.
//
// Note [Half-precision reduction]
// Neither gloo nor MPI reduces bf16, and MPI has no fp16: for both 16-bit types each
// pairwise step widens both operands to fp32, reduces, and rounds back to 16 bits
// (round-to-nearest-even), as NCCL does. Sums of values that are exact in the 16-bit type
// stay exact; otherwise the error is at most one rounding per reduction step.
#pragma once

#include <cstddef>

#include "comm/communicator.hpp"
#include "core/dtype.hpp"

namespace dnallm::comm::detail {

// out[i] = a[i] (+|max) b[i] for n elements of `dtype`; out may alias a or b. `op` is kSum
// or kMax (kAvg reduces as kSum; divide afterwards).
void reduce_elements(DType dtype, ReduceOp op, void* out, const void* a, const void* b, size_t n);

// buf[i] /= divisor (integer division for integer dtypes).
void divide_elements(DType dtype, void* buf, size_t n, int divisor);

}  // namespace dnallm::comm::detail
