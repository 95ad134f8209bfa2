// The training loop: micro-steps with gradient accumulation, globally normalised loss,
// clipping, loss scaling, AdamW over the flat buffer, evaluation, metrics and the export.
//
// Note [Loss normalisation]: the loss of a step is
//     sum over every label token of the GLOBAL batch (all micro-steps, all ranks) of its NLL
//     ---------------------------------------------------------------------------------------
//                       number of label tokens in the global batch
// The trainer first takes all micro-batches of the step, sums their num_label_tokens,
// reduces that count across ranks (GradientSync::sum_scalar), then backpropagates
// loss_sum_j * (loss_scale / global_count) for each micro-step j. The gradients summed over
// micro-steps and ranks are then exactly those of one big batch: k micro-steps == one step
// with a k-times micro-batch, and N ranks == 1 rank (up to float summation order).
// Classification/regression count rows instead of tokens.
//
// Note [Sync-free step]: on an accelerator the step never waits for the host. What the host
// needs (label counts, "is anything padded", the scored positions) is computed from the host
// batch (Note [Host-known batch facts]); the loss is summed on the device and the gradient
// norm, the clip coefficient and the AdamW update stay device tensors (fused AdamW on
// LibTorch 2.x CUDA). Loss and norm are read back only on logging steps (run() asks for
// them; train_step() called directly always reads). A NaN loss is then reported at the next
// logging step, not at the step it appeared. fp16's loss scaler still reads the overflow flag
// once per step (as torch's GradScaler with a non-fused optimizer). StepResult::host_reads
// counts the trainer's own reads; tests check the model's with an operator observer.
//
// Note [Dropout randomness]: dropout (model.dropout, lora.dropout) draws from LibTorch's
// default generators, which the trainer reseeds before every micro-step with
// dropout_seed(training.seed, step, micro-step, rank). The random state of a step is then
// a function of where training is, not of how it got there: a run resumed at step s (at
// any world size) draws the same masks as an uninterrupted one, ranks draw different
// masks, and the checkpoint needs no generator blobs (the manifest records the scheme and
// the seed; restore refuses a checkpoint whose scheme it does not know).
//
// Note [Optimizer offload]: training.optimizer_offload = true keeps this rank's AdamW state
// (exp_avg, exp_avg_sq and its scratch buffer) and an fp32 master copy of its parameter
// range (the ZeRO shard, or the whole buffer without ZeRO) in host memory, pinned on CUDA.
// The device then holds no optimizer state: 8 bytes (+4 of scratch) per owned parameter
// less. Each step: the reduced gradient range is copied to the host (blocking: the host
// update needs it), FlatAdamW's host path updates the master copy, and the range is copied
// back to the flat buffer with non_blocking = true; ZeRO's all-gather then spreads it as
// usual. The master copy is refreshed from the device only when something else writes the
// parameters (construction, restore()). What overlaps: the upload with the host's work for
// the next step (fetching and packing the batch, queueing its forward); the next forward's
// kernels are queued behind the upload on the compute stream, so the upload does not overlap
// the forward's compute, and the download and the host update do not overlap anything (the
// device idles meanwhile). On CPU the update is the same sequence of operations on the same
// values as without offload, so results are bit for bit the same; on CUDA the step stops
// being sync-free (one host wait per step for the gradients) and runs the host AdamW
// instead of the fused kernel. Checkpoints save and restore the moments as without offload.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/classification.hpp"
#include "core/config.hpp"
#include "core/metrics.hpp"
#include "worker/data/batch.hpp"
#include "worker/models/family_io.hpp"
#include "worker/models/language_model.hpp"
#include "worker/optim/flat_adamw.hpp"
#include "worker/parallel/gradient_sync.hpp"
#include "worker/train/batch_inputs.hpp"

namespace dnallm::parallel {
class ContextMesh;
}  // namespace dnallm::parallel

