#include "worker/parallel/context_mesh.hpp"

#include <algorithm>

#include "comm/reformable_communicator.hpp"
#include "core/error.hpp"
#include "worker/parallel/context_parallel.hpp"

namespace dnallm::parallel {

MeshCoordinates mesh_coordinates(int rank, int world, int64_t context_parallel) {
  DNALLM_CHECK(context_parallel >= 1 && world % context_parallel == 0, ExitCode::kUsage,
               "parallel.context_parallel = {} does not divide the world size {}: choose a "
               "context-parallel degree that divides the number of ranks (the data-parallel "
               "degree is world size / context_parallel)",
               context_parallel, world);
  MeshCoordinates c;
  c.context_size = static_cast<int>(context_parallel);
  c.context_rank = rank % c.context_size;
  c.data_rank = rank / c.context_size;
  c.data_world = world / c.context_size;
  return c;
}

int64_t context_length_multiple(models::ContextLayout layout, int context_size) {
  return layout == models::ContextLayout::kZigZag ? 2 * int64_t{context_size} : context_size;
}

std::vector<int64_t> context_positions(models::ContextLayout layout, int64_t length,
                                       int context_size, int rank) {
  const int64_t multiple = context_length_multiple(layout, context_size);
  DNALLM_CHECK(length % multiple == 0 && rank >= 0 && rank < context_size, ExitCode::kFailure,
               "internal: context positions of length {} for rank {} of {}", length, rank,
               context_size);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(length / context_size));
  auto chunk = [&](int64_t index, int64_t size) {
    for (int64_t i = 0; i < size; ++i) out.push_back(index * size + i);
  };
  if (layout == models::ContextLayout::kContiguous) {
    chunk(rank, length / context_size);
  } else {
    const int64_t size = length / multiple;
    chunk(rank, size);
    chunk(multiple - 1 - rank, size);
  }
  return out;
}

data::Batch context_shard(const data::Batch& whole, const ContextShardOptions& o) {
  if (whole.rows == 0) return whole;  // the end of an evaluation set
  const int c = o.context_size;
  DNALLM_CHECK(whole.segment_ids.empty(), ExitCode::kUsage,
               "parallel.context_parallel = {} cannot cut packed batches yet (documents packed "
               "into one row): set data.packing = false",
               c);
  const int64_t rows = whole.rows, t = whole.seq_len;
  refuse_context_parallel_regression(!whole.targets.empty(), c);
  // A classification batch: one label a row (t = 1 with one row is a language model's).
  const bool per_row = static_cast<int64_t>(whole.labels.size()) == rows &&
                       static_cast<int64_t>(whole.labels.size()) != rows * t;
  DNALLM_CHECK(per_row || static_cast<int64_t>(whole.labels.size()) == rows * t, ExitCode::kUsage,
               "parallel.context_parallel = {}: a batch of {} rows x {} positions with {} labels "
               "is neither a language model's (one a position) nor a classifier's (one a row)",
               c, rows, t, whole.labels.size());
  const int64_t multiple = context_length_multiple(o.layout, c);
  const int64_t padded = (t + multiple - 1) / multiple * multiple;
  const auto positions = context_positions(o.layout, padded, c, o.context_rank);
  const auto local = static_cast<int64_t>(positions.size());

  data::Batch out;
  out.rows = rows;
  out.seq_len = local;
  out.sample_ids = whole.sample_ids;
  // Summed over the group: the whole batch's bases.
  out.num_bases = o.context_rank == 0 ? whole.num_bases : 0;
  const bool masked = !whole.attention_mask.empty() || padded > t;
  const auto n = static_cast<size_t>(rows * local);
  out.input_ids.assign(n, o.pad_id);
  if (per_row) {
    // Note [Context-parallel pooling]: a row's label is context rank 0's alone.
    out.labels.assign(static_cast<size_t>(rows), data::kIgnoreIndex);
    if (o.context_rank == 0) out.labels = whole.labels;
  } else {
    out.labels.assign(n, data::kIgnoreIndex);
  }
  if (masked) out.attention_mask.assign(n, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t* ids = whole.input_ids.data() + r * t;
    const int64_t* labels = per_row ? nullptr : whole.labels.data() + r * t;
    for (int64_t j = 0; j < local; ++j) {
      const int64_t p = positions[static_cast<size_t>(j)];
      const auto at = static_cast<size_t>(r * local + j);
      if (p < t) {
        out.input_ids[at] = ids[p];
        if (masked)
          out.attention_mask[at] =
              whole.attention_mask.empty() ? 1 : whole.attention_mask[r * t + p];
      }
      // Position p predicts token p + 1 of the WHOLE sequence (Note [Data x context mesh]).
      const int64_t from = o.shift_labels ? p + 1 : p;
      if (!per_row && from < t) out.labels[at] = labels[from];
    }
  }
  out.num_label_tokens = std::count_if(out.labels.begin(), out.labels.end(),
                                       [](int64_t l) { return l != data::kIgnoreIndex; });
  out.padded = masked && std::find(out.attention_mask.begin(), out.attention_mask.end(), 0) !=
                             out.attention_mask.end();
  return out;
}

