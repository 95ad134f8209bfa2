#include "checkpoint/train_state.hpp"

#include <limits>

#include "core/error.hpp"

namespace dnallm::checkpoint {
namespace {

using nlohmann::json;

// What a value of C++ type T looks like in the state, and its description in errors.
template <class T>
struct JsonType;
template <>
struct JsonType<int64_t> {
  static bool accepts(const json& v) {
    return v.is_number_integer() &&
           (!v.is_number_unsigned() ||
            v.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()));
  }
  static constexpr const char* kName = "an integer";
};
template <>
struct JsonType<int> {
  static bool accepts(const json& v) {
    if (!JsonType<int64_t>::accepts(v)) return false;
    const auto x = v.get<int64_t>();
    return x >= std::numeric_limits<int>::min() && x <= std::numeric_limits<int>::max();
  }
  static constexpr const char* kName = "an integer";
};
template <>
struct JsonType<uint64_t> {
  static bool accepts(const json& v) {
    return v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0);
  }
  static constexpr const char* kName = "a non-negative integer";
};
template <>
struct JsonType<double> {
  static bool accepts(const json& v) { return v.is_number(); }
  static constexpr const char* kName = "a number";
};
template <>
struct JsonType<std::string> {
  static bool accepts(const json& v) { return v.is_string(); }
  static constexpr const char* kName = "a string";
};
template <>
struct JsonType<std::vector<int64_t>> {
  static bool accepts(const json& v) {
    if (!v.is_array()) return false;
    for (const auto& d : v)
      if (!JsonType<int64_t>::accepts(d)) return false;
    return true;
  }
  static constexpr const char* kName = "an array of integers";
};
template <>
struct JsonType<json> {  // opaque: any value
  static bool accepts(const json&) { return true; }
  static constexpr const char* kName = "any value";
};

// The keys of one JSON object of the state; `path` names it in errors ("state.rng").
class Fields {
 public:
  Fields(const json& object, std::string path, const std::string& where)
      : object_(object), path_(std::move(path)), where_(where) {
    if (!object_.is_object()) wrong_type("", object_, "an object");
  }

  template <class T>
  std::optional<T> optional(const char* key) const {
    const auto it = object_.find(key);
    if (it == object_.end()) return std::nullopt;
    if (!JsonType<T>::accepts(*it)) wrong_type(key, *it, JsonType<T>::kName);
    return it->template get<T>();
  }
  template <class T>
  T required(const char* key) const {
    auto v = optional<T>(key);
    if (!v) missing(key);
    return std::move(*v);
  }
  std::optional<Fields> optional_object(const char* key) const {
    const auto it = object_.find(key);
    if (it == object_.end()) return std::nullopt;
    return Fields(*it, name(key), where_);
  }
  Fields required_object(const char* key) const {
    auto f = optional_object(key);
    if (!f) missing(key);
    return *f;
  }
  // The elements of array `key`, each an object, as Fields named "path.key[i]".
  std::vector<Fields> required_objects(const char* key) const {
    auto items = optional_objects(key);
    if (!items) missing(key);
    return std::move(*items);
  }
  std::optional<std::vector<Fields>> optional_objects(const char* key) const {
    const auto it = object_.find(key);
    if (it == object_.end()) return std::nullopt;
    if (!it->is_array()) wrong_type(key, *it, "an array");
    std::vector<Fields> items;
    for (size_t i = 0; i < it->size(); ++i) {
      items.emplace_back((*it)[i], name(key) + "[" + std::to_string(i) + "]", where_);
    }
    return items;
  }

 private:
  std::string name(const char* key) const { return *key ? path_ + "." + key : path_; }
  [[noreturn]] void missing(const char* key) const {
    fail(ExitCode::kCheckpointCorrupt,
         "checkpoint manifest {}: {} is missing; the checkpoint is damaged or was not written "
         "by dnallm-train: use another checkpoint",
         where_, name(key));
  }
  [[noreturn]] void wrong_type(const char* key, const json& v, const char* want) const {
    fail(ExitCode::kCheckpointCorrupt,
         "checkpoint manifest {}: {} is {} ({}), expected {}; the checkpoint is damaged or was "
         "not written by dnallm-train: use another checkpoint",
         where_, name(key), v.type_name(), v.dump().substr(0, 40), want);
  }

  const json& object_;
  std::string path_;
  std::string where_;
};

