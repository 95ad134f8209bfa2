#include "core/metrics.hpp"

#include <filesystem>

#include "core/error.hpp"

namespace dnallm {

std::vector<std::pair<std::string, double>> tensorboard_scalars(
    const nlohmann::ordered_json& event) {
  const std::string kind = event.value("event", std::string("train"));
  std::vector<std::pair<std::string, double>> scalars;
  for (const auto& [key, value] : event.items()) {
    if (value.is_number() && key != "step")
      scalars.emplace_back(kind + "/" + key, value.get<double>());
  }
  return scalars;
}

MetricsWriter::MetricsWriter(const MetricsOptions& options) : jsonl_path_(options.jsonl_path) {
  if (!jsonl_path_.empty()) {
    const auto parent = std::filesystem::path(jsonl_path_).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
    jsonl_.open(jsonl_path_, std::ios::out | (options.append ? std::ios::app : std::ios::trunc));
    DNALLM_CHECK(jsonl_.good(), ExitCode::kUsage, "cannot write logging.metrics_file \"{}\": {}",
                 jsonl_path_, errno_string());
  }
  if (!options.tensorboard_dir.empty()) {
    tensorboard_ = std::make_unique<EventFileWriter>(options.tensorboard_dir);
  }
}

MetricsWriter::~MetricsWriter() = default;

void MetricsWriter::write(const nlohmann::ordered_json& event) {
  if (tensorboard_) {
    const auto step = event.find("step");
    if (step != event.end() && step->is_number_integer()) tensorboard_step_ = step->get<int64_t>();
    tensorboard_->add_scalars(tensorboard_step_, tensorboard_scalars(event));
  }
  if (!jsonl_.is_open()) return;
  jsonl_ << event.dump() << '\n';
  jsonl_.flush();
}

std::string MetricsWriter::tensorboard_path() const {
  return tensorboard_ ? tensorboard_->path() : std::string();
}

}  // namespace dnallm
