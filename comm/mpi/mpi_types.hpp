// DType -> MPI_Datatype, shared by the mpi backend and the bench's raw-MPI peer. Includes
// <mpi.h>: only for code built with DNALLM_HAVE_MPI.
#pragma once

#include <mpi.h>

#include "core/dtype.hpp"

namespace dnallm::comm {

// fp16 and bf16 map to MPI_UINT16_T: MPI cannot add them, the backend reduces them with its
// own MPI_Op (a caller using MPI's built-in ops must refuse them).
inline MPI_Datatype mpi_datatype(DType t) {
  switch (t) {
    case DType::kFloat32:
      return MPI_FLOAT;
    case DType::kFloat64:
      return MPI_DOUBLE;
    case DType::kInt64:
      return MPI_INT64_T;
    case DType::kInt32:
      return MPI_INT32_T;
    case DType::kUInt8:
      return MPI_UINT8_T;
    case DType::kInt8:
      return MPI_INT8_T;
    case DType::kFloat16:
    case DType::kBFloat16:
      return MPI_UINT16_T;
  }
  return MPI_BYTE;
}

}  // namespace dnallm::comm
