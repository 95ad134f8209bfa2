#include "worker/infer/inference.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/error.hpp"
#include "core/log.hpp"
#include "worker/data/rng.hpp"
#include "worker/data/sequence_reader.hpp"
#include "worker/data/table_dataset.hpp"
#include "worker/train/device_stats.hpp"

namespace dnallm::infer {
namespace {

using torch::Tensor;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool is_table(cfg::DataFormat format) {
  return format == cfg::DataFormat::kCsv || format == cfg::DataFormat::kTsv ||
         format == cfg::DataFormat::kJsonl;
}

// The bases the regular tokens of framed `ids` stand for, an unknown token one base.
size_t covered_bases(const data::SequenceCodec& codec, const std::vector<int64_t>& ids) {
  size_t n = 0;
  for (const auto id : ids) n += id == codec.unk_id() ? 1 : codec.bases_of(id).size();
  return n;
}

// Reads up to `n` selected records; their framed token ids go to `rows`.
size_t read_batch(SequenceInput& input, const data::SequenceCodec& codec,
                  const models::ModelSpec& options, size_t n, std::vector<InputSequence>& records,
                  std::vector<std::vector<int64_t>>& rows, RunCounts& counts,
                  bool prompts = false) {
  records.clear();
  rows.clear();
  InputSequence rec;
  while (records.size() < n && input.next(rec)) {
    bool cut = false;
    rows.push_back(prompts ? codec.frame_prompt(rec.bases, options.usable_positions(), &cut)
                           : frame_sequence(codec, options, rec.bases, &cut));
    counts.lower_case.add(rec.bases, rows.back(), codec.unk_id());
    counts.truncated += cut || rec.cut ? 1 : 0;
    records.push_back(std::move(rec));
  }
  counts.sequences += records.size();
  return records.size();
}

// The batches of `order` (rows sorted by length when `sorted`): at most `batch` rows each, and
// rows of one length only when the model's padding would change its result (ModelSpec::
// masks_padding).
std::vector<std::pair<size_t, size_t>> batch_ranges(const std::vector<size_t>& order,
                                                    const std::vector<std::vector<int64_t>>& rows,
                                                    size_t batch, bool equal_lengths) {
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t start = 0; start < order.size();) {
    size_t stop = start + 1;
    while (stop < order.size() && stop - start < batch &&
           (!equal_lengths || rows[order[stop]].size() == rows[order[start]].size())) {
      ++stop;
    }
    out.emplace_back(start, stop);
    start = stop;
  }
  return out;
}

// Indices 0..n-1, stably sorted by row length when `sort`.
std::vector<size_t> length_order(const std::vector<std::vector<int64_t>>& rows, bool sort) {
  std::vector<size_t> order(rows.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (sort) {
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return rows[a].size() < rows[b].size(); });
  }
  return order;
}

}  // namespace

torch::Device resolve_device(const std::string& spec, int local_rank) {
  // Note [Lazy CUDA]: loads the CUDA plugin first ("auto": only where a GPU shows).
  const bool have_cuda = train::cuda_usable(spec, fmt::format("--device {}", spec));
  if (spec == "auto") {
    return have_cuda ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank))
                     : torch::Device(torch::kCPU);
  }
  if (spec == "cpu") return torch::kCPU;
  if (spec == "cuda" || spec.rfind("cuda:", 0) == 0) {
    DNALLM_CHECK(have_cuda, ExitCode::kUsage,
                 "--device {}: LibTorch sees no CUDA device here; use --device cpu or auto", spec);
    const int index = spec == "cuda" ? local_rank : std::atoi(spec.c_str() + 5);
    DNALLM_CHECK(index >= 0 && index < static_cast<int>(torch::cuda::device_count()),
                 ExitCode::kUsage, "--device {}: only {} CUDA device(s) visible", spec,
                 torch::cuda::device_count());
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  fail(ExitCode::kUsage, "--device \"{}\": use auto, cpu, cuda or cuda:N", spec);
}