ContextMesh::ContextMesh(comm::Communicator& world, int64_t context_parallel,
                         models::ContextLayout layout, bool shift_labels, int64_t pad_id)
    : coords_(mesh_coordinates(world.rank(), world.world_size(), context_parallel)),
      view_(std::make_shared<models::ContextParallel>()) {
  options_.layout = layout;
  options_.context_size = coords_.context_size;
  options_.context_rank = coords_.context_rank;
  options_.shift_labels = shift_labels;
  options_.pad_id = pad_id;
  // Note [Data x context mesh]: consecutive ranks, ranked within the group by world rank.
  // Reformable: Note [In-process recovery] splits the re-formed world again and swaps the new
  // group in under the model's view.
  auto group = world.split(coords_.data_rank, coords_.context_rank);
  DNALLM_CHECK(group != nullptr && group->world_size() == coords_.context_size &&
                   group->rank() == coords_.context_rank,
               ExitCode::kFailure, "internal: the context group of rank {} has {} ranks",
               world.rank(), group ? group->world_size() : 0);
  group_ = std::make_unique<comm::ReformableCommunicator>(std::move(group), "context");
  view_->group = group_.get();
}

void ContextMesh::select(int64_t local_length, const torch::Device& device) {
  const int64_t full = local_length * coords_.context_size;
  auto& v = *view_;
  if (v.full_length == full && v.positions.defined() && v.positions.device() == device) return;
  const auto positions =
      context_positions(options_.layout, full, coords_.context_size, coords_.context_rank);
  v.positions = torch::tensor(positions, torch::kInt64).to(device);
  v.full_length = full;
}

std::shared_ptr<ContextMesh> make_context_mesh(const Config& config, comm::Communicator* world,
                                               models::LanguageModelImpl& model) {
  const int64_t c = config.parallel.context_parallel;
  if (c == 1) return nullptr;
  DNALLM_CHECK(world != nullptr, ExitCode::kUsage,
               "parallel.context_parallel = {} needs at least {} ranks, and this worker runs "
               "alone: start {} or more ranks (dnallm-launch --nproc-per-node) or set "
               "parallel.context_parallel = 1",
               c, c, c);
  mesh_coordinates(world->rank(), world->world_size(), c);  // the degree divides the world
  DNALLM_CHECK(!config.data.packing, ExitCode::kUsage,
               "parallel.context_parallel = {} cannot cut packed rows yet (documents packed into "
               "one row): set data.packing = false",
               c);
  DNALLM_CHECK(config.training.batch_size != cfg::BatchSize::kAuto, ExitCode::kUsage,
               "parallel.context_parallel = {} with training.batch_size = \"auto\": the "
               "search probes whole sequences on one rank: set training.micro_batch_size",
               c);
  const auto& spec = model.spec();
  // Classifiers pool over the group (Note [Context-parallel pooling]); a regressor's target
  // has no "ignored" value to give the other ranks of a group yet.
  refuse_context_parallel_regression(spec.task == models::Task::kRegression, c);
  const int64_t multiple = context_length_multiple(spec.context_layout, static_cast<int>(c));
  DNALLM_CHECK(spec.extends_past_max_length || spec.max_seq_length % multiple == 0,
               ExitCode::kUsage,
               "model.max_seq_length = {} is not a multiple of {} (parallel.context_parallel = "
               "{}): sequences are padded up to a multiple of it, which would pass the model's "
               "longest input; choose a model.max_seq_length that is",
               spec.max_seq_length, multiple, c);
  // Before the model is set: its spec still says whether it shifts causal labels itself.
  const bool shift = spec.shifts_labels();
  auto mesh = std::make_shared<ContextMesh>(*world, c, spec.context_layout, shift, spec.pad_id);
  model.set_context_parallel(mesh->model_view());  // a family without it refuses here
  return mesh;
}

}  // namespace dnallm::parallel
