#include "worker/models/quantized_weight.hpp"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "core/error.hpp"

namespace dnallm::models {
namespace {

using torch::Tensor;

// bitsandbytes' NF4 code book (create_normal_map(offset=0.9677083)).
constexpr float kNf4Levels[16] = {-1.0F,
                                  -0.6961928009986877F,
                                  -0.5250730514526367F,
                                  -0.39491748809814453F,
                                  -0.28444138169288635F,
                                  -0.18477343022823334F,
                                  -0.09105003625154495F,
                                  0.0F,
                                  0.07958029955625534F,
                                  0.16093020141124725F,
                                  0.24611230194568634F,
                                  0.33791524171829224F,
                                  0.44070982933044434F,
                                  0.5626170039176941F,
                                  0.7229568362236023F,
                                  1.0F};

Tensor levels_tensor(const torch::Device& device) {
  return torch::from_blob(const_cast<float*>(kNf4Levels), {16}, torch::kFloat32)
      .to(device, false, true);
}

// Note [NF4 backward]: y = x W^T + b with W dequantised from its NF4 codes for the product and
// freed after it. Autograd's own linear would save W (fp32, whole) for x's gradient until the
// backward pass: every block's, the whole full-precision base at once while a QLoRA step runs.
// This function saves the codes instead (references, no copy) and dequantises W again in
// backward, as bitsandbytes' MatMul4Bit does: one more dequantisation a linear, and at most
// one linear's full-precision weight alive. W gets no gradient (the base is frozen); the bias
// gets one when it requires it.
struct Nf4Linear : public torch::autograd::Function<Nf4Linear> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& bias,
                        const Nf4Tensor* q) {
    ctx->saved_data["codes"] = q->codes;
    ctx->saved_data["absmax_q"] = q->absmax_q;
    ctx->saved_data["absmax_scale"] = q->absmax_scale;
    ctx->saved_data["levels"] = q->levels;
    ctx->saved_data["absmax_offset"] = q->absmax_offset;
    ctx->saved_data["shape"] = q->shape;
    ctx->saved_data["numel"] = q->numel;
    ctx->saved_data["x_dtype"] = x.scalar_type();
    const bool has_bias = bias.numel() > 0;
    ctx->saved_data["bias_grad"] = has_bias && bias.requires_grad();
    ctx->saved_data["bias_dtype"] = bias.scalar_type();
    auto w = nf4_dequantize(*q).to(x.dtype());
    // See Note [at::linear, not nn::functional::linear] (lora_linear.cpp).
    return torch::linear(x, w, has_bias ? bias.to(x.dtype()) : Tensor());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto& g = grads[0];
    Nf4Tensor q;
    q.codes = ctx->saved_data["codes"].toTensor();
    q.absmax_q = ctx->saved_data["absmax_q"].toTensor();
    q.absmax_scale = ctx->saved_data["absmax_scale"].toTensor();
    q.levels = ctx->saved_data["levels"].toTensor();
    q.absmax_offset = ctx->saved_data["absmax_offset"].toDouble();
    q.shape = ctx->saved_data["shape"].toIntVector();
    q.numel = ctx->saved_data["numel"].toInt();
    const auto w = nf4_dequantize(q).to(g.scalar_type());
    const auto x_dtype = ctx->saved_data["x_dtype"].toScalarType();
    Tensor grad_bias;
    if (ctx->saved_data["bias_grad"].toBool()) {
      grad_bias =
          g.reshape({-1, g.size(-1)}).sum(0).to(ctx->saved_data["bias_dtype"].toScalarType());
    }
    return {torch::matmul(g, w).to(x_dtype), grad_bias, Tensor()};
  }
};

class Nf4Weight final : public QuantizedWeight {
 public:
  explicit Nf4Weight(const Tensor& w) : q_(nf4_quantize(w)) {}
  Tensor linear(const Tensor& x, const Tensor& bias) const override {
    // A model quantized before it was moved (trainer: build, then .to(device)) follows its
    // activations once; the codes are not module buffers, so Module::to() does not move them.
    if (q_.codes.device() != x.device()) move_to(x.device());
    levels_follow_codes();
    // Dequantised on the fly into x's dtype, used once, freed (and again in backward: Note
    // [NF4 backward]): the resident base stays 4-bit.
    // (no bias: an empty tensor, as autograd's apply() takes no undefined input)
    return Nf4Linear::apply(x, bias.defined() ? bias : torch::empty({0}, x.options()), &q_);
  }
  Tensor dequantize() const override {
    levels_follow_codes();
    return nf4_dequantize(q_);
  }
  int64_t bytes() const override { return q_.bytes(); }
  const char* format() const override { return "nf4"; }
  std::vector<int64_t> shape() const override { return q_.shape; }
  std::vector<Tensor> storage() const override { return {q_.codes, q_.absmax_q, q_.absmax_scale}; }

