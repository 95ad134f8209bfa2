// HyenaDNA's long convolution under context parallelism (Note [Hyena context parallelism],
// worker/parallel/context_parallel.hpp): the family's operator over the generic context
// collectives (sequence_to_channels, channels_to_sequence), kept in the family's folder so that
// worker/parallel names no family. Declared in hyena.hpp.

#include "core/error.hpp"
#include "worker/models/hyena/hyena.hpp"
#include "worker/parallel/context_parallel.hpp"

namespace dnallm::models::hyena {
using parallel::check_shard;
using parallel::shape_text;
using torch::Tensor;

Tensor context_parallel_long_conv(const Tensor& u, const Tensor& k, const Tensor& bias,
                                  comm::Communicator& group) {
  constexpr const char* what = "context_parallel_long_conv";
  check_shard(u, what);
  const int world = group.world_size();
  const int64_t D = u.size(2), L = u.size(1) * world;
  const auto block = parallel::channel_block(D, world, group.rank());
  DNALLM_CHECK(k.dim() == 2 && bias.dim() == 1, ExitCode::kUsage,
               "{}: expected a filter [channels, L] and a bias [channels], got {} and {}", what,
               shape_text(k), shape_text(bias));
  const auto k_local = k.size(0) == D ? k.slice(0, block.first, block.last) : k;
  const auto bias_local = bias.size(0) == D ? bias.slice(0, block.first, block.last) : bias;
  DNALLM_CHECK(k_local.size(0) == block.count() && k_local.size(1) == L &&
                   bias_local.size(0) == block.count(),
               ExitCode::kUsage,
               "{}: the filter {} and bias {} match neither the {} channels x {} positions of the "
               "sequence nor this rank's {} channels",
               what, shape_text(k), shape_text(bias), D, L, block.count());
  // [B, L, D / C] -> the model's layout [B, D / C, L] (a view: fft_long_conv copies into its
  // FFT buffers anyway) and back.
  const auto channels = parallel::sequence_to_channels(u, group);
  const auto y = fft_long_conv(channels.transpose(1, 2), k_local, bias_local);
  return parallel::channels_to_sequence(y.transpose(1, 2), group);
}

}  // namespace dnallm::models::hyena