namespace dnallm::train {

// The seed of the default generators for one micro-step (Note [Dropout randomness]).
uint64_t dropout_seed(uint64_t seed, int64_t step, int64_t micro_step, int rank);
// The name of that scheme, stored in checkpoints as state.rng.scheme.
inline constexpr const char* kRngScheme = "splitmix64(seed,step,micro_step,rank)";

// Micro-batches in (step, micro-step) order. Called from the trainer's thread only.
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  virtual data::Batch next() = 0;
  // Back to the first batch (evaluation sources are rewound before every evaluation).
  virtual void rewind() {}
  // Samples per epoch (for training.num_train_epochs); 0 when unknown.
  virtual uint64_t samples_per_epoch() const { return 0; }
  // Seconds the trainer has waited for batches so far.
  virtual double data_wait_s() const { return 0.0; }
  // Note [Shrink and grow]: from now on the batches of rank `rank` of `world_size`, from the
  // first batch (an evaluation source; the training loader is moved by the recovery). A source
  // that cannot be split again throws Error(kFailure).
  virtual void reshard(int rank, int world_size);
};

// Note [GradientSync] lives with the data-parallel engines (worker/parallel/gradient_sync.hpp).
using parallel::GradientSync;
using parallel::SingleProcessSync;

struct StepResult {
  int64_t step = 0;   // 1-based optimizer step just finished
  double loss = 0.0;  // mean over the global batch
  double lr = 0.0;
  double grad_norm = 0.0;  // before clipping, unscaled
  bool skipped = false;    // fp16 overflow: parameters untouched
  int64_t tokens = 0;      // real tokens processed by this rank (attention_mask = 1)
  int64_t seq_len = 0;     // padded sequence length of the step's batches (for MFU)
  int64_t rows = 0;        // sequences in this rank's micro-batches of the step
  double step_s = 0.0, comm_exposed_s = 0.0, data_wait_s = 0.0;
  // Whether loss, grad_norm and skipped were read back (Note [Sync-free step]); when false
  // they are NaN / false.
  bool host_values = true;
  // Device -> host reads the trainer made in this step (Note [Sync-free step]).
  int64_t host_reads = 0;
};

// Note [Best checkpoint]: with checkpoint.best_metric set, the live model is exported (rank 0
// writes; every rank takes part, as ZeRO-3 gathers it unit by unit: Note [Exports unit by unit])
// to <checkpoint.dir>/best after each evaluation whose metric beats every earlier one (strictly;
// lower loss / bits_per_base, higher accuracy / mcc / f1), with best.json ({"step",
// "metric", "value"}) beside the weights: the Hugging Face Trainer's load_best_model_at_end
// without reloading (the test set is scored from <dir>/best, scripts/gue-finetune.sh). The
// export goes to <dir>/best.tmp first and replaces <dir>/best by renames, so a crash leaves
// the previous best whole (or, between the two renames, <dir>/best.old). A resumed run reads
// the value to beat from best.json (same metric), so a restart keeps the true best.
struct EvalResult {
  double loss = 0.0;           // mean NLL per label token (nats)
  double bits_per_base = 0.0;  // total NLL in bits / bases predicted (Note [Bits per base])
  int64_t tokens = 0;          // label tokens scored
  int64_t bases = 0;           // bases predicted
  int64_t correct = 0;         // classification: rows predicted right
  int64_t rows = 0;
  double accuracy = 0.0;  // classification only
  // Classification with at most kMaxScoredClasses labels: MCC, macro F1, ... (Note
  // [Classification scores], core/classification.hpp); nullopt otherwise.
  std::optional<ClassificationScores> scores;
};
inline constexpr int64_t kMaxScoredClasses = 64;

// Note [Bits per base]: bits_per_base = sum of NLL over predicted tokens / ln 2, divided by
// the bases those tokens cover: 1 per token for char tokens, k per k-mer token (for
// overlapping k-mers the bases of neighbouring predictions overlap: it is the per-token code
// length spread over the bases the token spells), the piece length for BPE. The trainer
// gets the count from `TrainerOptions::bases_of_label`, defaulting to 1 base per token.
class Trainer;

// What a step hook asks of Trainer::run(): go on, or stop after this step (Note [Step hooks]).
enum class StepAction { kContinue, kStop };
using StepHook = std::function<StepAction(Trainer&, const StepResult&)>;
// How Trainer::run() ended: every step done (and the end-of-run work), or a hook stopped it.
enum class RunEnd { kCompleted, kStopped };

