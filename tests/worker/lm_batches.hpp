// Deterministic language-model micro-batches for trainer tests (step_test.cpp, gpu_test.cpp):
// row r of the stream is a function of r only, so a source started at row k continues a run
// exactly where one that consumed k rows stands.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>

#include "core/config.hpp"
#include "worker/data/batch.hpp"
#include "worker/train/checkpointing.hpp"
#include "worker/train/train_setup.hpp"
#include "worker/train/trainer.hpp"

namespace dnallm::train::testing {

struct LmRows {
  uint64_t seed = 500;    // row r draws from mt19937_64(seed + r)
  int mask_percent = 30;  // chance of scoring a position (never position 0)
  int64_t pad_step = 0;   // > 0: row r is pad_step * (r % 3) tokens short (padding)
};

// Token ids: 0 pad, 2 [CLS], 4 [MASK], 5..8 bases (the char tokenizer's layout).
inline data::Batch make_lm_batch(uint64_t first_row, int64_t rows, int64_t seq, const LmRows& how) {
  data::Batch b;
  b.rows = rows;
  b.seq_len = seq;
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t row = first_row + uint64_t(r);
    std::mt19937_64 rng(how.seed + row);
    const int64_t len = seq - how.pad_step * int64_t(row % 3);
    for (int64_t i = 0; i < seq; ++i) {
      const bool real = i < len;
      const int64_t base = 5 + int64_t(rng() % 4);
      const bool masked = real && i > 0 && int(rng() % 100) < how.mask_percent;
      b.input_ids.push_back(!real ? 0 : i == 0 ? 2 : (masked ? 4 : base));
      b.attention_mask.push_back(real ? 1 : 0);
      b.labels.push_back(masked ? base : data::kIgnoreIndex);
      b.num_label_tokens += masked;
    }
  }
  return b;
}

// A small LM configuration: 2 layers, 4 heads, ffn = 2 x hidden, 6 steps of 2 micro-batches
// of `micro` rows, clipping at 1, no export. Tests change what they exercise.
inline Config small_lm_config(const std::string& arch, int64_t hidden, int64_t seq, int64_t micro,
                              double lr) {
  Config c = parse_config("", "test", {"model.arch=" + arch});  // the schema spells it
  c.model.hidden = hidden;
  c.model.layers = 2;
  c.model.heads = 4;
  c.model.ffn = 2 * hidden;
  c.model.max_seq_length = seq;
  c.training.max_steps = 6;
  c.training.micro_batch_size = micro;
  c.training.grad_accum_steps = 2;
  c.training.lr = lr;
  c.training.max_grad_norm = 1.0;
  c.checkpoint.save_final = false;
  return c;
}

// Trainer options without console progress, on the sync-free step or the host path.
inline TrainerOptions quiet_options(bool sync_free) {
  TrainerOptions o;
  o.console_progress = false;
  o.sync_free = sync_free;
  return o;
}

class LmSource : public BatchSource {
 public:
  LmSource(int64_t rows, int64_t seq, LmRows how, uint64_t first_row = 0)
      : rows_(rows), seq_(seq), how_(how), cursor_(first_row) {}
  data::Batch next() override {
    auto b = make_lm_batch(cursor_, rows_, seq_, how_);
    cursor_ += uint64_t(rows_);
    return b;
  }

 private:
  int64_t rows_, seq_;
  LmRows how_;
  uint64_t cursor_;
};

// Resumes `cfg` from the newest checkpoint under checkpoint.dir (it must be step `from`) and
// trains to training.max_steps with checkpoints on; `source` continues the rows where step
// `from` left them. `after_restore` sees the restored trainer, `observe` every step. Returns
// the final flat parameters.
inline torch::Tensor resume_to_end(const Config& cfg, int64_t from,
                                   std::unique_ptr<BatchSource> source,
                                   const std::function<void(Trainer&)>& after_restore = {},
                                   const std::function<void(const StepResult&)>& observe = {}) {
  auto reader = open_resume(cfg, nlohmann::json());
  if (!reader || reader->step() != from) {
    throw std::runtime_error("no checkpoint of step " + std::to_string(from) + " to resume");
  }
  CheckpointerOptions co;
  co.resumed_step = from;
  Checkpointer ck(cfg, co);
  TrainerOptions o = quiet_options(true);
  ck.install(o);
  o.after_step.insert(o.after_step.begin(), [&](Trainer&, const StepResult& r) {
    if (observe) observe(r);
    return StepAction::kContinue;
  });
  Trainer t(cfg, build_model(cfg, 9), std::move(source), nullptr, nullptr, o);
  restore(t, *reader);
  if (after_restore) after_restore(t);
  t.run();
  return t.flat().params().clone();
}

}  // namespace dnallm::train::testing
