// [lora]: the keys of LoraConfig (core/config.hpp).
#include "core/config/schema.hpp"

namespace dnallm::config_detail {

void lora_keys(std::vector<KeyDesc>& out) {
  SectionKeys<LoraConfig>(out, "lora", &Config::lora)
      .range("r", &LoraConfig::r, 0, 4096, "adapter rank; 0 disables LoRA")
      .range("alpha", &LoraConfig::alpha, 0, kInf, "scaling = alpha / r")
      .range("dropout", &LoraConfig::dropout, 0, 0.99,
             "dropout probability on the adapters' input (training only)")
      .key("target_modules", &LoraConfig::target_modules,
           "module names that get adapters: the transformer's `query` `key` `value` `dense`; "
           "HyenaDNA's `in_proj` `out_proj` `fc1` `fc2`; Caduceus' `in_proj` `out_proj` (for "
           "these two the default means all of them, [models.md](models.md))")
      .choice("quantize_base", &LoraConfig::quantize_base,
              "`nf4`: QLoRA, the frozen linears of the blocks stored as 4-bit NF4 (block "
              "scales, double quantisation) and dequantised on the fly; adapters and heads "
              "train in full precision; the export merges into full precision "
              "([inference.md](inference.md#qlora))");
}

}  // namespace dnallm::config_detail