// Note [Step hooks]: TrainerOptions::after_step is a list, run in order on the training thread
// after every step of run() (after logging and evaluation). Whoever adds a hook appends it
// (Checkpointer::install does too); the first hook that returns StepAction::kStop ends run()
// at once: the hooks after it, at_end, the export and the summary are skipped and run()
// returns RunEnd::kStopped. dnallm-train's list (install_step_hooks in train_main.cpp):
//   1. the profiler's after_step (the trace holds the steps, not the hooks' work);
//   2. the stop watchdog's step boundary (Note [Stop while blocked]);
//   3. the checkpoint (Checkpointer::install), then the test-only kill hook after a save;
//   4. the progress file (DNALLM_PROGRESS_FILE, elastic agents);
//   5. the test-only step delay;
//   6. preemption, which may stop (Note [Preemption] in worker/train/preemption.hpp).
struct TrainerOptions {
  // Bases spelled by token id `id` (for bits_per_base). Default: 1.
  std::function<int64_t(int64_t id)> bases_of_label;
  // Writes what the export needs beyond the weights and config.json, which the trainer cannot:
  // <dir>/tokenizer.json and the transformers layout <dir>/hf (train_main.cpp). Called on every
  // rank: `units` gathers the model a unit at a time for the Hugging Face layout's files
  // (collective, Note [Exports unit by unit] in models/family_io.hpp); `write`: this rank
  // writes (rank 0).
  std::function<void(const std::string& dir, const models::ParameterUnits& units, bool write)>
      write_tokenizer;
  bool console_progress = true;
  // Append to logging.metrics_file instead of truncating it: a resumed run (requeue,
  // elastic restart, restart by hand) keeps the history of the runs before it.
  bool append_metrics = false;
  double initial_loss_scale = 65536.0;  // fp16 dynamic loss scaling starts here
  // Note [Sync-free step]: unset = on for accelerators, off on CPU (where reading a value
  // costs nothing and the host path keeps the historical bit-exact results).
  std::optional<bool> sync_free;
  // Note [Step hooks]: after every step of run(), in order.
  std::vector<StepHook> after_step;
  // Once at the end of run() (not after a stop), in order, before the export: the
  // checkpointer's finish (worker/train/checkpointing.hpp).
  std::vector<std::function<void(Trainer&)>> at_end;
  // Before step `step` (1-based) of run(), in order: the profiler.
  std::vector<std::function<void(Trainer&, int64_t step)>> before_step;
  // Note [In-process recovery] (worker/train/in_process_recovery.hpp): called on the training
  // thread when a step throws. True: the group was re-formed and this rank holds the state
  // after the last step any rank completed (step() may have moved), so run() goes on with
  // the next step; false: run() rethrows the step's error. Null: every error is rethrown.
  std::function<bool(Trainer&)> recover;
  // Note [Data x context mesh] (worker/parallel/context_mesh.hpp): with a mesh, the model runs
  // context-parallel over its group, every batch of both sources is cut to this rank's
  // positions, and the step count counts data ranks. Null: no context parallelism.
  std::shared_ptr<parallel::ContextMesh> context;
};

// training.device (auto, cpu, cuda) resolved; CUDA comes with the index of the current CUDA
// device (the rank's GPU in dnallm-train). Throws Error(kUsage) for cuda without a CUDA device.
torch::Device pick_device(cfg::Device wanted);

// Number of optimizer steps: training.max_steps, or epochs × samples / global batch.
int64_t total_steps(const Config& config, uint64_t samples_per_epoch, int world_size);

// Runs `batches` micro-batches from `source` (rewound first) without gradients. With
// `context`, the source gives context shards and the model runs context-parallel.
EvalResult evaluate(models::LanguageModel model, BatchSource& source, int64_t batches,
                    const torch::Device& device,
                    const std::function<int64_t(int64_t)>& bases_of_label = {},
                    GradientSync* sync = nullptr, parallel::ContextMesh* context = nullptr);

class Trainer {
 public:
  // `eval` may be null. The model is moved to the device and its trainable parameters into
  // the flat buffers (Note [Flat buffers]).
  Trainer(Config config, models::LanguageModel model, std::unique_ptr<BatchSource> train,
          std::unique_ptr<BatchSource> eval, std::shared_ptr<GradientSync> sync,
          TrainerOptions options = {});
  ~Trainer();