std::string reverse_complement(const std::string& bases) {
  std::string out(bases.rbegin(), bases.rend());
  for (auto& c : out) {
    c = c == 'A' ? 'T' : c == 'C' ? 'G' : c == 'G' ? 'C' : c == 'T' ? 'A' : 'N';
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Input

struct SequenceInput::Impl {
  std::string path;
  cfg::DataFormat format = cfg::DataFormat::kAuto;
  std::string sequence_column;
  // FASTA/FASTQ
  std::unique_ptr<data::SequenceReader> reader;
  uint64_t position = 0;  // records consumed from `reader`
  // tables
  std::unique_ptr<data::TableDataset> table;
  uint64_t begin = 0, end = UINT64_MAX, next_index = 0;
  bool selected = false;

  bool keep_case = false;
  int64_t max_bases = INT64_MAX;

  void open_reader() {
    reader = std::make_unique<data::SequenceReader>(path, format);
    reader->set_keep_case(keep_case);
    reader->set_max_bases(max_bases);
    position = 0;
  }
};

SequenceInput::SequenceInput(const std::string& path, const std::string& sequence_column,
                             bool keep_case)
    : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  impl_->keep_case = keep_case;
  impl_->format = data::format_from_extension(path);
  impl_->sequence_column = sequence_column;
  if (is_table(impl_->format)) {
    data::TableOptions to;
    to.format = impl_->format;
    to.sequence_column = sequence_column;
    to.task = cfg::Task::kPretrain;  // labels, when present, are not needed
    impl_->table = std::make_unique<data::TableDataset>(std::vector<std::string>{path}, to);
  } else {
    impl_->open_reader();
  }
}

SequenceInput::~SequenceInput() = default;

uint64_t SequenceInput::count() {
  if (impl_->table) return impl_->table->size();
  data::SequenceReader scan(impl_->path, impl_->format);
  scan.set_max_bases(0);  // counted, checked, not kept (Note [Long records])
  data::SequenceRecord rec;
  uint64_t n = 0;
  while (scan.next(rec)) ++n;
  return n;
}

void SequenceInput::select(uint64_t begin, uint64_t end) {
  impl_->begin = begin;
  impl_->end = end;
  impl_->next_index = begin;
  if (!impl_->table && impl_->position > begin) impl_->open_reader();
}

void SequenceInput::set_max_bases(int64_t n) {
  impl_->max_bases = n;
  if (impl_->reader) impl_->reader->set_max_bases(n);
}

bool SequenceInput::next(InputSequence& out) {
  auto& s = *impl_;
  if (s.next_index >= s.end) return false;
  if (s.table) {
    if (s.next_index >= s.table->size()) return false;
    data::SampleRng rng(0);
    auto sample = s.table->get(s.next_index, rng);
    out.id = fmt::format("row{}", s.next_index + 1);
    out.bases = std::move(sample.bases);
    out.cut = false;
    ++s.next_index;
    return true;
  }
  data::SequenceRecord rec;
  while (s.position < s.next_index) {  // skip to the selection
    if (!s.reader->next(rec)) return false;
    ++s.position;
  }
  if (!s.reader->next(rec)) return false;
  ++s.position;
  ++s.next_index;
  out.id = std::move(rec.name);
  out.cut = rec.length > static_cast<int64_t>(rec.bases.size());
  out.bases = std::move(rec.bases);
  return true;
}

// ---------------------------------------------------------------------------------------------
// Batches

std::vector<int64_t> frame_sequence(const data::Tokenizer& tokenizer,
                                    const models::ModelSpec& options, const std::string& bases,
                                    bool* truncated) {
  // Same framing as data::encode_sample: [CLS] tokens [SEP] (BERT) or [CLS] tokens (GPT).
  const bool bert = !options.causal();
  const int64_t budget = options.usable_positions() - (bert ? 2 : 1);
  auto tokens = tokenizer.encode(bases);
  const bool cut = static_cast<int64_t>(tokens.size()) > budget;
  if (cut) tokens.resize(static_cast<size_t>(budget));
  if (truncated != nullptr) *truncated = cut;
  std::vector<int64_t> ids;
  ids.reserve(tokens.size() + 2);
  ids.push_back(data::kClsId);
  ids.insert(ids.end(), tokens.begin(), tokens.end());
  if (bert) ids.push_back(data::kSepId);
  return ids;
}

int64_t longest_input(const models::ModelSpec& spec) {
  return spec.extends_past_max_length ? std::max(spec.usable_positions(), kLongestInput)
                                      : spec.usable_positions();
}

int64_t most_bases_a_token(const data::SequenceCodec& codec) {
  size_t most = 1;
  for (int64_t id = 0; id < codec.vocab_size(); ++id)
    most = std::max(most, codec.bases_of(id).size());
  return static_cast<int64_t>(most);
}

int64_t bases_positions_hold(const models::ModelSpec& spec, const data::SequenceCodec& codec) {
  return std::max<int64_t>(1, spec.usable_positions() - codec.framing_tokens()) *
         most_bases_a_token(codec);
}

int64_t bases_kept(const data::SequenceCodec& codec, const models::ModelSpec& spec) {
  return 2 * (longest_input(spec) + 1) * most_bases_a_token(codec);
}

std::vector<int64_t> frame_sequence(const data::SequenceCodec& codec,
                                    const models::ModelSpec& options, const std::string& bases,
                                    bool* truncated) {
  return codec.frame(bases, longest_input(options), truncated);
}

models::ForwardInputs pad_batch(const std::vector<std::vector<int64_t>>& rows, int64_t pad_id,
                                const torch::Device& device, bool left) {
  size_t longest = 0;
  for (const auto& r : rows) longest = std::max(longest, r.size());
  const auto b = static_cast<int64_t>(rows.size());
  const auto t = static_cast<int64_t>(longest);
  auto ids = torch::full({b, t}, pad_id, torch::kInt64);
  auto mask = torch::zeros({b, t}, torch::kInt64);
  auto ids_a = ids.accessor<int64_t, 2>();
  auto mask_a = mask.accessor<int64_t, 2>();
  for (int64_t i = 0; i < b; ++i) {
    const auto& r = rows[static_cast<size_t>(i)];
    const int64_t at = left ? t - static_cast<int64_t>(r.size()) : 0;
    for (size_t j = 0; j < r.size(); ++j) {
      ids_a[i][at + static_cast<int64_t>(j)] = r[j];
      mask_a[i][at + static_cast<int64_t>(j)] = 1;
    }
  }
  models::ForwardInputs in;
  in.input_ids = ids.to(device, /*non_blocking=*/true);
  in.attention_mask = mask.to(device, /*non_blocking=*/true);
  return in;
}

Pooling parse_pooling(const std::string& name) {
  if (name == "mean") return Pooling::kMean;
  if (name == "cls") return Pooling::kCls;
  if (name == "tokens") return Pooling::kTokens;
  fail(ExitCode::kUsage, "--pooling \"{}\": use mean, cls or tokens", name);
}

Tensor pool_hidden(const Tensor& hidden, const Tensor& attention_mask, Pooling pooling) {
  switch (pooling) {
    case Pooling::kCls:
      return hidden.select(1, 0);
    case Pooling::kTokens:
      return hidden;
    case Pooling::kMean: {
      auto mask = attention_mask.to(hidden.dtype()).unsqueeze(-1);
      return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0);
    }
  }
  return hidden;
}

