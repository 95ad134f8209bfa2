// The table of every configuration key, the aliases, and lookups in them.
#include "core/config/schema.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/enum_names.hpp"

namespace dnallm::config_detail {

namespace {

// See Note [Enum tables] (core/enum_names.hpp).
struct KindNames {
  const char* in_message;
  const char* in_reference;
};
constexpr EnumName<Kind, KindNames> kKindNames[] = {
    {Kind::kInt, {"an integer", "integer"}},
    {Kind::kDouble, {"a number", "number"}},
    {Kind::kBool, {"true or false", "`true`, `false`"}},
    {Kind::kString, {"a string", "string"}},
    {Kind::kStringList, {"a list of strings", "list of strings"}},
    {Kind::kNumberList, {"a list of numbers", "list of numbers"}},
    {Kind::kStageList,
     {"a list of {steps = N, seq_len = N} tables", "list of `{steps, seq_len}` tables"}}};
static_assert(lists_each_in_order<Kind::kStageList>(kKindNames));

}  // namespace

const char* kind_name(Kind k) { return name_of(kKindNames, k, {"?", ""}).in_message; }

const char* kind_reference_name(Kind k) { return name_of(kKindNames, k, {"?", ""}).in_reference; }

const std::vector<KeyDesc>& schema() {
  static const std::vector<KeyDesc> keys = [] {
    std::vector<KeyDesc> out;
    declare_keys(out);
    return out;
  }();
  return keys;
}

const std::vector<std::string>& section_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const auto& k : schema()) {
      if (std::find(out.begin(), out.end(), k.section) == out.end()) out.push_back(k.section);
    }
    return out;
  }();
  return names;
}

const KeyDesc* find_key(const std::string& section, const std::string& name) {
  for (const auto& k : schema()) {
    if (section == k.section && name == k.name) return &k;
  }
  return nullptr;
}

const std::vector<Alias>& aliases() {
  static const std::vector<Alias> list = {
      {"per_device_train_batch_size", "training", "micro_batch_size"},
      {"gradient_accumulation_steps", "training", "grad_accum_steps"},
      {"learning_rate", "training", "lr"},
      {"weight_decay", "training", "weight_decay"},
      {"warmup_ratio", "training", "warmup_ratio"},
      {"warmup_steps", "training", "warmup_steps"},
      {"lr_scheduler_type", "training", "lr_scheduler"},
      {"max_grad_norm", "training", "max_grad_norm"},
      {"bf16", "training", "precision"},  // bool: true -> "bf16"
      {"fp16", "training", "precision"},  // bool: true -> "fp16"
      {"tf32", "training", "tf32"},
      {"gradient_checkpointing", "model", "gradient_checkpointing"},
      {"save_steps", "checkpoint", "save_steps"},
      {"save_total_limit", "checkpoint", "keep_last"},
      {"metric_for_best_model", "checkpoint", "best_metric"},
      {"rc_augment", "data", "reverse_complement"},
      {"eval_steps", "training", "eval_steps"},
      {"logging_steps", "training", "logging_steps"},
      {"max_steps", "training", "max_steps"},
      {"num_train_epochs", "training", "num_train_epochs"},
      {"seed", "training", "seed"},
      {"dataloader_num_workers", "data", "dataloader_num_workers"},
      {"dataloader_pin_memory", "data", "pin_memory"},
      {"group_by_length", "data", "group_by_length"},
      {"max_seq_length", "model", "max_seq_length"},
  };
  return list;
}

const Alias* find_alias(const std::string& name) {
  for (const auto& a : aliases()) {
    if (name == a.name) return &a;
  }
  return nullptr;
}

std::string range_text(const KeyDesc& k) {
  auto num = [&](double v) {
    return k.kind == Kind::kInt ? fmt::format("{}", static_cast<int64_t>(v)) : fmt::format("{}", v);
  };
  bool lo = std::isfinite(k.min), hi = std::isfinite(k.max);
  if (lo && hi) return fmt::format("between {} and {}", num(k.min), num(k.max));
  if (lo) return fmt::format("at least {}", num(k.min));
  if (hi) return fmt::format("at most {}", num(k.max));
  return "any value";
}

}  // namespace dnallm::config_detail
