// Evaluation: evaluate() and the trainer's evaluation steps, its metrics line and the best
// checkpoint (Note [Best checkpoint]). See trainer.hpp.
#include <cmath>
#include <filesystem>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "checkpoint/durable_io.hpp"
#include "core/error.hpp"
#include "worker/parallel/context_mesh.hpp"
#include "worker/train/batch_inputs.hpp"
#include "worker/train/trainer.hpp"

namespace dnallm::train {

EvalResult evaluate(models::LanguageModel model, BatchSource& source, int64_t batches,
                    const torch::Device& device,
                    const std::function<int64_t(int64_t)>& bases_of_label, GradientSync* sync,
                    parallel::ContextMesh* context) {
  const bool was_training = model->is_training();
  model->eval();
  source.rewind();
  torch::NoGradGuard no_grad;
  double nll = 0.0;
  double tokens = 0, bases = 0, correct = 0, rows = 0;
  const auto task = model->spec().task;
  // Note [Classification scores]: the confusion matrix, summed over ranks cell by cell (one
  // collective a cell), for up to kMaxScoredClasses labels; more labels: accuracy alone.
  const int64_t labels = model->spec().num_labels;
  const bool scored = task == models::Task::kClassification && labels <= kMaxScoredClasses;
  ConfusionMatrix confusion(scored ? labels : 0, std::vector<double>(scored ? labels : 0, 0.0));
  // Note [Sharded evaluation]: where a forward is collective (ZeRO-3 gathers unit by unit),
  // every rank runs as many as the rank with the most batches: one that ran out repeats its
  // first batch and drops the result. A rank with none at all has nothing to repeat: then every
  // rank holds the whole model for this evaluation instead, and forwards are local.
  bool lockstep = sync != nullptr && sync->forwards_are_collective();
  std::optional<data::Batch> first, spare;
  std::optional<parallel::FullParameters> whole;
  if (lockstep && batches > 0) {
    first = source.next();
    const double without = sync->sum_scalar(first->rows == 0 ? 1.0 : 0.0);
    if (without > 0 && without < double(sync->world_size())) {
      spdlog::warn(
          "evaluation: {} rank(s) have no evaluation batch, so this evaluation holds the whole "
          "model on every rank (Note [Sharded evaluation]); a larger evaluation set avoids it",
          static_cast<int64_t>(without));
      whole.emplace(*sync);
      lockstep = false;
    }
  }
  bool exhausted = false;
  for (int64_t i = 0; i < batches; ++i) {
    data::Batch batch;
    if (first) {
      batch = std::move(*first);
      first.reset();
    } else if (!exhausted) {
      batch = source.next();
    }
    exhausted = batch.rows == 0;
    if (lockstep) {
      if (sync->sum_scalar(exhausted ? 0.0 : 1.0) == 0) break;
      if (!spare) spare = batch;
    } else if (exhausted) {
      break;
    }
    const bool counted = !exhausted;
    if (!counted) batch = *spare;
    auto in = to_inputs(batch, model, device);
    in.logits_for_labels_only = true;
    if (context != nullptr) context->select(batch.seq_len, device);
    if (lockstep) sync->before_forward_only();
    auto out = model->forward(in);
    if (lockstep) sync->after_forward_only();
    if (!counted || !out.loss_sum.defined()) continue;
    nll += out.loss_sum.item<double>();
    tokens += double(out.loss_count);
    if (task == models::Task::kPretrain) {
      if (bases_of_label) {
        for (auto l : batch.labels) {
          if (l != data::kIgnoreIndex) bases += double(bases_of_label(l));
        }
      } else {
        bases += double(out.loss_count);
      }
    } else if (task == models::Task::kClassification) {
      const auto predicted = out.logits.argmax(-1).to(torch::kCPU).contiguous();
      const int64_t* p = predicted.data_ptr<int64_t>();
      for (int64_t r = 0; r < batch.rows; ++r) {
        const int64_t truth = batch.labels[static_cast<size_t>(r)];
        if (truth < 0 || truth >= labels) continue;
        correct += p[r] == truth ? 1.0 : 0.0;
        if (scored) confusion[truth][p[r]] += 1.0;
      }
      // Note [Context-parallel pooling]: a context group's rows are context rank 0's (the
      // others hold no labels; their truth above is kIgnoreIndex).
      if (context == nullptr || context->coordinates().context_rank == 0) {
        rows += double(batch.rows);
      }
    }
  }
  if (sync != nullptr) {
    nll = sync->sum_scalar(nll);
    tokens = sync->sum_scalar(tokens);
    bases = sync->sum_scalar(bases);
    correct = sync->sum_scalar(correct);
    rows = sync->sum_scalar(rows);
    for (auto& row : confusion) {
      for (auto& cell : row) cell = sync->sum_scalar(cell);
    }
  }
  if (was_training) model->train();
  EvalResult r;
  r.tokens = static_cast<int64_t>(tokens);
  r.bases = static_cast<int64_t>(bases);
  r.loss = tokens > 0 ? nll / tokens : std::nan("");
  r.bits_per_base = bases > 0 ? nll / std::log(2.0) / bases : std::nan("");
  r.correct = static_cast<int64_t>(correct);
  r.rows = static_cast<int64_t>(rows);
  r.accuracy = rows > 0 ? correct / rows : std::nan("");
  if (scored) r.scores = classification_scores(confusion);
  return r;
}

void Trainer::evaluate_at(int64_t step) {
  const auto& t = config_.training;
  // Every rank: under ZeRO-3 evaluation's forwards gather unit by unit (Note [Sharded
  // evaluation]), as does an export of the best model (Note [Exports unit by unit]).
  EvalResult e;
  {
    parallel::ShardedForwards forwards(*sync_);
    e = evaluate(model_, *eval_, t.eval_batches, device_, options_.bases_of_label, sync_.get(),
                 options_.context.get());
  }
  last_eval_ = std::make_pair(step, e);
  if (sync_->rank() == 0) log_evaluation(step, e);
  // Every rank: the export of a new best model is collective under ZeRO-3.
  if (config_.checkpoint.best_metric != cfg::BestMetric::kNone) keep_if_best(step, e);
}

void Trainer::log_evaluation(int64_t step, const EvalResult& e) {
  const auto task = model_->spec().task;
  nlohmann::ordered_json line;
  line["event"] = "eval";
  line["step"] = step;
  line["loss"] = std::isfinite(e.loss) ? e.loss : -1.0;
  if (task == models::Task::kPretrain) {
    line["bits_per_base"] = std::isfinite(e.bits_per_base) ? e.bits_per_base : -1.0;
  } else if (task == models::Task::kClassification) {
    line["accuracy"] = std::isfinite(e.accuracy) ? e.accuracy : -1.0;
    if (e.scores) {
      line["mcc"] = e.scores->mcc;
      line["f1"] = e.scores->f1;
    }
    line["rows"] = e.rows;
  }
  line["tokens"] = e.tokens;
  write_metrics(line);
  if (task == models::Task::kPretrain) {
    spdlog::info("eval at step {}: loss {:.4f} bits/base {:.4f}", step, e.loss, e.bits_per_base);
  } else if (task == models::Task::kClassification) {
    spdlog::info("eval at step {}: loss {:.4f} accuracy {:.4f}{} ({} rows)", step, e.loss,
                 e.accuracy,
                 e.scores ? fmt::format(" mcc {:.4f} f1 {:.4f}", e.scores->mcc, e.scores->f1)
                          : std::string(),
                 e.rows);
  } else {
    spdlog::info("eval at step {}: loss {:.4f}", step, e.loss);
  }
}

namespace {

// Note [Best checkpoint]: the value of `metric` in `e`, and whether higher is better.
std::pair<double, bool> best_metric_value(cfg::BestMetric metric, const EvalResult& e) {
  switch (metric) {
    case cfg::BestMetric::kLoss:
      return {e.loss, false};
    case cfg::BestMetric::kBitsPerBase:
      return {e.bits_per_base, false};
    case cfg::BestMetric::kAccuracy:
      return {e.accuracy, true};
    case cfg::BestMetric::kMcc:
    case cfg::BestMetric::kF1:
    case cfg::BestMetric::kNone:
      break;
  }
  DNALLM_CHECK(metric != cfg::BestMetric::kNone, ExitCode::kUsage,
               "checkpoint.best_metric = \"none\" is not a metric");
  DNALLM_CHECK(e.scores.has_value(), ExitCode::kUsage,
               "checkpoint.best_metric = \"{}\" needs at most {} labels (model.num_labels); use "
               "\"accuracy\" or \"loss\"",
               cfg::spelling(metric), kMaxScoredClasses);
  return {metric == cfg::BestMetric::kMcc ? e.scores->mcc : e.scores->f1, true};
}

}  // namespace
void Trainer::keep_if_best(int64_t step, const EvalResult& e) {
  namespace fs = std::filesystem;
  const cfg::BestMetric metric = config_.checkpoint.best_metric;
  const fs::path best = best_dir();
  if (!best_read_ && sync_->rank() == 0) {  // a resumed run: the value to beat survives the restart
    best_read_ = true;
    std::error_code ec;
    if (step_ > 0 && fs::is_regular_file(best / "best.json", ec)) {
      const auto j = nlohmann::json::parse(checkpoint::read_small_file(best / "best.json"), nullptr,
                                           /*allow_exceptions=*/false);
      if (j.is_object() && j.value("metric", std::string()) == cfg::spelling(metric) &&
          j["value"].is_number()) {
        best_value_ = j["value"].get<double>();
      }
    }
  }
  // Every rank holds the same summed metrics; rank 0, which reads best.json, decides.
  const auto [value, higher] = best_metric_value(metric, e);
  const bool better =
      sync_->rank() == 0 && std::isfinite(value) &&
      (std::isnan(best_value_) || (higher ? value > best_value_ : value < best_value_));
  if (sync_->sum_scalar(better ? 1.0 : 0.0) == 0) return;
  best_value_ = value;
  const fs::path tmp = best.string() + ".tmp", old = best.string() + ".old";
  if (sync_->rank() == 0) fs::remove_all(tmp);
  export_model(tmp.string());      // every rank: ZeRO-3 gathers the model unit by unit
  if (options_.write_tokenizer) {  // best/hf, as final/hf (run())
    options_.write_tokenizer(tmp.string(), parameter_units(), sync_->rank() == 0);
  }
  if (sync_->rank() != 0) return;
  nlohmann::ordered_json info;
  info["step"] = step;
  info["metric"] = cfg::spelling(metric);
  info["value"] = value;
  checkpoint::write_json_durable(tmp / "best.json", info);
  fs::remove_all(old);
  std::error_code ec;
  if (fs::exists(best, ec)) fs::rename(best, old);
  fs::rename(tmp, best);
  checkpoint::fsync_dir(best.parent_path());
  fs::remove_all(old);
  nlohmann::ordered_json line;
  line["event"] = "best";
  line["step"] = step;
  line[cfg::spelling(metric)] = value;
  write_metrics(line);
  spdlog::info("best {} so far ({:.4f}) at step {}: exported to {}", cfg::spelling(metric), value,
               step, best.string());
}

}  // namespace dnallm::train