// The state's keys, each named once here and used by to_json and the readers below.
constexpr const char* kStep = "step";
constexpr const char* kAdamSteps = "adam_steps";
constexpr const char* kLossScaler = "loss_scaler";
constexpr const char* kScale = "scale";
constexpr const char* kCleanSteps = "clean_steps";
constexpr const char* kSkipped = "skipped";
constexpr const char* kSampler = "sampler";
constexpr const char* kRng = "rng";
constexpr const char* kScheme = "scheme";
constexpr const char* kSeed = "seed";
constexpr const char* kConfigHash = "config_hash";
constexpr const char* kTokenizer = "tokenizer";
constexpr const char* kVersion = "version";
constexpr const char* kWorldSize = "world_size";
constexpr const char* kMicroBatchSize = "micro_batch_size";
constexpr const char* kGradAccumSteps = "grad_accum_steps";
constexpr const char* kZeroStage = "zero_stage";
constexpr const char* kLayout = "layout";
constexpr const char* kName = "name";
constexpr const char* kOffset = "offset";
constexpr const char* kShape = "shape";
constexpr const char* kConfig = "config";

json layout_to_json(const std::vector<LayoutEntry>& layout) {
  json entries = json::array();
  for (const auto& e : layout) {
    entries.push_back({{kName, e.name}, {kOffset, e.offset}, {kShape, e.shape}});
  }
  return entries;
}

std::vector<LayoutEntry> layout_from(const std::vector<Fields>& entries) {
  std::vector<LayoutEntry> layout;
  for (const auto& e : entries) {
    layout.push_back({e.required<std::string>(kName), e.required<int64_t>(kOffset),
                      e.required<std::vector<int64_t>>(kShape)});
  }
  return layout;
}

}  // namespace

json TrainState::to_json() const {
  json j;
  j[kStep] = step;
  j[kAdamSteps] = adam_steps;
  j[kLossScaler] = {{kScale, loss_scaler.scale},
                    {kCleanSteps, loss_scaler.clean_steps},
                    {kSkipped, loss_scaler.skipped}};
  if (sampler) j[kSampler] = *sampler;
  if (rng) j[kRng] = {{kScheme, rng->scheme}, {kSeed, rng->seed}};
  j[kConfigHash] = config_hash;
  j[kTokenizer] = tokenizer;
  j[kVersion] = version;
  j[kWorldSize] = world_size;
  if (micro_batch_size) j[kMicroBatchSize] = *micro_batch_size;
  if (grad_accum_steps) j[kGradAccumSteps] = *grad_accum_steps;
  j[kZeroStage] = zero_stage;
  j[kLayout] = layout_to_json(layout);
  if (config) j[kConfig] = *config;
  return j;
}

TrainState TrainState::from_json(const json& state, const std::string& where) {
  const Fields f(state, "state", where);
  TrainState s;
  s.step = f.required<int64_t>(kStep);
  s.adam_steps = f.required<int64_t>(kAdamSteps);
  const Fields scaler = f.required_object(kLossScaler);
  s.loss_scaler = {scaler.required<double>(kScale), scaler.required<int64_t>(kCleanSteps),
                   scaler.required<int64_t>(kSkipped)};
  s.sampler = f.optional<json>(kSampler);
  if (const auto rng = f.optional_object(kRng)) {
    s.rng = RngState{rng->required<std::string>(kScheme), rng->required<uint64_t>(kSeed)};
  }
  s.config_hash = f.required<std::string>(kConfigHash);
  s.tokenizer = f.required<json>(kTokenizer);
  s.version = f.required<std::string>(kVersion);
  s.world_size = f.required<int>(kWorldSize);
  s.micro_batch_size = f.optional<int64_t>(kMicroBatchSize);
  s.grad_accum_steps = f.optional<int64_t>(kGradAccumSteps);
  s.zero_stage = f.required<int>(kZeroStage);
  s.layout = layout_from(f.required_objects(kLayout));
  s.config = f.optional<json>(kConfig);
  return s;
}

ModelInfo ModelInfo::from_json(const json& state, const std::string& where) {
  const Fields f(state, "state", where);
  ModelInfo m;
  m.config_hash = f.optional<std::string>(kConfigHash);
  m.tokenizer = f.optional<json>(kTokenizer);
  m.config = f.optional<json>(kConfig);
  if (const auto entries = f.optional_objects(kLayout)) m.layout = layout_from(*entries);
  return m;
}

}  // namespace dnallm::checkpoint
