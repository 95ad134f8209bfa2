// Adapters from the data pipeline (worker/data) to the trainer's BatchSource, and the
// tokenizer facts evaluation needs. Header-only: used by the two mains.
#pragma once

#include <memory>
#include <string>

#include "worker/data/data_loader.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/train/trainer.hpp"

namespace dnallm::train {

class LoaderSource final : public BatchSource {
 public:
  explicit LoaderSource(std::unique_ptr<data::DataLoader> loader)
      : loader_(std::move(loader)), start_(loader_->state()) {}
  data::Batch next() override { return loader_->next(); }
  void rewind() override {
    if (loader_->state().consumed_samples != start_.consumed_samples) loader_->reset(start_);
  }
  void reshard(int rank, int world_size) override {
    loader_->reshard(rank, world_size, loader_->options().grad_accum_steps, start_);
  }
  uint64_t samples_per_epoch() const override { return loader_->dataset_size(); }
  double data_wait_s() const override { return loader_->data_wait_s(); }
  data::DataLoader& loader() { return *loader_; }

 private:
  std::unique_ptr<data::DataLoader> loader_;
  data::SamplerState start_;
};

// Bases spelled by a token (Note [Bits per base]): the A/C/G/T/N letters of its piece;
// 0 for special tokens.
inline std::function<int64_t(int64_t)> bases_of_label(std::shared_ptr<const data::Tokenizer> tok) {
  auto cache = std::make_shared<std::vector<int64_t>>(tok->vocab_size(), 0);
  for (int64_t id = 0; id < tok->vocab_size(); ++id) {
    if (tok->is_special(id)) continue;
    int64_t n = 0;
    for (char c : tok->id_to_piece(id))
      n += c == 'A' || c == 'C' || c == 'G' || c == 'T' || c == 'N';
    (*cache)[id] = std::max<int64_t>(n, 1);
  }
  return [cache](int64_t id) {
    return id >= 0 && id < int64_t(cache->size()) ? (*cache)[id] : int64_t{1};
  };
}

}  // namespace dnallm::train
