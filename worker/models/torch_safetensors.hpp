// safetensors files (the format: checkpoint/safetensors.hpp) written from and read into torch
// tensors, for every family's model directory and hub import.
#pragma once

#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/safetensors.hpp"

namespace dnallm::models {

// The file is written durably; a tensor is copied to the host, contiguous, in its own dtype.
checkpoint::SafetensorsTensor safetensors_tensor(const std::string& name, const torch::Tensor& t);
std::vector<checkpoint::SafetensorsTensor> safetensors_tensors(
    const std::vector<std::pair<std::string, torch::Tensor>>& tensors);
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});
std::map<std::string, torch::Tensor> load_safetensors(const std::string& path);

}  // namespace dnallm::models
