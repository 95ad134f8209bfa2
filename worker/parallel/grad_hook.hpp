// A callback after a parameter's gradient has been accumulated (its AccumulateGrad node's
// post-hook), for the data-parallel engines: DDP's bucket readiness, ZeRO-3's unit readiness.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <functional>
#include <memory>
#include <utility>

namespace dnallm::parallel {

// What grad_accumulator() returns: std::shared_ptr<Node> in older torch, an intrusive_ptr<Node>
// in 2.14. Keep it: the hook lives as long as the accumulator.
using GradAccumulator =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// Calls `ready` after each accumulation of `param`'s gradient while `*alive` is true (hooks
// outlive their engine inside autograd). Returns the accumulator to keep.
inline GradAccumulator on_gradient_ready(const torch::Tensor& param, std::weak_ptr<bool> alive,
                                         std::function<void()> ready) {
  class Hook : public torch::autograd::FunctionPostHook {
   public:
    explicit Hook(std::function<void()> fn) : fn_(std::move(fn)) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      fn_();
      return outputs;
    }

   private:
    std::function<void()> fn_;
  };
  auto acc = torch::autograd::impl::grad_accumulator(param);
  acc->add_post_hook(std::make_unique<Hook>([alive = std::move(alive), ready = std::move(ready)] {
    if (auto a = alive.lock(); a && *a) ready();
  }));
  return acc;
}

}  // namespace dnallm::parallel