  // One optimizer step (all micro-steps). Throws Error on a NaN/inf loss. With
  // `read_host_values` false a sync-free step (Note [Sync-free step]) leaves loss, grad_norm
  // and skipped unread; the host path always reads them.
  StepResult train_step(bool read_host_values = true);
  // Whether steps run sync-free (Note [Sync-free step]).
  bool sync_free() const { return sync_free_; }
  // Whether the optimizer state lives in host memory (Note [Optimizer offload]).
  bool offloaded() const { return host_params_.defined(); }
  // Offload: refreshes the host master copy of this rank's parameter range from the flat
  // buffer. Call after anything other than the optimizer wrote the parameters (restore()
  // does). No-op without offload. Training thread; blocks until the copy is done.
  void reload_host_params();
  // Trains to total_steps(), evaluating every eval_steps, logging every logging_steps, runs
  // the step hooks, writes the summary and (rank 0, checkpoint.save_final) exports
  // <dir>/final. RunEnd::kStopped when a step hook stopped it (Note [Step hooks]).
  RunEnd run();

  models::LanguageModel& model() { return model_; }
  optim::FlatParameters& flat() { return *flat_; }
  optim::FlatAdamW& optimizer() { return *adamw_; }
  const optim::LossScaler& loss_scaler() const { return scaler_; }
  optim::LossScaler& loss_scaler() { return scaler_; }
  GradientSync& sync() { return *sync_; }
  const Config& config() const { return config_; }
  int64_t step() const { return step_; }
  // Resume: the optimizer steps already done (the LR schedule position follows it).
  void set_step(int64_t step) { step_ = step; }
  // Note [Best checkpoint]: the best evaluation value so far (NaN: none yet), and setting it
  // (a rank that took over rank 0 gets the value of the rank it replaced).
  double best_value() const { return best_value_; }
  void set_best_value(double value) {
    best_value_ = value;
    best_read_ = true;
  }
  // Note [Shrink and grow]: the world communicator was re-formed with another size: steps
  // accumulate `grad_accum_steps` micro-batches from now on, the evaluation data is split for
  // this rank's new place, and the metrics writer follows rank 0 (a rank that becomes rank 0
  // appends to the file of the one before it). Training thread, at a step boundary.
  void regroup(int64_t grad_accum_steps);
  // Metrics lines of steps up to `step` were already written by another rank 0 (one that
  // died after writing them), or by this one before its group went back to an earlier step:
  // this rank 0 does not write them again. `kind`: the lines of one kind ("" step lines, else
  // an event's name: what the file shows the rank before wrote), "*" every kind (restart events
  // are always written). Training thread.
  void set_logged_through(int64_t step, const std::string& kind = "*") {
    logged_through_[kind] = std::max(logged_through_[kind], step);
  }
  // A rank that took over rank 0 writes the line of the last evaluation (every rank holds its
  // result), unless set_logged_through() says the rank 0 before it wrote it. Training thread.
  void log_last_evaluation() {
    if (last_eval_) log_evaluation(last_eval_->first, last_eval_->second);
  }
  // The result of the last step run() completed (step 0: none yet).
  const StepResult& last_step() const { return last_step_; }
  // One metrics event (docs/metrics.md; core/metrics.hpp): a JSON line and TensorBoard
  // scalars (rank 0; no-op without a metrics file or TensorBoard). Training thread.
  void write_metrics(const nlohmann::ordered_json& event);
  int64_t total_steps() const { return total_steps_; }
  // Whether step `step` (1-based) writes a metrics line: every training.logging_steps, the
  // first and the last.
  bool logs_step(int64_t step) const;
  const torch::Device& device() const { return device_; }
  // Where run() exports the final model.
  std::string export_dir() const;
  // Note [Best checkpoint]: where the best model so far is kept (<checkpoint.dir>/best).
  std::string best_dir() const { return config_.checkpoint.dir + "/best"; }

  // Note [Snapshot on a side stream]: `wait` (e.g. "the compute stream waits for the copy's
  // event") runs once, right before the next optimizer update overwrites the parameters and
  // moments. Training thread.
  void before_next_update(std::function<void()> wait) { pending_reads_.push_back(std::move(wait)); }
  // Note [Model FLOPs] (worker/train/mfu.hpp) per token at sequence length `seq_len`.
  double flops_per_token(int64_t seq_len) const;

