#include "coordinator/store_wire.hpp"

namespace dnallm::coordinator {

FrameWriter encode_reason(const std::string& reason) { return FrameWriter().str(reason); }

std::string decode_reason(const uint8_t* fields, size_t n) {
  try {
    FrameReader r(fields, n);
    return r.done() ? std::string() : r.str();
  } catch (const ProtocolError&) {
    return std::string();
  }
}

}  // namespace dnallm::coordinator
