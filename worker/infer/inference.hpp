// Batched inference with an exported model: embeddings, generation, classifier predictions.
// Used by dnallm-infer (worker/infer/infer_main.cpp and its cli_*.cpp); see docs/inference.md.
//
// Sequences are framed as in training ([CLS] tokens [SEP] for BERT, [CLS] tokens for GPT) and
// cut to the tokens the model's positions hold (ModelSpec::usable_positions(); the number cut is
// counted and reported). A batch pads its rows to its longest one (see Note [Length-sorted
// batches] in inference.cpp); padded positions are masked out of attention and pooling, so a
// sequence's result does not depend on its batch (up to float rounding of batched GEMMs).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "worker/data/sequence_codec.hpp"
#include "worker/data/tokenizer.hpp"
#include "worker/infer/embedding_writer.hpp"
#include "worker/models/language_model.hpp"

namespace dnallm::infer {

// "auto": cuda:LOCAL_RANK when LibTorch sees a GPU, else cpu; "cuda": cuda:LOCAL_RANK;
// "cuda:N", "cpu". Throws Error(kUsage) when a GPU is asked for and none is visible. Loads
// the CUDA plugin first where a GPU may be used (Note [Lazy CUDA] in core/cuda_plugin.hpp):
// call it after the inputs were checked, before anything else asks LibTorch about CUDA.
torch::Device resolve_device(const std::string& spec, int local_rank);

// One input sequence. FASTA/FASTQ ids are the record names; a table row's id is "row<N>"
// (N: 1-based among the good records, the header not counted; other columns are not read).
struct InputSequence {
  std::string id;
  std::string bases;  // upper-case A C G T N
  bool cut = false;   // bases past set_max_bases() were dropped (FASTA/FASTQ)
};

// Streams the records [begin, end) of a FASTA/FASTQ (plain or gzip) or CSV/TSV/JSONL file in
// file order. Tables are read through their offset index, FASTA by a sequential scan.
class SequenceInput {
 public:
  // `keep_case`: FASTA/FASTQ lower-case bases stay lower-case (Note [Sequence codec]; tables
  // are upper-cased).
  explicit SequenceInput(const std::string& path, const std::string& sequence_column = "sequence",
                         bool keep_case = false);
  ~SequenceInput();
  // Records in the file (a FASTA file is scanned once for this).
  uint64_t count();
  // Restricts next() to records [begin, end).
  void select(uint64_t begin, uint64_t end);
  // FASTA/FASTQ records keep their first `n` bases only, from the next one on (Note [Long
  // records], worker/data/sequence_reader.hpp); tables are read whole.
  void set_max_bases(int64_t n);
  bool next(InputSequence& out);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Token ids of a framed sequence (see the header comment); `truncated` is set when cut.
std::vector<int64_t> frame_sequence(const data::Tokenizer& tokenizer,
                                    const models::ModelSpec& options, const std::string& bases,
                                    bool* truncated = nullptr);

// The longest input embed and predict give a model, in tokens: its usable_positions(), or for a
// model that computes past them (rotary, ALiBi: DNABERT-2 runs any length) at least
// kLongestInput.
inline constexpr int64_t kLongestInput = 8192;
int64_t longest_input(const models::ModelSpec& spec);

// The most bases one regular token of `codec` stands for (its longest piece; at least 1): a
// window of T tokens holds at most T times as many bases.
int64_t most_bases_a_token(const data::SequenceCodec& codec);

// The bases a row of the model holds (Note [Variant windows], variants.hpp): its regular tokens
// (usable positions less the codec's framing, at least 1) times most_bases_a_token().
int64_t bases_positions_hold(const models::ModelSpec& spec, const data::SequenceCodec& codec);

// A model whose positions extend past its length (rotary, a long convolution) still has a
// largest window: this many times its positions' bases (a window of 10^9 bases ran until killed
// holding GBs; issue 57).
inline constexpr int64_t kWindowExtendFactor = 8;

// The bases of a record that embed and predict keep (Note [Long records]): twice the bases
// longest_input() + 1 tokens can hold, so that the tokens kept are those of the whole record
// and the record still counts as cut.
int64_t bases_kept(const data::SequenceCodec& codec, const models::ModelSpec& spec);

// The framed ids of `bases` through the model's own tokenizer (Note [Sequence codec]), cut to
// longest_input() tokens; `truncated` is set when cut.
std::vector<int64_t> frame_sequence(const data::SequenceCodec& codec,
                                    const models::ModelSpec& options, const std::string& bases,
                                    bool* truncated = nullptr);

// Pads rows to the longest: input_ids [B, T] and attention_mask [B, T] on `device`; on the
// left when `left` (as transformers pads HyenaDNA and Caduceus).
models::ForwardInputs pad_batch(const std::vector<std::vector<int64_t>>& rows, int64_t pad_id,
                                const torch::Device& device, bool left = false);

enum class Pooling { kMean, kCls, kTokens };
Pooling parse_pooling(const std::string& name);

// Final hidden states [B, T, H] pooled: kMean averages the real (unpadded) positions, kCls
// takes position 0 ([CLS]); both give [B, H]. kTokens returns the hidden states [B, T, H].
torch::Tensor pool_hidden(const torch::Tensor& hidden, const torch::Tensor& attention_mask,
                          Pooling pooling);

// Prints "<what>: done/total (rate/s), ETA" to the log at most every `period_s`.
class Progress {
 public:
  Progress(std::string what, uint64_t total, double period_s = 10.0);
  void advance(uint64_t n);
  void finish();

 private:
  std::string what_;
  uint64_t total_, done_ = 0;
  double period_s_;
  double start_, last_;
};

struct EmbedOptions {
  Pooling pooling = Pooling::kMean;
  int64_t batch_size = 32;  // sequences per forward pass
  // The mean of the sequence's and its reverse complement's pooled embeddings (strand-invariant
  // features, as Caduceus' authors pool); not with Pooling::kTokens.
  bool rc_average = false;
};

// The reverse complement of upper-case bases (anything but A, C, G, T becomes N).
std::string reverse_complement(const std::string& bases);

struct RunCounts {
  uint64_t sequences = 0;
  uint64_t truncated = 0;            // sequences cut to the model's positions
  data::LowerCaseReport lower_case;  // what soft-masked bases became
};

// Embeds every selected record of `input` into `sink`, in input order.
RunCounts embed(models::LanguageModel model, const data::SequenceCodec& codec, SequenceInput& input,
                uint64_t total, EmbeddingSink& sink, const EmbedOptions& options,
                const torch::Device& device);

// Classifier / regression predictions: calls `row(id, probabilities or {value})` in order.
RunCounts predict(models::LanguageModel model, const data::SequenceCodec& codec,
                  SequenceInput& input, uint64_t total, int64_t batch_size,
                  const torch::Device& device,
                  const std::function<void(const std::string&, const std::vector<float>&)>& row);

struct GenerateRun {
  models::GenerateOptions generate;
  int64_t batch_size = 16;  // prompts per batch (prompts of equal token length batch together)
};

// Generation from every selected record as a prompt: calls `out(id, bases)` with the prompt
// followed by the generated bases, in input order. Deterministic for a given seed and
// batch size (batch i samples with seed + i).
RunCounts generate(models::LanguageModel model, const data::SequenceCodec& codec,
                   SequenceInput& input, uint64_t total, const GenerateRun& run,
                   const torch::Device& device,
                   const std::function<void(const std::string&, const std::string&)>& out);

}  // namespace dnallm::infer
