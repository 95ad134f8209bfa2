// The data x context mesh (issue 26): `parallel.context_parallel = C` splits the world of W
// ranks into W / C context groups of C ranks each.
//
// Note [Data x context mesh]
//  - Context groups are consecutive ranks: rank r is context rank r % C of group r / C
//    (torchtitan puts context innermost: the ranks of a group share a node when C divides
//    the ranks per node, and their all-to-alls stay on the fast links). The group is a
//    Communicator::split of the world.
//  - Data: the D = W / C groups are the data-parallel ranks. Every rank of a group reads the
//    same samples: the sampler, the evaluation split, the resume cursor and the global batch
//    (micro_batch_size x grad_accum_steps x D) count data ranks (data rank r / C of D), so a
//    run at (D, C) sees the samples of a run at (D, 1) step for step.
//  - Sequences: each rank holds its positions of every sequence (context_shard()): T padded
//    up to a multiple of C (contiguous) or 2C (zig-zag) with [PAD] (mask 0, label -100), a
//    causal LM's labels shifted on the whole sequence first (position i predicts token
//    i + 1, so the last position of a chunk is scored against the first token of the next),
//    then the rank's columns taken. The model does not shift again (spec().shift_labels is
//    false under context parallelism).
//  - Classifiers: a row's label stays on context rank 0; the model pools over the group (Note
//    [Context-parallel pooling], worker/parallel/context_parallel.hpp).
//  - Loss and gradients: nothing new. A rank's loss sum and label count are those of its
//    positions; summed over the world (GradientSync::sum_scalar) they are the global batch's,
//    so Note [Loss normalisation] holds unchanged. A parameter's gradient on a rank is the
//    part of the whole gradient that flowed through its uses there (the context-parallel
//    operators' backward returns the other ranks' shares to them), so the gradients summed
//    over the whole world (data x context: the data-parallel engine's world, unchanged) are
//    the global batch's gradients.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/communicator.hpp"
#include "core/config.hpp"
#include "worker/data/batch.hpp"
#include "worker/models/context_shard.hpp"
#include "worker/models/language_model.hpp"

namespace dnallm::parallel {

// Where a rank sits in the mesh (Note [Data x context mesh]).
struct MeshCoordinates {
  int data_rank = 0;
  int data_world = 1;
  int context_rank = 0;
  int context_size = 1;
};
// Error(kUsage) unless 1 <= context_parallel and it divides `world`.
MeshCoordinates mesh_coordinates(int rank, int world, int64_t context_parallel);

// What a whole sequence's length is padded up to a multiple of: C (contiguous) or 2C (zig-zag).
int64_t context_length_multiple(models::ContextLayout layout, int context_size);

// The global positions of context rank `rank`'s local positions, in local order, for a whole
// length `length` (a multiple of context_length_multiple()): contiguous [r T/C, (r+1) T/C);
// zig-zag chunks r then 2C-1-r of 2C chunks of T/(2C).
std::vector<int64_t> context_positions(models::ContextLayout layout, int64_t length,
                                       int context_size, int rank);

struct ContextShardOptions {
  models::ContextLayout layout = models::ContextLayout::kContiguous;
  int context_size = 1;
  int context_rank = 0;
  bool shift_labels = false;  // a causal LM whose model shifts labels itself without CP
  int64_t pad_id = 0;
};
// This rank's shard of a whole language-modelling batch [rows, T] (Note [Data x context
// mesh]): [rows, T' / C] with T' = T padded up to context_length_multiple(). Label count and
// `padded` are the shard's own. A classification batch (one label a row) keeps its labels on
// context rank 0 only, kIgnoreIndex elsewhere (Note [Context-parallel pooling]). Error(kUsage)
// for a packed batch (segment_ids) or a regression one (targets).
data::Batch context_shard(const data::Batch& whole, const ContextShardOptions& options);

// A rank's place in the mesh and its context group, for the trainer: cuts batches and keeps
// the model's ContextParallel (Note [Context parallelism in a model]) pointing at the
// positions of the batch about to run.
class ContextMesh {
 public:
  // Collective over `world` (Communicator::split, in issue order): call on every rank at the
  // same point. `world` must outlive nothing here: the group is independent of it.
  ContextMesh(comm::Communicator& world, int64_t context_parallel, models::ContextLayout layout,
              bool shift_labels, int64_t pad_id);

  const MeshCoordinates& coordinates() const { return coords_; }
  comm::Communicator& group() { return *group_; }
  // What set_context_parallel() receives; select() updates it in place.
  std::shared_ptr<models::ContextParallel> model_view() const { return view_; }
  data::Batch shard(const data::Batch& whole) const { return context_shard(whole, options_); }
  // Before the forward of a shard of `local_length` positions a row (and its backward: the
  // view must not change until that backward is done): full_length and positions for it.
  void select(int64_t local_length, const torch::Device& device);

 private:
  MeshCoordinates coords_;
  ContextShardOptions options_;
  std::unique_ptr<comm::Communicator> group_;
  std::shared_ptr<models::ContextParallel> view_;
};

// dnallm-train's mesh: null when parallel.context_parallel = 1; else (a collective over `world`,
// the job's communicator) the mesh for `model`'s family, the model already set on it. Refuses
// (Error(kUsage)) what context parallelism does not do yet, before any training: packing,
// training.batch_size = "auto", regression, a family (or a classifier's pooling) without it, and a
// model.max_seq_length that a sequence padded to the layout's multiple would exceed.
std::shared_ptr<ContextMesh> make_context_mesh(const Config& config, comm::Communicator* world,
                                               models::LanguageModelImpl& model);

}  // namespace dnallm::parallel