// ---------------------------------------------------------------------------------------------
// Progress

Progress::Progress(std::string what, uint64_t total, double period_s)
    : what_(std::move(what)), total_(total), period_s_(period_s) {
  start_ = last_ = now_s();
}

void Progress::advance(uint64_t n) {
  done_ += n;
  const double t = now_s();
  if (t - last_ < period_s_) return;
  last_ = t;
  const double rate = double(done_) / std::max(t - start_, 1e-9);
  spdlog::info("{}: {}/{} ({:.1f}/s), ETA {}", what_, done_, total_, rate,
               format_duration(double(total_ - std::min(done_, total_)) / rate));
}

void Progress::finish() {
  const double s = now_s() - start_;
  spdlog::info("{}: {} in {:.1f} s ({:.1f}/s)", what_, done_, s, double(done_) / std::max(s, 1e-9));
}

// ---------------------------------------------------------------------------------------------
// Commands

RunCounts embed(models::LanguageModel model, const data::SequenceCodec& codec, SequenceInput& input,
                uint64_t total, EmbeddingSink& sink, const EmbedOptions& options,
                const torch::Device& device) {
  torch::InferenceMode inference;
  input.set_max_bases(bases_kept(codec, model->spec()));  // Note [Long records]
  RunCounts counts;
  Progress progress("embed", total);
  std::vector<InputSequence> records;
  std::vector<std::vector<int64_t>> rows;
  const int64_t pad = codec.pad_id();
  const bool per_token = options.pooling == Pooling::kTokens;
  const bool equal_lengths = !model->spec().masks_padding;
  // Note [Length-sorted batches]: pooled embeddings are computed over a chunk of
  // kSortChunk batches sorted by length, so rows of a batch have similar lengths and little
  // of each forward pass is padding; they are written back in input order. Per-token output
  // (a chunk of it would hold chunk x T x H floats) goes batch by batch, in order.
  constexpr size_t kSortChunk = 8;
  const size_t batch = static_cast<size_t>(options.batch_size);
  const size_t chunk = per_token ? batch : batch * kSortChunk;
  DNALLM_CHECK(!(per_token && options.rc_average), ExitCode::kUsage,
               "--rc-average averages pooled embeddings; per-token rows (--pooling tokens) of the "
               "two strands do not line up");
  // The embeddings of `rows`, in their order.
  const auto embed_rows = [&](std::vector<std::vector<int64_t>>& framed) {
    const auto order = length_order(framed, !per_token || equal_lengths);
    std::vector<torch::Tensor> results(framed.size());
    for (const auto& [start, stop] : batch_ranges(order, framed, batch, equal_lengths)) {
      std::vector<std::vector<int64_t>> group;
      for (size_t i = start; i < stop; ++i) group.push_back(std::move(framed[order[i]]));
      auto in = pad_batch(group, pad, device);
      auto pooled = pool_hidden(model->encode(in), in.attention_mask, options.pooling)
                        .to(torch::kFloat32)
                        .to(torch::kCPU);
      for (size_t i = start; i < stop; ++i) {
        auto r = pooled[static_cast<int64_t>(i - start)];
        // Per-token rows: the real positions only (padding dropped).
        if (per_token) r = r.narrow(0, 0, static_cast<int64_t>(group[i - start].size()));
        results[order[i]] = r.contiguous();
      }
    }
    return results;
  };
  while (read_batch(input, codec, model->spec(), chunk, records, rows, counts) > 0) {
    // The bases each row covers: a cut record's other strand is that of the same bases.
    std::vector<size_t> covered;
    for (const auto& r : rows) covered.push_back(covered_bases(codec, r));
    auto results = embed_rows(rows);
    if (options.rc_average) {
      std::vector<std::vector<int64_t>> rc_rows;
      for (size_t i = 0; i < records.size(); ++i) {
        const auto& bases = records[i].bases;
        rc_rows.push_back(
            frame_sequence(codec, model->spec(), reverse_complement(bases.substr(0, covered[i]))));
      }
      const auto rc = embed_rows(rc_rows);
      for (size_t i = 0; i < results.size(); ++i)
        results[i] = ((results[i] + rc[i]) / 2).contiguous();
    }
    for (size_t i = 0; i < records.size(); ++i) {
      const int64_t n = per_token ? results[i].size(0) : 1;
      sink.append(records[i].id, results[i].data_ptr<float>(), n);
    }
    progress.advance(records.size());
  }
  progress.finish();
  return counts;
}

