// Quantizing a model's linear layers (LoraLinear) into QuantizedWeights
// (worker/models/quantized_weight.hpp): INT8 for inference, NF4 for QLoRA's frozen base.
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "worker/models/quantized_weight.hpp"

namespace dnallm::models {

class LanguageModelImpl;

struct QuantizeReport {
  int64_t linears = 0;     // layers converted
  int64_t parameters = 0;  // weights converted (values)
  int64_t quantized_bytes = 0;
  int64_t fp32_bytes() const { return parameters * 4; }
  int64_t bf16_bytes() const { return parameters * 2; }
};

// Converts the linear layers of every transformer block (query, key, value, attention
// output, FFN in/out: nearly all of a model's weights). Embeddings, the MLM transform, the
// pooler and the classifier stay in full precision. Adapters already on a layer are kept.
QuantizeReport quantize_linears(LanguageModelImpl& model, WeightFormat format);
// The same for one block's linear layers, added to `report`: a QLoRA base is quantized block by
// block as it is built (Note [LoRA block by block]), never whole in full precision.
void quantize_block_linears(torch::nn::Module& block, WeightFormat format, QuantizeReport& report);

}  // namespace dnallm::models
