// safetensors: the format is checkpoint/safetensors.hpp's; here only torch tensors meet it.
#include "worker/models/torch_safetensors.hpp"

#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "worker/tensor_buffer.hpp"

namespace dnallm::models {

using torch::Tensor;

checkpoint::SafetensorsTensor safetensors_tensor(const std::string& name, const Tensor& t) {
  auto c = t.detach().to(torch::kCPU).contiguous();
  const auto dtype = dtype_of(c.scalar_type());
  DNALLM_CHECK(dtype.has_value(), ExitCode::kFailure, "safetensors: unsupported dtype {} of {}",
               c10::toString(c.scalar_type()), name);
  checkpoint::SafetensorsTensor out{name, *dtype, c.sizes().vec(), nullptr};
  out.write_data = [c](const checkpoint::ByteSink& sink) {  // little-endian host (x86-64, aarch64)
    sink(c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size());
  };
  return out;
}

std::vector<checkpoint::SafetensorsTensor> safetensors_tensors(
    const std::vector<std::pair<std::string, Tensor>>& tensors) {
  std::vector<checkpoint::SafetensorsTensor> out;
  out.reserve(tensors.size());
  for (const auto& [name, t] : tensors) out.push_back(safetensors_tensor(name, t));
  return out;
}

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  checkpoint::write_safetensors(path, safetensors_tensors(tensors), metadata);
}

std::map<std::string, Tensor> load_safetensors(const std::string& path) {
  checkpoint::SafetensorsReader reader(path);  // the header checked (Note [Untrusted files])
  std::map<std::string, Tensor> out;
  for (const auto& [name, entry] : reader.file().tensors) {
    auto t =
        torch::empty(entry.spec.shape, torch::TensorOptions().dtype(torch_dtype(entry.spec.dtype)));
    reader.read(entry, t.data_ptr());
    // A weight that is NaN or infinite makes every output NaN: a damaged file.
    DNALLM_CHECK(!t.is_floating_point() || t.numel() == 0 || torch::isfinite(t).all().item<bool>(),
                 ExitCode::kCheckpointCorrupt,
                 "{}: tensor {} holds NaN or infinite values: the file is damaged; re-export or "
                 "re-download it",
                 path, clip_for_message(name));
    out.emplace(name, t);
  }
  return out;
}

}  // namespace dnallm::models
