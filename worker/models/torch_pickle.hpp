// A state dict saved by Python's torch.save (the zip format: <name>/data.pkl + <name>/data/<key>),
// read without Python: pytorch_model.bin as Hugging Face repositories ship it (DNABERT-2).
//
// Note [State-dict unpickler]: LibTorch's own unpickler (torch::pickle_load) turns
// collections.OrderedDict into None, so it cannot read a state dict. This is a small pickle
// machine for exactly what torch.save writes for one (protocol 2): dictionaries (OrderedDict
// included; its _metadata state ignored), tuples, lists, strings, integers, floats, booleans,
// None, persistent storage ids and the tensor rebuild functions (torch._utils._rebuild_tensor_v2,
// _rebuild_parameter). Any other global (a Python class or function) is refused, so no code of
// the file's choosing can be named, let alone run. The file is untrusted: every read is bounds-
// checked, the stack and memo are bounded, and any violation is Error(kCheckpointCorrupt)
// naming the file.
#pragma once

#include <torch/torch.h>

#include <map>
#include <string>

namespace dnallm::models {

// Named tensors of the state dict in `path` (CPU, their own dtypes).
std::map<std::string, torch::Tensor> load_torch_state_dict(const std::string& path);

}  // namespace dnallm::models
