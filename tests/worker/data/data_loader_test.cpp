#include "worker/data/data_loader.hpp"

#include <atomic>
#include <chrono>
#include <map>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "test_files.hpp"
#include "tests/support/expect_error.hpp"
#include "worker/data/genome_dataset.hpp"

namespace dnallm::data {
namespace {

using dnallm::testing::expect_error;

std::shared_ptr<const Dataset> genome(int64_t window = 30, uint64_t samples = 50) {
  GenomeOptions o;
  o.window_bases = window;
  o.samples_per_epoch = static_cast<int64_t>(samples);
  o.reverse_complement = 0.5;
  std::vector<SequenceRecord> recs = {{"a", testing::random_bases(3000, 1), 1},
                                      {"b", testing::random_bases(1000, 2), 1}};
  return std::make_shared<GenomeDataset>(recs, o, "mem");
}

LoaderOptions options(int rank, int world, int64_t mbs, int64_t accum, int workers) {
  LoaderOptions o;
  o.rank = rank;
  o.world_size = world;
  o.micro_batch_size = mbs;
  o.grad_accum_steps = accum;
  o.seed = 123;
  o.num_workers = workers;
  o.objective.max_seq_length = 32;
  return o;
}

// Rows of a batch by sample id (input ids + labels), for comparisons across layouts.
void collect(const Batch& b, std::map<uint64_t, std::vector<int64_t>>& out) {
  ASSERT_EQ(static_cast<int64_t>(b.sample_ids.size()), b.rows);
  for (int64_t r = 0; r < b.rows; ++r) {
    std::vector<int64_t> row(b.input_ids.begin() + r * b.seq_len,
                             b.input_ids.begin() + (r + 1) * b.seq_len);
    row.insert(row.end(), b.labels.begin() + r * b.seq_len, b.labels.begin() + (r + 1) * b.seq_len);
    EXPECT_TRUE(out.emplace(b.sample_ids[r], row).second)
        << "sample " << b.sample_ids[r] << " seen twice";
  }
}

TEST(DataLoader, DeterministicAcrossWorkerCounts) {
  auto ds = genome();
  auto tok = make_char_tokenizer();
  std::vector<Batch> reference;
  for (int workers : {0, 1, 3}) {
    DataLoader loader(ds, tok, options(0, 1, 4, 2, workers));
    for (int i = 0; i < 30; ++i) {  // 120 samples: crosses two epochs of 50
      Batch b = loader.next();
      if (workers == 0) {
        reference.push_back(b);
      } else {
        ASSERT_EQ(b.input_ids, reference[i].input_ids) << "workers " << workers << " batch " << i;
        ASSERT_EQ(b.labels, reference[i].labels);
        ASSERT_EQ(b.sample_ids, reference[i].sample_ids);
      }
    }
    EXPECT_GE(loader.data_wait_s(), 0.0);
    EXPECT_EQ(loader.state().consumed_samples, 120u);
  }
  EXPECT_EQ(reference[0].rows, 4);
  EXPECT_EQ(reference[0].seq_len, 32);
  EXPECT_GT(reference[0].num_label_tokens, 0);
}

TEST(DataLoader, ResumeAcrossWorldSizes2To3To1) {
  auto ds = genome(30, 20);  // 48 samples cross two epoch boundaries
  auto tok = make_char_tokenizer();
  // Reference: one rank, global batch 12 (mbs 2, accum 6), 4 steps = 48 samples.
  std::map<uint64_t, std::vector<int64_t>> reference;
  {
    DataLoader one(ds, tok, options(0, 1, 2, 6, 1));
    for (int i = 0; i < 24; ++i) collect(one.next(), reference);
  }
  ASSERT_EQ(reference.size(), 48u);
  std::map<uint64_t, std::vector<int64_t>> seen;
  // Phase 1: 2 ranks, mbs 2, accum 3 (global 12), 2 steps.
  SamplerState state;
  for (int r = 0; r < 2; ++r) {
    DataLoader l(ds, tok, options(r, 2, 2, 3, 2));
    for (int i = 0; i < 6; ++i) collect(l.next(), seen);
    state = l.state();
  }
  EXPECT_EQ(state.consumed_samples, 24u);
  state = SamplerState::from_json(nlohmann::json::parse(state.to_json().dump()));
  // Phase 2: 3 ranks, mbs 1, accum 2 (global 6), 2 steps.
  SamplerState state2;
  for (int r = 0; r < 3; ++r) {
    DataLoader l(ds, tok, options(r, 3, 1, 2, 1), &state);
    for (int i = 0; i < 4; ++i) collect(l.next(), seen);
    state2 = l.state();
  }
  EXPECT_EQ(state2.consumed_samples, 36u);
  // Phase 3: 1 rank, mbs 3, accum 2 (global 6), 2 steps.
  {
    DataLoader l(ds, tok, options(0, 1, 3, 2, 0), &state2);
    for (int i = 0; i < 4; ++i) collect(l.next(), seen);
    EXPECT_EQ(l.state().consumed_samples, 48u);
  }
  ASSERT_EQ(seen.size(), reference.size());
  for (const auto& [id, row] : reference) {
    ASSERT_TRUE(seen.count(id)) << "sample " << id << " skipped";
    EXPECT_EQ(seen[id], row) << "sample " << id << " differs";
  }
}

TEST(DataLoader, StateMidStepPointsAtStepStartAndMismatchRefused) {
  auto ds = genome();
  auto tok = make_char_tokenizer();
  DataLoader l(ds, tok, options(0, 1, 2, 3, 1));
  l.next();
  EXPECT_EQ(l.state().consumed_samples, 0u);
  l.next();
  l.next();
  EXPECT_EQ(l.state().consumed_samples, 6u);
  SamplerState wrong = l.state();
  wrong.seed = 999;
  EXPECT_THROW(DataLoader(ds, tok, options(0, 1, 2, 3, 1), &wrong), Error);
  // batch_at matches the stream.
  DataLoader fresh(ds, tok, options(0, 1, 2, 3, 0));
  Batch b0 = fresh.next();
  Batch b1 = fresh.next();
  EXPECT_EQ(fresh.batch_at(0, 1).input_ids, b1.input_ids);
  EXPECT_EQ(fresh.batch_at(0, 0).input_ids, b0.input_ids);
  // reset replays from a state.
  fresh.reset(SamplerState{123, ds->size(), 0, true});
  EXPECT_EQ(fresh.next().input_ids, b0.input_ids);
}

// A dataset whose sample 3 is bad: the worker's error reaches next().
class FailingDataset final : public Dataset {
 public:
  uint64_t size() const override { return 8; }
  Sample get(uint64_t index, SampleRng&) const override {
    if (index == 3) fail(ExitCode::kBadData, "record 3 is bad");
    return Sample{"ACGTACGT"};
  }
  int64_t skipped_records() const override { return 0; }
  std::string describe() const override { return "failing"; }
};

// Note [Evaluation covers each sample once]: with max_samples the ranks together see the
// first max_samples stream positions exactly once (short, then empty micro-batches), with and
// without group_by_length; a limit above the dataset size would otherwise wrap around.
TEST(DataLoader, MaxSamplesCoversEachPositionOnceAcrossRanks) {
  auto ds = genome(30, 50);
  auto tok = make_char_tokenizer();
  for (bool grouped : {false, true}) {
    for (int world : {1, 2, 3}) {
      SCOPED_TRACE(::testing::Message() << "world " << world << (grouped ? " grouped" : ""));
      std::map<uint64_t, std::vector<int64_t>> seen;
      for (int rank = 0; rank < world; ++rank) {
        auto o = options(rank, world, 4, 1, 1);
        o.shuffle = false;
        o.group_by_length = grouped;
        o.max_samples = 22;
        DataLoader loader(ds, tok, o);
        bool ended = false;
        for (int i = 0; i < 12; ++i) {
          Batch b = loader.next();
          if (ended) {
            EXPECT_EQ(b.rows, 0) << "a batch after an empty one";
          }
          if (b.rows == 0) {
            ended = true;
            continue;
          }
          for (auto id : b.sample_ids) EXPECT_LT(id, 22u);
          collect(b, seen);
        }
        EXPECT_TRUE(ended);
      }
      EXPECT_EQ(seen.size(), 22u);
    }
  }
}

TEST(DataLoader, WorkerErrorsReachTheConsumer) {
  auto opts = options(0, 1, 8, 1, 2);
  opts.shuffle = false;
  DataLoader l(std::make_shared<FailingDataset>(), make_char_tokenizer(), opts);
  expect_error([&] { l.next(); }, ExitCode::kBadData, {"record 3"});
}

// Counts get() calls: how far the workers ran ahead of the consumer.
class CountingDataset final : public Dataset {
 public:
  uint64_t size() const override { return 1000; }
  Sample get(uint64_t, SampleRng&) const override {
    ++calls;
    return Sample{"ACGTACGTAC"};
  }
  int64_t skipped_records() const override { return 0; }
  std::string describe() const override { return "counting"; }
  mutable std::atomic<int64_t> calls{0};
};

TEST(DataLoader, PrefetchIsBounded) {
  auto ds = std::make_shared<CountingDataset>();
  auto o = options(0, 1, 4, 1, 2);
  o.prefetch_factor = 2;  // at most 2 x 2 = 4 batches ahead of the consumer
  DataLoader l(ds, make_char_tokenizer(), o);
  // Wait (up to 10 s, the machine may be loaded) for the queue to fill, then check that the
  // workers stay at the bound.
  auto settle = [&](int64_t expected) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (ds->calls.load() < expected && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_EQ(ds->calls.load(), expected);
  };
  settle(4 * 4);
  l.next();
  settle(5 * 4);
  l.stop();
  EXPECT_EQ(l.state().consumed_samples, 4u);
}

// Variable-length dataset for group_by_length.
class LengthDataset final : public Dataset {
 public:
  uint64_t size() const override { return 64; }
  Sample get(uint64_t index, SampleRng&) const override {
    return Sample{testing::random_bases(1 + (index * 37) % 60, index)};
  }
  int64_t skipped_records() const override { return 0; }
  std::string describe() const override { return "lengths"; }
};

TEST(DataLoader, GroupByLengthReducesPaddingKeepsSamples) {
  auto ds = std::make_shared<LengthDataset>();
  auto tok = make_char_tokenizer();
  auto run = [&](bool group) {
    auto o = options(0, 1, 4, 4, 1);
    o.objective.max_seq_length = 64;
    o.group_by_length = group;
    DataLoader l(ds, tok, o);
    int64_t padded = 0;
    std::set<uint64_t> ids;
    for (int i = 0; i < 8; ++i) {
      Batch b = l.next();
      padded += b.rows * b.seq_len;
      ids.insert(b.sample_ids.begin(), b.sample_ids.end());
    }
    EXPECT_EQ(ids.size(), 32u);
    return std::make_pair(padded, ids);
  };
  auto [plain_tokens, plain_ids] = run(false);
  auto [grouped_tokens, grouped_ids] = run(true);
  EXPECT_EQ(plain_ids, grouped_ids);
  EXPECT_LT(grouped_tokens, plain_tokens);
}

// Note [Sequence-length warm-up]: the stage is a function of the global step; each stage's
// micro-batch holds micro_batch_size x max / seq_len rows of seq_len tokens (tokens per step
// constant), cut from the very windows the loader without warm-up gives, in order, each row a
// window's piece at j (n - w) / (pieces - 1).
TEST(DataLoader, SeqLenWarmupCutsTheSameWindowsIntoTheStagesRows) {
  EXPECT_EQ(stage_shape({{2, 8}, {1, 16}}, 32, 0).pieces, 4);
  EXPECT_EQ(stage_shape({{2, 8}, {1, 16}}, 32, 1).seq_len, 8);
  EXPECT_EQ(stage_shape({{2, 8}, {1, 16}}, 32, 2).seq_len, 16);
  EXPECT_EQ(stage_shape({{2, 8}, {1, 16}}, 32, 3).pieces, 1);
  EXPECT_EQ(stage_shape({}, 32, 0).seq_len, 32);

  auto ds = genome(31);  // causal LM at 32 tokens: [CLS] + 31 bases
  auto tok = make_char_tokenizer();
  auto o = options(0, 1, 3, 2, 1);
  o.objective.objective = Objective::kCausalLm;
  DataLoader plain(ds, tok, o);
  o.seq_len_warmup = {{2, 8}, {1, 16}};
  DataLoader warm(ds, tok, o);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{8, 4}, {8, 4}, {16, 2}, {32, 1}};
  for (size_t step = 0; step < shapes.size(); ++step) {
    const auto [len, pieces] = shapes[step];
    for (int m = 0; m < 2; ++m) {
      SCOPED_TRACE(fmt::format("step {} micro {}", step, m));
      const Batch p = plain.next(), w = warm.next();
      ASSERT_EQ(w.seq_len, len);
      ASSERT_EQ(w.rows, 3 * pieces);
      EXPECT_EQ(w.rows * w.seq_len, p.rows * p.seq_len);
      for (int64_t r = 0; r < w.rows; ++r) {
        const int64_t parent = r / pieces, j = r % pieces;
        EXPECT_EQ(w.sample_ids[r], p.sample_ids[parent]);
        // Row r: [CLS] then the len - 1 bases of piece j, from the window at [CLS] + start.
        const int64_t start = pieces == 1 ? 0 : j * (31 - (len - 1)) / (pieces - 1);
        EXPECT_EQ(w.input_ids[r * len], kClsId);
        for (int64_t t = 1; t < len; ++t) {
          ASSERT_EQ(w.input_ids[r * len + t], p.input_ids[parent * p.seq_len + 1 + start + t - 1])
              << "row " << r << " token " << t;
        }
      }
    }
  }
  // Resumed after step 1 (in the first stage): the loader that starts at the saved cursor with
  // first_step 1 builds what the uninterrupted one built, stage by stage.
  DataLoader whole(ds, tok, o);
  std::vector<Batch> expected;
  for (int i = 0; i < 8; ++i) expected.push_back(whole.next());
  SamplerState saved = whole.state();
  saved.consumed_samples = 6;  // one step of 3 x 2
  o.first_step = 1;
  DataLoader resumed(ds, tok, o, &saved);
  for (int i = 2; i < 8; ++i) {
    const Batch b = resumed.next();
    EXPECT_EQ(b.input_ids, expected[i].input_ids) << "micro-batch " << i;
    EXPECT_EQ(b.sample_ids, expected[i].sample_ids) << "micro-batch " << i;
  }
}

// Two ranks in a warm-up stage hold the one-rank rows between them (masked LM, the masks
// drawn from each window's rng in piece order).
TEST(DataLoader, SeqLenWarmupRanksSplitTheOneRankRows) {
  auto ds = genome();
  auto tok = make_char_tokenizer();
  auto one = options(0, 1, 4, 1, 0);
  one.seq_len_warmup = {{3, 16}};
  // Each row of three batches of `loader` (`rows` rows of 16 tokens each) by its sample id: its
  // ids, then its labels.
  using Rows = std::map<uint64_t, std::vector<int64_t>>;
  auto collect = [](DataLoader& loader, int64_t rows, Rows& into) {
    for (int i = 0; i < 3; ++i) {
      const Batch b = loader.next();
      ASSERT_EQ(b.rows, rows);
      for (int64_t r = 0; r < b.rows; ++r) {
        auto& row = into[b.sample_ids[r]];
        row.insert(row.end(), b.input_ids.begin() + r * 16, b.input_ids.begin() + (r + 1) * 16);
        row.insert(row.end(), b.labels.begin() + r * 16, b.labels.begin() + (r + 1) * 16);
      }
    }
  };
  Rows single, split;
  DataLoader l1(ds, tok, one);
  collect(l1, 8, single);
  for (int rank : {0, 1}) {
    auto o = options(rank, 2, 2, 1, 0);
    o.seq_len_warmup = one.seq_len_warmup;
    DataLoader l(ds, tok, o);
    collect(l, 4, split);
  }
  EXPECT_EQ(single.size(), 12u);
  EXPECT_EQ(split, single);
}

}  // namespace
}  // namespace dnallm::data