RunCounts predict(models::LanguageModel model, const data::SequenceCodec& codec,
                  SequenceInput& input, uint64_t total, int64_t batch_size,
                  const torch::Device& device,
                  const std::function<void(const std::string&, const std::vector<float>&)>& row) {
  const auto& o = model->spec();
  DNALLM_CHECK(o.task != models::Task::kPretrain, ExitCode::kUsage,
               "predict needs a fine-tuned classifier or regressor (config.json \"task\" is "
               "\"pretrain\"): use embed or generate for a language model");
  torch::InferenceMode inference;
  input.set_max_bases(bases_kept(codec, o));  // Note [Long records]
  RunCounts counts;
  Progress progress("predict", total);
  std::vector<InputSequence> records;
  std::vector<std::vector<int64_t>> rows;
  const size_t batch = static_cast<size_t>(batch_size);
  while (read_batch(input, codec, o, batch, records, rows, counts) > 0) {
    const auto order = length_order(rows, !o.masks_padding);
    std::vector<std::vector<float>> results(records.size());
    for (const auto& [start, stop] : batch_ranges(order, rows, batch, !o.masks_padding)) {
      std::vector<std::vector<int64_t>> group;
      for (size_t i = start; i < stop; ++i) group.push_back(rows[order[i]]);
      auto in = pad_batch(group, codec.pad_id(), device);
      auto logits = model->forward(in).logits.to(torch::kFloat32);
      auto values = (o.task == models::Task::kClassification ? torch::softmax(logits, -1)
                                                             : logits.unsqueeze(-1))
                        .to(torch::kCPU)
                        .contiguous();
      const int64_t k = values.size(1);
      const float* p = values.data_ptr<float>();
      for (size_t i = start; i < stop; ++i) {
        const int64_t at = static_cast<int64_t>(i - start);
        results[order[i]] = std::vector<float>(p + at * k, p + (at + 1) * k);
      }
    }
    for (size_t i = 0; i < records.size(); ++i) row(records[i].id, results[i]);
    progress.advance(records.size());
  }
  progress.finish();
  return counts;
}