 private:
  // ZeRO-3 moves the codes by pointing them into its buffer on the device (Note [Fully sharded
  // quantized base]): the code book follows them.
  void levels_follow_codes() const {
    if (q_.levels.device() != q_.codes.device()) q_.levels = q_.levels.to(q_.codes.device());
  }
  void move_to(const torch::Device& device) const {
    q_.codes = q_.codes.to(device);
    q_.absmax_q = q_.absmax_q.to(device);
    q_.absmax_scale = q_.absmax_scale.to(device);
    q_.levels = q_.levels.to(device);
  }
  mutable Nf4Tensor q_;  // mutable for move_to() and levels_follow_codes() (the model's thread)
};

// The quantized CPU ops are reached through the dispatcher (boxed), so no header of the
// quantized backend (LinearPackedParamsBase) is needed and the same code builds against
// LibTorch 1.13 (oneDNN/QNNPACK engines) and 2.x (FBGEMM/x86).
c10::OperatorHandle quantized_op(const char* name) {
  try {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  } catch (const std::exception& e) {
    fail(ExitCode::kUsage,
         "--quantize int8 needs LibTorch's quantized CPU kernels ({} is missing: {}); run "
         "without --quantize",
         name, e.what());
  }
}

class Int8Weight final : public QuantizedWeight {
 public:
  Int8Weight(const Tensor& w, const Tensor& bias) : out_(w.size(0)), in_(w.size(1)) {
    DNALLM_CHECK(w.device().is_cpu(), ExitCode::kUsage,
                 "--quantize int8 is a CPU inference path (dynamic quantisation); on {} use "
                 "--device cpu or leave out --quantize",
                 w.device().str());
    auto wf = w.detach().to(torch::kFloat32).contiguous();
    // Symmetric per-tensor qint8 (quantize_dynamic's default weight observer range).
    const double amax = std::max(wf.abs().max().item<double>(), 1e-12);
    scale_ = amax / 127.0;
    qweight_ = at::quantize_per_tensor(wf, scale_, 0, torch::kQInt8);
    torch::jit::Stack stack{
        qweight_, bias.defined() ? c10::IValue(bias.detach().to(torch::kFloat32).contiguous())
                                 : c10::IValue()};
    quantized_op("quantized::linear_prepack").callBoxed(&stack);
    packed_ = stack.at(0);
    linear_op_.emplace(quantized_op("quantized::linear_dynamic"));
  }
  Tensor linear(const Tensor& x, const Tensor& bias) const override {
    // The bias is packed with the weight.
    auto shape = x.sizes().vec();
    auto x2 = x.to(torch::kFloat32).reshape({-1, in_}).contiguous();
    torch::jit::Stack stack{x2, packed_, c10::IValue(false)};
    linear_op_->callBoxed(&stack);
    shape.back() = out_;
    return stack.at(0).toTensor().view(shape).to(x.dtype());
  }
  Tensor dequantize() const override { return qweight_.dequantize(); }
  int64_t bytes() const override { return out_ * in_ + 8; }
  std::vector<int64_t> shape() const override { return {out_, in_}; }
  const char* format() const override { return "int8"; }

 private:
  int64_t out_, in_;
  double scale_ = 1.0;
  Tensor qweight_;
  c10::IValue packed_;
  std::optional<c10::OperatorHandle> linear_op_;
};

}  // namespace

const float* nf4_levels() { return kNf4Levels; }

int64_t Nf4Tensor::bytes() const {
  return codes.numel() + absmax_q.numel() + absmax_scale.numel() * 4 + 8;
}