 private:
  Config config_;
  models::LanguageModel model_;
  std::unique_ptr<BatchSource> train_, eval_;
  std::shared_ptr<GradientSync> sync_;
  TrainerOptions options_;
  torch::Device device_{torch::kCPU};
  std::unique_ptr<optim::FlatParameters> flat_;
  std::unique_ptr<optim::FlatAdamW> adamw_;
  optim::Schedule schedule_;
  optim::LossScaler scaler_;
  int64_t step_ = 0;
  int64_t total_steps_ = 0;
  // Note [Best checkpoint]: the best value so far (NaN: none yet); read from
  // <best_dir()>/best.json at the first evaluation of a resumed run.
  double best_value_ = std::nan("");
  bool best_read_ = false;
  std::map<std::string, int64_t> logged_through_;            // see set_logged_through()
  std::optional<std::pair<int64_t, EvalResult>> last_eval_;  // step, result
  StepResult last_step_;
  std::unique_ptr<MetricsWriter> metrics_;  // rank 0: logging.metrics_file, tensorboard_dir
  bool autocast_bf16_ = false, autocast_fp16_ = false;
  bool sync_free_ = false;
  std::vector<std::function<void()>> pending_reads_;
  // Note [Optimizer offload]: the host master copy of this rank's parameter range and the
  // host landing buffer of its gradients (pinned on CUDA); undefined without offload.
  torch::Tensor host_params_, host_grads_;
  void offloaded_update(const torch::Tensor& params, const torch::Tensor& grads, double lr,
                        double grad_scale);
  // Construction: the model on the device, its trainable parameters in the flat buffers
  // (GradientSync::order_parameters, attach) and the optimizer over this rank's range.
  void place_parameters();
  // Construction with TrainerOptions::context: the model and both sources on the mesh.
  void use_context_mesh();

  // The parts of train_step(), in order.
  struct LossSum {
    double host = 0.0;     // host path: the step's local loss sum
    torch::Tensor device;  // sync-free: the same, on the device
  };
  double take_micro_batches(std::vector<data::Batch>& micro, StepResult& r);  // global count
  LossSum forward_backward(const std::vector<data::Batch>& micro, double global_count, double scale,
                           StepResult& r);
  void apply_pending_reads();
  void host_update(double local_loss_sum, double global_count, double scale, StepResult& r);
  void sync_free_update(const torch::Tensor& device_loss_sum, double global_count, double scale,
                        bool read_host_values, StepResult& r);
  // AdamW over this rank's range (offloaded or not), then GradientSync::after_optimizer_step.
  void optimizer_step(double lr, double grad_scale);
  void optimizer_step(double lr, const torch::Tensor& grad_scale);  // device multiplier
  torch::Tensor shard_grads() const;  // this rank's range of the flat gradient

  // The parts of run().
  struct RunTotals {
    std::chrono::steady_clock::time_point start;
    double train_s = 0.0, tokens = 0.0, flops = 0.0;  // flops: Note [Model FLOPs]
    double final_loss = std::nan("");
    int64_t flops_seq = -1;
    double flops_per_token_at_seq = 0.0;
  };
  double account(const StepResult& r, RunTotals& totals);  // returns the step's global tokens
  void log_step(const StepResult& r, double global_tokens, const RunTotals& totals);
  void evaluate_at(int64_t step);
  void log_evaluation(int64_t step, const EvalResult& e);  // rank 0
  void open_metrics(bool append);                          // rank 0
  // Note [Best checkpoint]: called on every rank after each evaluation; rank 0 decides whether
  // the model is the best so far and tells the others (sum_scalar), all export it. Collective.
  void keep_if_best(int64_t step, const EvalResult& e);
  // The live model into `dir` (rank 0 writes); collective (Note [Exports unit by unit]).
  void export_model(const std::string& dir);
  // The sync's visit_parameter_units as an export takes it (collective).
  models::ParameterUnits parameter_units();
  StepAction run_after_step_hooks(const StepResult& r);
  void write_summary(const RunTotals& totals);
  double peak_tflops_ = 0.0;  // one device's peak for MFU; 0: unknown (no MFU)
};

}  // namespace dnallm::train