RunCounts generate(models::LanguageModel model, const data::SequenceCodec& codec,
                   SequenceInput& input, uint64_t total, const GenerateRun& run,
                   const torch::Device& device,
                   const std::function<void(const std::string&, const std::string&)>& out) {
  const auto& o = model->spec();
  DNALLM_CHECK(o.causal() && o.task == models::Task::kPretrain, ExitCode::kUsage,
               "generate needs a causal language model (a GPT-style, Llama, GPT-NeoX or HyenaDNA "
               "language model; this one is {} {})",
               models::arch_name(o.arch), models::task_name(o.task));
  // Room for the new tokens: prompts are cut so prompt + new tokens fit the positions.
  models::ModelSpec prompt_options = o;
  if (!o.extends_past_max_length) {
    const int64_t positions = o.usable_positions();
    DNALLM_CHECK(run.generate.max_new_tokens < positions - 1, ExitCode::kUsage,
                 "--max-new-tokens {} does not fit the model's {} learned positions "
                 "(max_position_embeddings; learned positions cannot extrapolate, rotary ones "
                 "can): give --max-new-tokens <= {}",
                 run.generate.max_new_tokens, positions, positions - 2);
    prompt_options.max_seq_length = o.max_seq_length - run.generate.max_new_tokens;
  }
  torch::InferenceMode inference;
  RunCounts counts;
  Progress progress("generate", total);
  // A chunk of prompts is grouped by token length (generate() needs equal lengths in a batch)
  // and written back in input order; the chunk bounds memory.
  const size_t chunk = static_cast<size_t>(run.batch_size) * 16;
  std::vector<InputSequence> records;
  std::vector<std::vector<int64_t>> rows;
  uint64_t batch_index = 0;
  // Special tokens decode to no base: never generated, so every new token adds bases.
  models::GenerateOptions sampling = run.generate;
  for (int64_t id = 0; id < o.vocab_size; ++id) {
    if (id >= codec.vocab_size() || codec.is_special(id)) sampling.suppress_ids.push_back(id);
  }
  uint64_t short_rows = 0;
  while (read_batch(input, codec, prompt_options, chunk, records, rows, counts,
                    /*prompts=*/true) > 0) {
    std::vector<size_t> order(records.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return rows[a].size() < rows[b].size(); });
    std::vector<std::string> results(records.size());
    for (size_t start = 0; start < order.size();) {
      size_t stop = start + 1;
      while (stop < order.size() && stop - start < static_cast<size_t>(run.batch_size) &&
             rows[order[stop]].size() == rows[order[start]].size()) {
        ++stop;
      }
      std::vector<std::vector<int64_t>> group;
      for (size_t i = start; i < stop; ++i) group.push_back(rows[order[i]]);
      auto prompt = pad_batch(group, codec.pad_id(), device).input_ids;
      auto options = sampling;
      options.seed = run.generate.seed + batch_index++;
      auto tokens = model->generate(prompt, options).to(torch::kCPU).contiguous();
      const int64_t prompt_len = prompt.size(1);
      for (size_t i = start; i < stop; ++i) {
        auto row = tokens[static_cast<int64_t>(i - start)];
        std::vector<int64_t> ids(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
        const std::vector<int64_t> fresh(ids.begin() + prompt_len, ids.end());
        if (static_cast<int64_t>(codec.decode(fresh).size()) < run.generate.max_new_tokens) {
          ++short_rows;
        }
        results[order[i]] = codec.decode(ids);
      }
      start = stop;
    }
    for (size_t i = 0; i < records.size(); ++i) out(records[i].id, results[i]);
    progress.advance(records.size());
  }
  progress.finish();
  if (short_rows > 0) {
    spdlog::warn(
        "{} of {} sequences got fewer than --max-new-tokens = {} new bases: the {} tokenizer "
        "has tokens that decode to no base",
        short_rows, counts.sequences, run.generate.max_new_tokens, codec.describe());
  }
  return counts;
}

}  // namespace dnallm::infer