Nf4Tensor nf4_quantize(const Tensor& weight) {
  torch::NoGradGuard no_grad;
  Nf4Tensor q;
  q.shape = weight.sizes().vec();
  q.numel = weight.numel();
  const auto device = weight.device();
  const int64_t blocks = (q.numel + kNf4BlockSize - 1) / kNf4BlockSize;
  auto flat = weight.detach().to(torch::kFloat32).reshape({-1});
  if (blocks * kNf4BlockSize != q.numel) {
    flat = torch::cat({flat, torch::zeros({blocks * kNf4BlockSize - q.numel}, flat.options())});
  }
  auto x = flat.view({blocks, kNf4BlockSize});
  auto absmax = x.abs().amax(1);  // [blocks]

  // Double quantisation of the block constants (Note [NF4 layout]).
  q.absmax_offset = absmax.mean().item<double>();
  auto centred = absmax - q.absmax_offset;
  const int64_t groups = (blocks + kNf4ScaleBlockSize - 1) / kNf4ScaleBlockSize;
  auto padded = torch::zeros({groups * kNf4ScaleBlockSize}, centred.options());
  padded.narrow(0, 0, blocks).copy_(centred);
  auto grouped = padded.view({groups, kNf4ScaleBlockSize});
  q.absmax_scale = (grouped.abs().amax(1) / 127.0).clamp_min(1e-12);
  q.absmax_q = torch::round(grouped / q.absmax_scale.unsqueeze(1))
                   .clamp(-127, 127)
                   .to(torch::kInt8)
                   .reshape({-1})
                   .narrow(0, 0, blocks)
                   .clone();  // its own storage: no padding kept alive

  // Codes against the absmax that dequantisation will use, so the rounding sees the
  // constants as they will be read back.
  Nf4Tensor probe = q;
  auto scale = nf4_block_absmax(probe).clamp_min(1e-12).unsqueeze(1);
  auto normalised = (x / scale).clamp(-1.0, 1.0).reshape({-1});
  // Nearest level: the midpoints between neighbours split [-1, 1] into 16 cells.
  q.levels = levels_tensor(device);
  const auto& levels = q.levels;
  auto mids = (levels.narrow(0, 0, 15) + levels.narrow(0, 1, 15)) / 2;
  auto idx = torch::bucketize(normalised, mids).to(torch::kUInt8);  // 0..15
  auto pairs = idx.view({-1, 2});
  q.codes = (pairs.select(1, 0) * 16 + pairs.select(1, 1)).to(torch::kUInt8).contiguous();
  return q;
}

Tensor nf4_block_absmax(const Nf4Tensor& q) {
  const int64_t blocks = q.absmax_q.numel();
  auto scale = q.absmax_scale.repeat_interleave(kNf4ScaleBlockSize).narrow(0, 0, blocks);
  return q.absmax_q.to(torch::kFloat32) * scale + q.absmax_offset;
}

Tensor nf4_dequantize(const Nf4Tensor& q) {
  torch::NoGradGuard no_grad;
  auto hi = q.codes.div(16, "floor");
  auto lo = q.codes.remainder(16);
  auto idx = torch::stack({hi, lo}, 1).reshape({-1}).to(torch::kInt64);
  auto values = q.levels.index_select(0, idx);
  const int64_t blocks = q.absmax_q.numel();
  auto w = values.view({blocks, kNf4BlockSize}) * nf4_block_absmax(q).unsqueeze(1);
  return w.reshape({-1}).narrow(0, 0, q.numel).view(q.shape);
}

std::shared_ptr<QuantizedWeight> make_nf4_weight(const Tensor& weight) {
  return std::make_shared<Nf4Weight>(weight);
}

std::shared_ptr<QuantizedWeight> make_int8_weight(const Tensor& weight, const Tensor& bias) {
  return std::make_shared<Int8Weight>(weight, bias);
}

WeightFormat parse_weight_format(const std::string& name, const std::string& what) {
  if (name == "none" || name == "fp32") return WeightFormat::kFull;
  if (name == "int8") return WeightFormat::kInt8;
  if (name == "nf4") return WeightFormat::kNf4;
  fail(ExitCode::kUsage, "{} = \"{}\": use \"none\", \"int8\" or \"nf4\"", what, name);
}

WeightFormat weight_format_of(cfg::QuantizeBase base) {
  switch (base) {
    case cfg::QuantizeBase::kNone:
      return WeightFormat::kFull;
    case cfg::QuantizeBase::kNf4:
      return WeightFormat::kNf4;
  }
  fail(ExitCode::kFailure, "weight_format_of: lora.quantize_base {} has no weight format",
       static_cast<int>(base));
}

}  // namespace dnallm::models
