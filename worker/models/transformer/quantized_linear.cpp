#include "worker/models/transformer/quantized_linear.hpp"

#include "core/error.hpp"
#include "worker/models/language_model.hpp"
#include "worker/models/lora_linear.hpp"

namespace dnallm::models {

void quantize_block_linears(torch::nn::Module& block, WeightFormat format, QuantizeReport& report) {
  if (format == WeightFormat::kFull) return;
  torch::NoGradGuard no_grad;
  for (const auto& m : block.modules()) {
    auto* lin = m->as<LoraLinearImpl>();
    if (lin == nullptr || lin->quantized()) continue;
    const auto w = lin->weight.detach();
    auto q = format == WeightFormat::kNf4 ? make_nf4_weight(w) : make_int8_weight(w, lin->bias);
    report.linears += 1;
    report.parameters += w.numel();
    report.quantized_bytes += q->bytes();
    lin->set_quantized(std::move(q));
  }
}

QuantizeReport quantize_linears(LanguageModelImpl& model, WeightFormat format) {
  QuantizeReport report;
  if (format == WeightFormat::kFull) return report;
  const auto blocks = model.blocks();  // the blocks' linears (not the heads')
  DNALLM_CHECK(!blocks.empty(), ExitCode::kUsage, "the {} model has no blocks to quantize",
               model.spec().family);
  for (const auto& block : blocks) quantize_block_linears(*block, format, report);
  return report;
}

}  // namespace dnallm::models
